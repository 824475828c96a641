"""Start-up without the garbage collector's passes over what it allocates.

Importing jax, flax and jmoe and loading a model create about a million long-lived objects and
almost no garbage, yet each object allocated counts towards the collector's next pass, and its
passes over the growing heap found nothing to free while taking a tenth of a warm `jmoe generate`.
`collector_paused` holds the collector off for the import and for `jmoe.load`, then puts it back
as it was. The `jmoe` command, a process of its own, also freezes what start-up left
(`freeze_start_up`): later passes, and the last one as the interpreter exits (a second on the
bundled model), no longer walk the loaded model.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collector_paused():
    """The garbage collector off inside, restored to its state before after (also usable as a decorator)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def freeze_start_up() -> None:
    """Moves every object alive now out of the collector's reach for the rest of the process (gc.freeze),
    the model just loaded included. Only for a process that is jmoe's alone: a freed frozen object in a
    reference cycle is never reclaimed. Without a collection first: on the bundled model one takes a
    quarter of a second to find about 2,500 such objects (a few hundred KB), kept for good instead."""
    gc.freeze()

"""Expert records written into pool slots: one expert version's bytes (jmoe/format.py's layout)
become one slot of each of its tier's pool arrays."""

from __future__ import annotations

import jax

import cpu_kernels
from jmoe.format import RecordLayout


def write_records(pool, slots, records, layout: RecordLayout, on_cpu: bool | None = None):
    """pool (a tier's ExpertWeights [S, ...]) with slot slots[i] overwritten by records[i] (uint8
    [n, layout.nbytes]) for every slot in [0, S) (others skipped); in place when pool is donated.
    On the CPU the native kernels copy the bytes (cpu_kernels.write_slots says why); `on_cpu`
    says whether the step runs there (default: whether they are available here)."""
    leaves, treedef = jax.tree.flatten(pool)
    return treedef.unflatten([cpu_kernels.write_slots(leaf, records, slots, spec.offset, on_cpu=on_cpu)
                              for leaf, spec in zip(leaves, layout.leaves, strict=True)])

"""One serving engine over several processes: process 0 decides, the others replay its decisions.

Every process of a jax.distributed job must run the same steps in the same order. What a serving
engine does next depends on things only process 0 sees (requests arriving over HTTP, clients
cancelling or going quiet, timeouts), so process 0 publishes, before each iteration of its loop,
which requests ended, which were admitted and which prompt is scored (echo's logprobs), through
the job's key-value store; the other processes' engines apply exactly that and then run the same
admission, scoring and step code, whose other
inputs (rows, positions, tokens) are then the same everywhere.
"""

from __future__ import annotations

import dataclasses
import json

from jmoe.decoding.sampling import SamplingOptions

_KEY = "jmoe/serve/"
_WAIT_MS = 1000  # a follower waits this long per try for the next iteration (an idle server sends none)


def request_to_dict(request) -> dict:
    return {**dataclasses.asdict(request), "sampling": dataclasses.asdict(request.sampling)}


def request_from_dict(d: dict):
    from jmoe.serving.requests import Request

    return Request(**{**d, "sampling": SamplingOptions(**d["sampling"])})


class Mirror:
    """Process 0's side (publish) or another process's (receive) of the iterations of one engine."""

    def __init__(self):
        from jax._src.distributed import global_state  # the job's key-value store

        self.client = global_state.client
        self.iteration = 0

    def publish(self, ended: list[tuple[int, str]], admitted: list[tuple[int, object]],
                scored: list[tuple[list[int], int]] = (), close: bool = False) -> None:
        """Before an iteration: requests ended and admitted, and prompts scored (echo's: `(ids, top)`)."""
        payload = dict(end=ended, admit=[(i, request_to_dict(r)) for i, r in admitted], score=list(scored),
                       close=close)
        self.client.key_value_set(f"{_KEY}{self.iteration}", json.dumps(payload))
        if self.iteration >= 2:  # followers run in lockstep (the step's collectives): two back is read
            self.client.key_value_delete(f"{_KEY}{self.iteration - 2}")
        self.iteration += 1

    def receive(self, give_up=None) -> dict | None:
        """The next iteration's decisions (blocks while process 0 is idle); None once give_up(),
        asked between waits, says to stop waiting."""
        key = f"{_KEY}{self.iteration}"
        while True:
            try:
                raw = self.client.blocking_key_value_get(key, _WAIT_MS)
                break
            except Exception as e:  # noqa: BLE001 - a timeout (idle leader): try again; else the job is gone
                if "DEADLINE" not in str(e).upper() and "TIMEOUT" not in str(e).upper():
                    raise
            if give_up is not None and give_up():
                return None
        self.iteration += 1
        d = json.loads(raw)
        d["admit"] = [(i, request_from_dict(r)) for i, r in d["admit"]]
        return d

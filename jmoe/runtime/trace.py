"""A record of what a run did, step by step, for bench/lib/gpu_model.py to replay with GPU parameters.

On a machine without a GPU, measured times are CPU times; the trace says what a GPU would have
had to do instead: per step, how many tokens it ran, how many expert bytes each MoE layer's
computation read (the version that ran), how many bytes each transfer moved and of what kind
(demand, prefetch, transition), how many of those bytes the host waited for, and how many times
the host synced. Enabled with jmoe.load(..., trace=True); the model's `trace` is then a Trace.
A speculative draft writes its steps into the same trace (source "draft", phase "draft"), so the
records keep the order in which the device would have run them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepRecord:
    index: int
    phase: str
    tokens: int
    expert_bytes: dict[int, int] = field(default_factory=dict)  # MoE layer -> bytes read by its experts
    transfers: list[tuple[int, str]] = field(default_factory=list)  # (bytes, kind), in issue order
    waited_bytes: int = 0  # of the transfers the host blocked on during this step
    syncs: int = 0
    cpu_tokens: int = 0  # expert-token products run on the host CPU
    # a step that fetches experts itself (jmoe/layers/fetch.py): what its fetch slots move on an
    # accelerator, where every slot moves a record each step: before a layer routes (requests and
    # look-ahead, which overlap the previous layer) and after (misses, which the layer waits for);
    # the fetches it actually needed are its transfers of kinds "step-prefetch" and "step-demand"
    slot_bytes_early: int = 0
    slot_bytes_late: int = 0
    # chains of conditional fetches (an accelerator's misses and look-ahead): each costs a predicate
    # read, each fetch in it one more, and its fetches are the step's "step-*" transfers
    chains: int = 0


class Trace:
    def __init__(self):
        self.steps: dict[tuple[str, int], StepRecord] = {}  # (source, its step index) -> record, in run order
        self.current: StepRecord | None = None

    def begin(self, index: int, phase: str, tokens: int, source: str = "target") -> None:
        self.steps.pop((source, index), None)  # a reused index (stats reset) goes to the end
        self.current = self.steps[(source, index)] = StepRecord(index, phase, tokens)

    def expert_reads(self, index: int, layer: int, nbytes: int, source: str = "target") -> None:
        record = self.steps.get((source, index))
        if record is not None:
            record.expert_bytes[layer] = record.expert_bytes.get(layer, 0) + int(nbytes)

    def transfer(self, nbytes: int, kind: str) -> None:
        if self.current is not None:
            self.current.transfers.append((int(nbytes), kind))

    def fetch_slots(self, early: int, late: int, chains: int = 0) -> None:
        if self.current is not None:
            self.current.slot_bytes_early += int(early)
            self.current.slot_bytes_late += int(late)
            self.current.chains += int(chains)

    def wait(self, nbytes: int) -> None:
        if self.current is not None:
            self.current.waited_bytes += int(nbytes)

    def sync(self) -> None:
        if self.current is not None:
            self.current.syncs += 1

    def cpu(self, tokens: int) -> None:
        if self.current is not None:
            self.current.cpu_tokens += int(tokens)

    def records(self) -> list[StepRecord]:
        return list(self.steps.values())

    def clear(self) -> None:
        self.steps.clear()
        self.current = None

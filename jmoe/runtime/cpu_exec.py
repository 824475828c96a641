"""Running cold experts on the host CPU (HAQ's CPU–GPU collaboration, Fiddler).

When an expert is not resident and only a few tokens need it, moving those tokens' activations to
the host and running the expert there can beat moving the expert's weights to the device. A cost
model measured once at load compares the two per token: fetching costs one transfer, T_transfer,
then the device's time per token; the CPU costs its own (larger) time per token. The CPU wins for
up to n_crit = (T_transfer - T_call) / (lat_cpu - lat_device) tokens, T_call being what a separate
CPU call costs beyond its tokens (zero on an accelerator, where the transfer dwarfs it).

When the device is the CPU itself, a transfer is a read from the page cache and a memcpy into a
pool slot, and running the expert in place computes the same at the same speed per token, so the
choice is between that copy and the fixed cost of one more kernel call outside the layer's grouped
one: both are measured at load, and every cold expert runs in place when the call is the cheaper
(n_crit unbounded), else none does (n_crit 0).

An expert runs as it is stored: its record's arrays, viewed in the memory-mapped expert file, are
handed to jax without a copy (a pool of one slot) and multiplied by the CPU kernels' expert entry
point (jmoe.kernels.expert_ffn on its "cpu" backend: HAQ smoothing, W8A8, biases and the clamped SwiGLU as on the
device). No dequantized copy is made or kept; after the call the record's pages are unmapped again
(they stay in the page cache), so what the CPU has run never accumulates in the process.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import cpu_kernels
from jmoe.kernels import expert_ffn
from jmoe.layers.experts import expert_activation
from jmoe.quant import ExpertWeights
from jmoe.runtime.host_memory import device_is_host
from jmoe.runtime.host_store import HostStore
from jmoe.runtime.pools import TierPool
from kernel_formats.glu import GatedActivation

MAX_CRITICAL_TOKENS = 1 << 16


@dataclass(frozen=True)
class CostModel:
    transfer_s: float  # one expert version host -> device, until ready
    cpu_per_token_s: float  # the CPU's time per token of one expert (activations moved both ways)
    device_per_token_s: float  # the device's
    cpu_call_s: float = 0.0  # what one CPU call costs beyond its tokens' time
    same_memory: bool = False  # the device is the CPU (per-token times equal: only the fixed costs differ)

    @property
    def critical_tokens(self) -> int:
        """Most tokens for which the CPU is expected to beat fetching the expert:
        (T_transfer - T_call) / (cpu - device) per token."""
        saving = self.transfer_s - self.cpu_call_s
        if saving <= 0:
            return 0
        gap = self.cpu_per_token_s - self.device_per_token_s
        if self.same_memory or gap <= 0:
            return MAX_CRITICAL_TOKENS
        return int(min(MAX_CRITICAL_TOKENS, saving / gap))


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@partial(jax.jit, static_argnames=("activation", "int8_dot", "on_host"))
def _one_expert(rows, pool: ExpertWeights, activation: GatedActivation, int8_dot: bool, on_host: bool = True):
    """rows [n, D] through the expert of a one-slot pool (with its biases, if any) -> [n, D].
    on_host: the arguments are on the host CPU device, so the native kernels run it even where the
    default backend is an accelerator (False: the device's own time, calibrate's comparison)."""
    slot = jnp.zeros((1,), jnp.int32)
    with cpu_kernels.host_computation() if on_host else contextlib.nullcontext():
        return expert_ffn(rows, slot, pool.gate_up, pool.down, block_rows=rows.shape[0], backend="cpu",
                          gate_up_bias=pool.gate_up_bias, down_bias=pool.down_bias, activation=activation,
                          int8_dot=int8_dot)


class CpuExecutor:
    def __init__(self, host: HostStore, device, dtype, int8_dot: bool = False):
        self.host = host
        self.int8_dot = int8_dot
        self.store = host.store
        self.device = device
        self.cpu = jax.devices("cpu")[0]
        self.same_memory = device_is_host(device)
        self.dtype = dtype
        self.activation = expert_activation(host.store.config)
        self.cost: CostModel | None = None

    def one_slot_pool(self, tier: str, layer: int, expert: int) -> ExpertWeights:
        """The expert's stored arrays as a pool of one slot on the CPU, aliasing the mapped file."""
        record = self.store.record(tier, layer, expert)  # numpy views of the mapped file, 64-byte aligned
        return jax.tree.map(lambda a: jax.device_put(a[None], self.cpu), record)

    def run(self, rows: jax.Array, tier: str, layer: int, expert: int) -> jax.Array:
        """rows [n, D] on the device -> expert output [n, D] on the device, computed on the CPU."""
        n = rows.shape[0]
        padded = _bucket(n)
        x = np.zeros((padded, rows.shape[1]), self.dtype)
        x[:n] = np.asarray(rows)
        try:
            y = np.asarray(_one_expert(jax.device_put(x, self.cpu), self.one_slot_pool(tier, layer, expert),
                                       self.activation, self.int8_dot))
        finally:
            self.store.release(tier, layer, expert)
        return jax.device_put(y[:n], self.device).astype(rows.dtype)

    def calibrate(self, tier: str, samples: int = 3) -> CostModel:
        """Measure one transfer, and the CPU's and the device's time per token on layer 0's experts
        (on the CPU: a transfer with its slot write against one in-place call of one token)."""
        target = jax.sharding.SingleDeviceSharding(self.device, memory_kind="device")
        if self.same_memory:
            self.cost = self._calibrate_same_memory(tier, samples, target)
            return self.cost
        transfers = []
        for e in range(samples):
            t = time.perf_counter()
            jax.device_put(self.host.record(tier, 0, e), target).block_until_ready()
            transfers.append(time.perf_counter() - t)
        D = self.store.config.hidden_size
        on_device = jax.device_put(self.one_slot_pool(tier, 0, 0), self.device)
        self.store.release(tier, 0, 0)

        def per_token(run) -> float:
            times = {}
            for n in (1, 16):
                run(n)  # compile
                runs = []
                for _ in range(samples):
                    t = time.perf_counter()
                    run(n).block_until_ready()
                    runs.append(time.perf_counter() - t)
                times[n] = float(np.median(runs))
            return max((times[16] - times[1]) / 15, 0.0)

        cpu = per_token(lambda n: self.run(jax.device_put(jnp.ones((n, D), self.dtype), self.device), tier, 0, 0))
        device = per_token(lambda n: _one_expert(jax.device_put(jnp.ones((n, D), self.dtype), self.device), on_device,
                                                 self.activation, self.int8_dot and self.same_memory,
                                                 on_host=self.same_memory))
        self.cost = CostModel(float(np.median(transfers)), cpu, device)
        return self.cost

    def _calibrate_same_memory(self, tier: str, samples: int, target) -> CostModel:
        scratch = TierPool(self.store, tier, 1, self.device)
        D = self.store.config.hidden_size
        one = jax.device_put(jnp.ones((1, D), self.dtype), self.device)
        transfers, calls = [], []
        for e in range(samples + 1):  # the first of each compiles
            t = time.perf_counter()
            scratch.write(0, jax.device_put(self.host.record(tier, 0, e % self.store.num_experts), target)) \
                .block_until_ready()
            transfers.append(time.perf_counter() - t)
            t = time.perf_counter()
            self.run(one, tier, 0, e % self.store.num_experts).block_until_ready()
            calls.append(time.perf_counter() - t)
        return CostModel(float(np.median(transfers[1:])), 0.0, 0.0, cpu_call_s=float(np.median(calls[1:])),
                         same_memory=True)

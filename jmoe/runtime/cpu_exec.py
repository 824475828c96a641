"""Running cold experts on the host CPU (HAQ's CPU–GPU collaboration, Fiddler).

When an expert is not resident and only a few tokens need it, moving those tokens' activations to
the host and running the expert there can beat moving the expert's weights to the device. A cost
model measured once at load compares the two per token: fetching costs one transfer, T_transfer,
then the device's time per token; the CPU costs its own (larger) time per token. The CPU wins for
up to n_crit = T_transfer / (lat_cpu - lat_device) tokens (per-token latencies; unbounded, capped,
when the CPU is no slower per token, as on a machine whose "device" is the CPU itself).

CPU-side experts are dequantized once, into the compute dtype, and kept (`prepare` does it at load
for a known set; others on first use), so a call multiplies plain arrays (HAQ's smoothing folded
in; W8A8 versions stay quantized).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.layers.experts import expert_activation
from jmoe.quant import ExpertWeights, QArray, dequantize_expert
from jmoe.runtime.host_store import HostStore
from pallas_kernels import expert_ffn_reference
from pallas_kernels.glu import GatedActivation

MAX_CRITICAL_TOKENS = 1 << 16


@dataclass(frozen=True)
class CostModel:
    transfer_s: float  # one expert version host -> device, until ready
    cpu_per_token_s: float  # the CPU's time per token of one expert (activations moved both ways)
    device_per_token_s: float  # the device's

    @property
    def critical_tokens(self) -> int:
        """Most tokens for which the CPU is expected to beat fetching the expert: T_transfer / (cpu - device)."""
        gap = self.cpu_per_token_s - self.device_per_token_s
        if gap <= 0:
            return MAX_CRITICAL_TOKENS
        return int(min(MAX_CRITICAL_TOKENS, self.transfer_s / gap))


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@partial(jax.jit, static_argnames=("activation",))
def _one_expert(rows, weights, activation: GatedActivation):
    """rows [n, D] through one expert (pool of one slot, with its biases if any) -> [n, D]."""
    slot = jnp.zeros((1,), jnp.int32)
    pool = jax.tree.map(lambda a: a[None], weights)
    return expert_ffn_reference(rows, slot, pool.gate_up, pool.down, block_rows=rows.shape[0],
                                gate_up_bias=pool.gate_up_bias, down_bias=pool.down_bias, activation=activation)


def cpu_weights(record: ExpertWeights, dtype) -> ExpertWeights:
    """An expert version as the CPU runs it, multiplying exactly like the version on the device.

    Plain arrays in the compute dtype, with HAQ's input smoothing folded into gate_up's rows
    ((x * s) @ W = x @ (s[:, None] * W)); a W8A8 version stays quantized, because its activations
    are quantized per token at every call.
    """
    if any(isinstance(w, QArray) and w.fmt.act_bits for w in (record.gate_up, record.down)):
        return jax.tree.map(jnp.asarray, record)
    plain = dequantize_expert(record, jnp.float32)
    if isinstance(record.gate_up, QArray) and record.gate_up.act_scale is not None:
        scale = jnp.asarray(record.gate_up.act_scale, jnp.float32)[:, None]
        plain = plain._replace(gate_up=plain.gate_up * scale)
    return plain._replace(gate_up=plain.gate_up.astype(dtype), down=plain.down.astype(dtype))


class CpuExecutor:
    def __init__(self, host: HostStore, device, dtype):
        self.host = host
        self.device = device
        self.cpu = jax.devices("cpu")[0]
        self.dtype = dtype
        self.activation = expert_activation(host.store.config)
        self.cost: CostModel | None = None
        self._weights: dict = {}  # (tier, layer, expert) -> dequantized weights on the CPU

    def prepare(self, keys) -> None:
        """Dequantize these experts' (tier, layer, expert) versions now, so their calls never do."""
        for key in keys:
            self._weights_on_cpu(*key)

    def _weights_on_cpu(self, tier: str, layer: int, expert: int):
        key = (tier, layer, expert)
        if key not in self._weights:
            record = self.host.store.record(tier, layer, expert)  # numpy views of the mapped file
            with jax.default_device(self.cpu):
                self._weights[key] = jax.device_put(cpu_weights(record, self.dtype), self.cpu)
        return self._weights[key]

    def run(self, rows: jax.Array, tier: str, layer: int, expert: int) -> jax.Array:
        """rows [n, D] on the device -> expert output [n, D] on the device, computed on the CPU."""
        n = rows.shape[0]
        padded = _bucket(n)
        x = np.zeros((padded, rows.shape[1]), np.float32)
        x[:n] = np.asarray(rows, np.float32)
        y = _one_expert(jax.device_put(x.astype(self.dtype), self.cpu), self._weights_on_cpu(tier, layer, expert),
                        self.activation)
        return jax.device_put(np.asarray(y)[:n], self.device).astype(rows.dtype)

    def calibrate(self, tier: str, samples: int = 3) -> CostModel:
        """Measure one transfer, and the CPU's and the device's time per token on layer 0's experts."""
        transfers = []
        target = jax.sharding.SingleDeviceSharding(self.device, memory_kind="device")
        for e in range(samples):
            t = time.perf_counter()
            jax.device_put(self.host.record(tier, 0, e), target).block_until_ready()
            transfers.append(time.perf_counter() - t)
        D = self.host.store.config.hidden_size
        on_device = jax.device_put(self._weights_on_cpu(tier, 0, 0), self.device)

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
                                                 self.activation))
        self.cost = CostModel(float(np.median(transfers)), cpu, device)
        return self.cost

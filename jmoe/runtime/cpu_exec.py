"""Running cold experts on the host CPU (HAQ's CPU–GPU collaboration, Fiddler).

When an expert is not resident and only a few tokens need it, moving those tokens' activations to
the host and running the expert there on its host copy can beat moving the expert's weights to
the device. A cost model measured once at load (one expert's transfer time against the CPU's time
per token) gives the critical token count below which the CPU runs it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.runtime.host_store import HostStore
from pallas_kernels import expert_ffn_reference


@dataclass(frozen=True)
class CostModel:
    transfer_s: float  # one expert version host -> device, until ready
    cpu_fixed_s: float  # CPU call overhead, including moving activations both ways
    cpu_per_token_s: float

    @property
    def critical_tokens(self) -> int:
        """Largest token count for which the CPU is expected to finish before the transfer would."""
        if self.cpu_per_token_s <= 0:
            return 0
        return max(0, int((self.transfer_s - self.cpu_fixed_s) / self.cpu_per_token_s))


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@jax.jit
def _one_expert(rows, weights):
    """rows [n, D] through one expert (pool of one slot) -> [n, D]."""
    slot = jnp.zeros((1,), jnp.int32)
    pool = jax.tree.map(lambda a: a[None], weights)
    return expert_ffn_reference(rows, slot, pool.gate_up, pool.down, block_rows=rows.shape[0])


class CpuExecutor:
    def __init__(self, host: HostStore, device, dtype):
        self.host = host
        self.device = device
        self.cpu = jax.devices("cpu")[0]
        self.dtype = dtype
        self.cost: CostModel | None = None

    def _weights_on_cpu(self, tier: str, layer: int, expert: int):
        record = self.host.store.record(tier, layer, expert)  # numpy views of the mapped file
        return jax.device_put(record, self.cpu)

    def run(self, rows: jax.Array, tier: str, layer: int, expert: int) -> jax.Array:
        """rows [n, D] on the device -> expert output [n, D] on the device, computed on the CPU."""
        n = rows.shape[0]
        padded = _bucket(n)
        x = np.zeros((padded, rows.shape[1]), np.float32)
        x[:n] = np.asarray(rows, np.float32)
        y = _one_expert(jax.device_put(x.astype(self.dtype), self.cpu), self._weights_on_cpu(tier, layer, expert))
        return jax.device_put(np.asarray(y)[:n], self.device).astype(rows.dtype)

    def calibrate(self, tier: str, samples: int = 3) -> CostModel:
        """Measure one transfer and the CPU's time for 1 and 8 tokens on layer 0's experts."""
        transfers = []
        target = jax.sharding.SingleDeviceSharding(self.device, memory_kind="device")
        for e in range(samples):
            t = time.perf_counter()
            jax.device_put(self.host.record(tier, 0, e), target).block_until_ready()
            transfers.append(time.perf_counter() - t)
        D = self.host.store.config.hidden_size
        times = {}
        for n in (1, 8):
            rows = jax.device_put(jnp.ones((n, D), self.dtype), self.device)
            self.run(rows, tier, 0, 0)  # compile
            runs = []
            for e in range(samples):
                t = time.perf_counter()
                self.run(rows, tier, 0, e).block_until_ready()
                runs.append(time.perf_counter() - t)
            times[n] = float(np.median(runs))
        per_token = max((times[8] - times[1]) / 7, 0.0)
        self.cost = CostModel(float(np.median(transfers)), max(times[1] - per_token, 0.0), per_token)
        return self.cost

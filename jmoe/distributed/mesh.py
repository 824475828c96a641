"""The device mesh of a loaded model and where each of its arrays lives.

A mesh has an `ep` axis (experts: each position owns a contiguous range of every MoE layer's
experts, with its own pools and handle-table entries) and a `tp` axis (dense weights; they are
replicated over it, and each expert shard is replicated over the `tp` devices of its `ep` row).
Without a mesh everything lives on one device, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jmoe.errors import InputError

EP, TP = "ep", "tp"


def parse_mesh(spec: str | dict | None) -> dict[str, int] | None:
    """"ep=8" / "ep=4,tp=2" / {"ep": 4, "tp": 2} -> {"ep": n, "tp": m} (None stays None)."""
    if spec is None:
        return None
    if isinstance(spec, str):
        axes = {}
        for part in spec.split(","):
            name, sep, size = part.strip().partition("=")
            if not sep or not size.strip().isdigit():
                raise InputError(f"mesh: {part.strip()!r} is not AXIS=SIZE (e.g. 'ep=8' or 'ep=4,tp=2')")
            if name.strip() in axes:
                raise InputError(f"mesh: axis {name.strip()!r} is given twice")
            axes[name.strip()] = int(size)
    elif isinstance(spec, dict):
        axes = dict(spec)
    else:
        raise InputError(f"mesh: expected a string such as 'ep=8' or a dict, got {type(spec).__name__}")
    unknown = set(axes) - {EP, TP}
    if unknown:
        raise InputError(f"mesh: unknown axis {sorted(unknown)[0]!r} (the axes are 'ep' and 'tp')")
    for name, size in axes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InputError(f"mesh: axis {name!r} must be a positive integer, got {size!r}")
    return {EP: axes.get(EP, 1), TP: axes.get(TP, 1)}


def make_mesh(ep: int, tp: int = 1, devices=None) -> Mesh:
    """An (ep, tp) mesh over the first ep * tp devices (every process's, under jax.distributed)."""
    devices = list(jax.devices() if devices is None else devices)
    if ep * tp > len(devices):
        raise InputError(f"mesh: ep={ep} x tp={tp} needs {ep * tp} devices, but {len(devices)} are visible "
                         f"(on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={ep * tp} gives more)")
    # Auto axes: the step's shard_map and the pools' named shardings say where everything goes.
    return jax.make_mesh((ep, tp), (EP, TP), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=devices[: ep * tp])


@dataclass(frozen=True)
class ExpertParallel:
    """What a jitted step needs to run experts expert-parallel (a static, hashable part of the step)."""

    mesh: Mesh

    @property
    def shards(self) -> int:
        return self.mesh.shape[EP]


class Placement:
    """Where a loaded model's arrays go: one device, or a mesh.

    replicated: dense weights, handle tables, selections, KV cache (every device holds them);
    experts: pools laid out [shards * slots, ...], shard d on the devices of `ep` row d.
    """

    def __init__(self, device=None, mesh: Mesh | None = None):
        self.mesh = mesh
        self.device = mesh.devices.flat[0] if mesh is not None else (device or jax.devices()[0])
        if mesh is None:
            self.replicated = jax.sharding.SingleDeviceSharding(self.device)
            self.experts = self.replicated
        else:
            self.replicated = NamedSharding(mesh, P())
            self.experts = NamedSharding(mesh, P(EP))

    @classmethod
    def of(cls, where) -> "Placement":
        """A Placement as is, or one device's."""
        return where if isinstance(where, Placement) else cls(device=where)

    @classmethod
    def for_mesh(cls, spec) -> "Placement":
        axes = parse_mesh(spec)
        if axes is None or axes[EP] * axes[TP] == 1:  # one device: no mesh, no collectives
            return cls()
        return cls(mesh=make_mesh(axes[EP], axes[TP]))

    @property
    def shards(self) -> int:
        return 1 if self.mesh is None else self.mesh.shape[EP]

    @property
    def commit_to(self):
        """Where the host arrays a step or a sampler takes are committed, as the steps' outputs are
        (jit compiles a function given an uncommitted array apart from one given a committed one):
        `replicated`, or None in a job of several processes, where device_put cannot place an array
        made on this process's device (a sampler's key) on the job's devices: they stay uncommitted."""
        return self.replicated if self.replicated.is_fully_addressable else None

    @property
    def expert_parallel(self) -> ExpertParallel | None:
        return None if self.mesh is None else ExpertParallel(self.mesh)

    def shard_devices(self, shard: int) -> list:
        """The devices holding expert shard `shard` (its `tp` replicas)."""
        if self.mesh is None:
            return [self.device]
        return list(self.mesh.devices[shard])

    def local_devices(self, shard: int) -> list:
        """This process's devices among shard `shard`'s (all of them in a single process)."""
        return [d for d in self.shard_devices(shard) if d.process_index == jax.process_index()]

    def put_experts(self, shape, host_of_shard) -> jax.Array:
        """An expert array [shards * n, ...] laid out by `experts`: shard d's rows come from
        host_of_shard(d) (a numpy array [n, ...]), read only for the shards this process holds."""
        if self.mesh is None:
            return jax.device_put(host_of_shard(0), self.device)
        parts = []
        for shard in range(self.shards):
            devices = self.local_devices(shard)
            if devices:
                host = host_of_shard(shard)
                parts += [jax.device_put(host, device) for device in devices]
        return self.assemble(shape, parts)

    def assemble(self, shape, parts) -> jax.Array:
        """One global expert array from per-device parts (no copy)."""
        return jax.make_array_from_single_device_arrays(tuple(shape), self.experts, parts)

    def check_experts(self, num_experts: int) -> None:
        if num_experts % self.shards:
            raise InputError(f"mesh: ep={self.shards} must divide the model's {num_experts} experts per layer")

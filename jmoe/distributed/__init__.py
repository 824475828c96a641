"""Scale-out on JAX's own runtime: a device mesh whose `ep` axis partitions the experts, and several
processes (and hosts) as one jax.distributed job."""

from jmoe.distributed.mesh import ExpertParallel, Placement, make_mesh, parse_mesh
from jmoe.distributed.processes import initialize, is_main_process

__all__ = ["ExpertParallel", "Placement", "initialize", "is_main_process", "make_mesh", "parse_mesh"]

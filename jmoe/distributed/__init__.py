"""Scale-out on JAX's own runtime: a device mesh whose `ep` axis partitions the experts."""

from jmoe.distributed.mesh import ExpertParallel, Placement, make_mesh, parse_mesh

__all__ = ["ExpertParallel", "Placement", "make_mesh", "parse_mesh"]

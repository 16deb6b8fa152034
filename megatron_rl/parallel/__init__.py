"""World split into executors and their parallel layouts."""

from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.parallel.topology import ExecutorGroups, ExecutorPlacement, build_topology, check_placements

__all__ = ["ParallelLayout", "ExecutorPlacement", "ExecutorGroups", "build_topology", "check_placements"]

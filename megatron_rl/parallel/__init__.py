"""World split into executors and their parallel layouts.

`ParallelLayout` and `layout_problems` (whether a layout can hold a model) import nothing heavy (the config uses
them); the topology (torch.distributed) loads on first use.
"""

from megatron_rl.parallel.layout import ParallelLayout

__all__ = ["ParallelLayout", "ExecutorPlacement", "ExecutorGroups", "build_topology", "check_placements"]


def __getattr__(name):
    if name in ("ExecutorPlacement", "ExecutorGroups", "build_topology", "check_placements"):
        from megatron_rl.parallel import topology

        return getattr(topology, name)
    raise AttributeError(name)

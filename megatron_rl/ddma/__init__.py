"""DDMA: direct, sharded weight transfer from trainer ranks to generator ranks across any parallel layouts.

descriptors  where every parameter lives in a layout, from the config alone
planner      (trainer layout, generator layout) -> every copy, for every rank (pure, cached, with its PlanMemo)
transport    execute a plan with point-to-point messages, in place, with bounded staging
handshake    the transport's first phase: readiness, the trainer step and the dtypes at both ends of each slice
schedule     the transport's rounds and which slices are contiguous: pure functions of a plan, kept in its memo
quant        int8 / fp8 weight-only quantize-on-receive
local        execute a whole plan inside one process (one GPU holding both layouts)
version      which trainer step a generator's weights come from
sync         WeightSync: the object the controller calls after every trainer step
verify       `megatron-rl reshard-check`
"""

from megatron_rl.ddma.planner import ReshardPlan, plan_reshard
from megatron_rl.ddma.sync import SyncResult, WeightSync
from megatron_rl.ddma.transport import TransportSettings, execute_plan
from megatron_rl.ddma.version import WeightVersion, weight_version

__all__ = ["ReshardPlan", "plan_reshard", "WeightSync", "SyncResult", "TransportSettings", "execute_plan",
           "WeightVersion", "weight_version"]

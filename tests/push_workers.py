"""A weight push that loses one tensor, for tests/test_push_check.py: the fault lives here, not in the package.

    python tests/push_workers.py VERSION ARGS...    `megatron-rl ARGS...`, whose weight push VERSION leaves one
                                                    generator tensor as it was (the last push's, or the initial)

Imported with `SKIP_ENV` set, this module wraps `WeightPush.transfer` (the DDMA copies, before the push's check) so
that push VERSION restores one tensor of the generator's after the copies. The local launcher's ranks fork from a
server that imports their modules once (`launch/spawn.py: start_fork_server`); run as a script, this starts that
server itself with this module among them, so every rank the job starts holds the wrapped method. (Spawned ranks
import this script as their main module, which wraps it too.)
"""

import os
import sys

import torch

from megatron_rl.controller.executors import WeightPush
from megatron_rl.ddma.sync import parameters_of

SKIP_ENV = "MEGATRON_RL_TEST_PUSH_SKIP"  # the version of the push that loses a tensor


def skipping(transfer):
    """`WeightPush.transfer` that, at the push `SKIP_ENV` names, leaves the generator's first tensor as it was."""
    def wrapped(self, version, src_model, dst_model):
        dst = parameters_of(dst_model)
        kept = None
        if dst is not None and os.environ.get(SKIP_ENV) == str(version):
            name = next(n for n, v in dst.items() if isinstance(v, torch.Tensor))
            kept = (name, dst[name].detach().clone())
        transfer(self, version, src_model, dst_model)
        if kept is not None:
            dst[kept[0]].data.copy_(kept[1])

    wrapped.skips = True
    return wrapped


if SKIP_ENV in os.environ and not getattr(WeightPush.transfer, "skips", False):
    WeightPush.transfer = skipping(WeightPush.transfer)


if __name__ == "__main__":
    from megatron_rl.cli import main
    from megatron_rl.controller.rank import RANK_MODULES
    from megatron_rl.launch.spawn import start_fork_server

    os.environ[SKIP_ENV] = sys.argv[1]  # before the fork server starts: the ranks see it, and it wraps the method
    start_fork_server([*RANK_MODULES, "push_workers"])
    sys.exit(main(sys.argv[2:]))

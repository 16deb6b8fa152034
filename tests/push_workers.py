"""A weight push that loses one tensor, for tests/test_push_check.py: the fault lives here, not in the package.

`skip_a_push` wraps `WeightPush.transfer` (the DDMA copies, before the push's check) so that the push whose version
`SKIP_ENV` names restores one tensor of the generator's after the copies. The test calls it in a warm command's
process before that command's fork server is forked (`warm_cli.run(..., before="push_workers:skip_a_push")`), so
every rank the job starts holds the wrapped method.
"""

import os

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


def skip_a_push() -> None:
    """Wrap `WeightPush.transfer` in this process (once)."""
    if not getattr(WeightPush.transfer, "skips", False):
        WeightPush.transfer = skipping(WeightPush.transfer)

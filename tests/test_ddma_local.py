"""A whole plan executed inside one process (benchmarks, single-device colocated jobs) is bit-exact."""

import math

import pytest
import torch

from megatron_rl.ddma.local import InProcessReshard
from megatron_rl.ddma.planner import plan_reshard
from megatron_rl.ddma.verify import count_mismatches, reference_shard
from megatron_rl.models import get_preset
from megatron_rl.parallel import ParallelLayout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wide", [True, False])
def test_in_process_reshard_matches_the_reference_layout(dtype, wide):
    cfg = get_preset("tiny", tie_word_embeddings=True)
    src_l, dst_l = ParallelLayout(tp=2, pp=2), ParallelLayout(tp=1, pp=2, dp=2)
    plan = plan_reshard(cfg, src_l, dst_l)
    src = {r: {lp.local_name: reference_shard(lp, seed=5).to(dtype) for lp in plan.src.params(r)}
           for r in plan.src.ranks}
    dst = {r: {lp.local_name: torch.full(lp.local_shape, math.nan, dtype=dtype) for lp in plan.dst.params(r)}
           for r in plan.dst.ranks}
    job = InProcessReshard(plan, src, dst, wide=wide)
    # Wide elements: every copy here has rows of whole 16-byte multiples (hidden 64), strided or not.
    assert job.wide_copies == (len(plan.copies) if wide else 0)
    for _ in range(2):  # bound views stay valid across runs
        job.run()
        for r in plan.dst.ranks:
            for lp in plan.dst.params(r):
                want = reference_shard(lp, seed=5).to(dtype)
                assert count_mismatches(dst[r][lp.local_name], want) == 0, (r, lp.local_name)
    assert job.bytes == (plan.network_elements + plan.local_elements) * dtype.itemsize

"""A weight push that silently leaves a generator shard as it was is caught (issue 27): the fingerprints of both
ends of every copy of the plan agree when the push arrived, and name the tensor and the ranks when it did not."""

import os
from pathlib import Path

import pytest
import torch

from megatron_rl.ddma.fingerprint import (SAMPLE_EVERY, PushCheck, PushMismatch, checks_every, held_dtypes,
                                          local_fingerprints, mismatches)
from megatron_rl.ddma.planner import plan_reshard
from megatron_rl.ddma.verify import reference_shard
from megatron_rl.models import get_preset
from megatron_rl.parallel import ParallelLayout
import push_workers
import warm_cli

REPO = Path(__file__).resolve().parents[1]


def _ends(src_dtype, dst_dtype, seed=5):
    """A trainer TP2 x PP2 -> generator TP1 x DP2 plan, both ends' shards made from the reference weights
    directly (not by running the plan): what an arrived push holds."""
    plan = plan_reshard(get_preset("tiny", tie_word_embeddings=True), ParallelLayout(tp=2, pp=2),
                        ParallelLayout(tp=1, pp=1, dp=2))
    src = {r: {lp.local_name: reference_shard(lp, seed=seed).to(src_dtype) for lp in plan.src.params(r)}
           for r in plan.src.ranks}
    dst = {r: {lp.local_name: reference_shard(lp, seed=seed).to(dst_dtype) for lp in plan.dst.params(r)}
           for r in plan.dst.ranks}
    return plan, src, dst


def _dtypes(plan, dst):
    return {k: v for r in dst for k, v in held_dtypes(plan, r, dst[r]).items()}


def _gathered(plan, src, dst):
    dtypes = _dtypes(plan, dst)
    return [local_fingerprints(plan, r, src.get(r), dst.get(r), dtypes) for r in sorted(set(src) | set(dst))]


def _bits_sum_mod_2_32(t):
    """The closed form: the sum of the elements' bit patterns read as signed integers of their width (two's
    complement), modulo 2**32."""
    width = t.element_size() * 8
    raw = t.contiguous().view({16: torch.int16, 32: torch.int32}[width]).flatten().tolist()
    return sum(raw) % 2**32  # tolist() reads int16/int32 as signed


def _region(t, box):
    return t[tuple(slice(a, b) for a, b in box)]


def test_a_fingerprint_is_the_sum_of_the_sampled_rows_bit_patterns():
    plan, src, dst = _ends(torch.float32, torch.bfloat16)
    i, c = next((i, c) for i, c in enumerate(plan.copies) if len(c.src_box) == 2 and c.src_box[0][1] > 16)
    rows = _region(src[c.src_rank][c.src_param], c.src_box)[::SAMPLE_EVERY].to(torch.bfloat16)  # as bf16 holds it
    dtypes = _dtypes(plan, dst)
    sent = local_fingerprints(plan, c.src_rank, src[c.src_rank], None, dtypes)[("s", i)]
    assert sent % 2**32 == _bits_sum_mod_2_32(rows)
    held = _region(dst[c.dst_rank][c.dst_param], c.dst_box)[::SAMPLE_EVERY]
    assert local_fingerprints(plan, c.dst_rank, None, dst[c.dst_rank], dtypes)[("d", i)] % 2**32 == \
        _bits_sum_mod_2_32(held)
    i, c = next((i, c) for i, c in enumerate(plan.copies) if len(c.src_box) == 1)  # a vector: every element
    sent = local_fingerprints(plan, c.src_rank, src[c.src_rank], None, dtypes)[("s", i)]
    assert sent % 2**32 == _bits_sum_mod_2_32(_region(src[c.src_rank][c.src_param], c.src_box).to(torch.bfloat16))


@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.bfloat16)])
def test_an_arrived_push_passes_in_every_dtype_pair(src_dtype, dst_dtype):
    plan, src, dst = _ends(src_dtype, dst_dtype)
    assert mismatches(plan, _gathered(plan, src, dst)) == []


def test_one_sampled_element_one_bf16_step_off_is_named_with_its_tensor_and_ranks():
    plan, src, dst = _ends(torch.float32, torch.bfloat16)
    c = next(c for c in plan.copies if c.name.endswith("linear_fc1.weight"))
    t = dst[c.dst_rank][c.dst_param]
    corner = tuple(a for a, _ in c.dst_box)  # row 0 of the region: sampled
    t[corner] = torch.nextafter(t[corner], torch.tensor(1.0, dtype=t.dtype))  # the smallest change bf16 holds
    bad = mismatches(plan, _gathered(plan, src, dst))
    region = ", ".join(f"{a}:{b}" for a, b in c.dst_box)
    assert len(bad) == 1 and bad[0].startswith(f"{c.name}[{region}] on generator rank {c.dst_rank} is not what was "
                                               f"sent (fingerprint 0x"), bad
    assert f", trainer rank {c.src_rank} sent 0x" in bad[0]


def test_a_shard_that_kept_the_last_version_is_caught_on_every_copy_into_it():
    plan, src, dst = _ends(torch.bfloat16, torch.bfloat16)
    _, _, old = _ends(torch.bfloat16, torch.bfloat16, seed=4)
    rank, param = plan.copies[0].dst_rank, plan.copies[0].dst_param
    dst[rank][param] = old[rank][param]
    bad = mismatches(plan, _gathered(plan, src, dst))
    assert len(bad) == sum(1 for c in plan.copies if (c.dst_rank, c.dst_param) == (rank, param)) >= 1


def test_each_destination_tensor_is_compared_in_the_dtype_it_holds():
    # a bf16 generator keeps its norms in fp32: the trainer's fp32 norm is compared as is, its matrices as bf16
    plan, src, dst = _ends(torch.float32, torch.bfloat16)
    norms = {(r, n) for r in dst for n in dst[r] if "layernorm" in n}
    for r, n in norms:
        dst[r][n] = reference_shard(next(lp for lp in plan.dst.params(r) if lp.local_name == n), seed=5)
    assert mismatches(plan, _gathered(plan, src, dst)) == []  # as bf16, every norm would differ: 24-bit values
    for r, n in norms:
        dst[r][n][0] = 0.5  # one element that the source does not hold
    bad = mismatches(plan, _gathered(plan, src, dst))
    assert len(norms) >= 2 and len(bad) == len(norms) and all("layernorm.weight[" in b for b in bad), bad


def test_quantized_destinations_are_not_fingerprinted():
    plan, src, dst = _ends(torch.float32, torch.float32)
    c = plan.copies[0]
    dst[c.dst_rank][c.dst_param] = object()  # an int8/fp8 weight: codes made on the destination
    assert mismatches(plan, _gathered(plan, src, dst)) == []
    assert ("d", 0) not in local_fingerprints(plan, c.dst_rank, None, dst[c.dst_rank], _dtypes(plan, dst))


def test_auto_checks_as_often_as_one_percent_of_the_pushes_time_allows():
    assert checks_every(0.02, 0.2, 0.01) == 10  # 20 ms against 10 pushes of 200 ms: 1%
    assert checks_every(0.021, 0.2, 0.01) == 11
    assert checks_every(0.001, 0.2, 0.01) == 1  # never less often than... every push
    assert checks_every(0.001, 0.0, 0.01) == 1


class _OneRank(PushCheck):
    """Both executors on one rank (a colocated plan): the gathers are this rank's own."""

    def _all_gather(self, obj):
        return [obj]


def _colocated():
    plan = plan_reshard(get_preset("tiny"), ParallelLayout(tp=1), ParallelLayout(tp=1), dst_first_rank=0)
    src = {lp.local_name: reference_shard(lp, seed=5) for lp in plan.src.params(0)}
    dst = {lp.local_name: reference_shard(lp, seed=5) for lp in plan.dst.params(0)}
    return plan, src, dst


def test_auto_checks_push_0_then_spaces_the_checks_by_their_measured_cost():
    plan, src, dst = _colocated()
    check = _OneRank(plan, 0, None, "auto")
    check.after_push(src, dst, 0, push_s=1e-6)  # a check costs far more than a push this short
    assert check.cost[1] == 1e-6 and check.every == checks_every(check.cost[0], 1e-6, 0.01) > 100
    assert check.next_version == check.every
    dst[next(iter(dst))][0] += 1.0  # pushes between checks are not looked at
    check.after_push(src, dst, check.every - 1, push_s=1e-6)
    with pytest.raises(PushMismatch, match=rf"^weight push {check.every} did not arrive: "):
        check.after_push(src, dst, check.every, push_s=1e-6)


@pytest.mark.parametrize("interval,checked", [(3, [3, 6, 9]), (0, [])])
def test_a_fixed_interval_checks_every_nth_push(interval, checked):
    plan, src, dst = _colocated()
    check = _OneRank(plan, 0, None, interval)
    dst[next(iter(dst))][0] += 1.0
    seen = []
    for v in range(10):
        try:
            check.after_push(src, dst, v, push_s=1.0)
        except PushMismatch:
            seen.append(v)
    assert seen == checked


TINY = ["trainer.sft_warmup_steps=0", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=4", "run.steps=4"]


def _train(tmp_path, *overrides, skip_push=None):
    """The tiny job through the CLI; `skip_push`: the version of the weight push that leaves one generator tensor
    as it was (tests/push_workers.py)."""
    env = dict(os.environ)
    if skip_push is not None:
        env[push_workers.SKIP_ENV] = str(skip_push)
    return warm_cli.run(["train", *TINY, *overrides, f"checkpoint.dir={tmp_path}", "run.name=push"], cwd=REPO, env=env,
                        before=None if skip_push is None else "push_workers:skip_a_push")


def test_a_skipped_transfer_stops_the_job_at_the_next_checked_push_in_one_line(tmp_path):
    # Push 1 is not checked (every 2nd is); push 2 leaves one generator tensor as push 1 wrote it. The tiny job's
    # rewards are all 0 (no gradient), so weight decay in fp32 is what makes every update move every weight: a
    # push that carries the same values as the last one is no fault to catch.
    out = _train(tmp_path, "generator.push_check_interval=2", "trainer.weight_decay=0.1", "trainer.dtype=fp32",
                 "generator.dtype=fp32", skip_push=2)
    assert out.returncode == 1, out.stderr[-3000:]
    line = [ln for ln in out.stderr.splitlines() if ln.startswith("megatron-rl: rank ")]
    assert len(line) == 1 and "failed: PushMismatch: weight push 2 did not arrive: " in line[0], out.stderr[-3000:]
    assert " on generator rank " in line[0] and " is not what was sent (fingerprint 0x" in line[0]
    assert "every rank's traceback: " in line[0]


def test_auto_catches_a_generator_that_kept_its_own_initial_weights(tmp_path):
    out = _train(tmp_path, skip_push=0)  # "auto" checks push 0
    assert out.returncode == 1 and "failed: PushMismatch: weight push 0 did not arrive: " in out.stderr, \
        out.stderr[-3000:]


def test_every_push_checked_across_layouts_and_dtypes_runs_to_the_end(tmp_path):
    # trainer TP2 in fp32 -> generator TP1 in bf16: the check compares the bf16-rounded source sums
    out = _train(tmp_path, "generator.push_check_interval=1", "trainer.dtype=fp32", "generator.dtype=bf16")
    assert out.returncode == 0, out.stderr[-3000:]

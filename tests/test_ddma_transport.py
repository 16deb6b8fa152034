"""DDMA end to end on local gloo processes: bit-exact against loading the same weights directly."""

import json

import pytest
import torch

from megatron_rl.cli import main
from megatron_rl.launch.spawn import run_local
from ddma_workers import reshard_worker, wrong_model_worker

CASES = {
    # name: (preset overrides, trainer layout, generator layout, generator first rank, world, bucket bytes,
    #        generator preset overrides)
    "tp2pp2_to_tp1dp2": ({}, dict(tp=2, pp=2), dict(tp=1, dp=2), 4, 6, 32 << 10, None),
    # 300 rows pad to 384 at TP1 (multiple of 128) and, with the generator's own rule, to 320 at TP2 (of 80);
    # the generator is bfloat16 (its matrices are cast on receive, its float32 norms land in place)
    "tp1_to_tp2_vocab_padding": ({}, dict(tp=1), dict(tp=2), 1, 3, 1 << 20, {"make_vocab_size_divisible_by": 40}),
    # the generator's last stage holds its own copy of the tied embedding, which must be filled too
    "tp4_to_tp2pp2_tied": ({"num_query_groups": 4, "tie_word_embeddings": True}, dict(tp=4), dict(tp=2, pp=2),
                           4, 8, 1 << 20, None),
    "colocated_tp2_to_tp1dp2": ({}, dict(tp=2), dict(tp=1, dp=2), 0, 2, 16 << 10, None),
    # columns of the trainer's row-parallel weights go whole into the generator's shards (received in place)
    "tp1_to_tp2": ({}, dict(tp=1), dict(tp=2), 1, 3, 16 << 10, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_reshard_is_bit_exact(case):
    preset_kw, src, dst, dst_first, world, bucket, dst_kw = CASES[case]
    steps = (3, 4) if case == "tp2pp2_to_tp1dp2" else (3,)
    dtype = torch.bfloat16 if case == "tp1_to_tp2_vocab_padding" else torch.float32
    out = run_local(reshard_worker, world, preset_kw, src, dst, dst_first, bucket, dst_kw, steps, dtype)
    dst_size = dst.get("tp", 1) * dst.get("pp", 1) * dst.get("dp", 1)
    generator_ranks = range(dst_first, dst_first + dst_size)
    for r in generator_ranks:
        assert out[r]["mismatches"] == [[] for _ in steps], f"rank {r}: {out[r]['mismatches']}"
        assert out[r]["versions"] == list(steps)
        assert out[r]["params"] > 0
    if case == "tp4_to_tp2pp2_tied":
        assert any(out[r]["tied_copy"] for r in generator_ranks)
    stats = [s for o in out for s in o["stats"][:1]]
    # every rank's staging stays within the bucket
    assert max(s.peak_staging_bytes for s in stats) <= bucket
    # A slice contiguous at one end is not staged there: trainer shards are sent from their storage when the
    # generator's TP is lower, and the generator's shards received into theirs when it is higher.
    staged = {r: out[r]["stats"][0].peak_staging_bytes for r in range(world)}
    if case == "tp2pp2_to_tp1dp2":
        assert all(staged[r] == 0 for r in range(4)) and all(staged[r] > 0 for r in generator_ranks)
    if case == "tp1_to_tp2":
        assert staged[0] > 0 and all(staged[r] == 0 for r in generator_ranks)
    if case == "colocated_tp2_to_tp1dp2":
        assert all(s.bytes_local > 0 for s in stats)  # half of each generator rank's weights are already there
    else:
        trainer_ranks = [r for r in range(world) if r not in generator_ranks]
        assert all(out[r]["stats"][0].bytes_sent > 0 for r in trainer_ranks)  # every trainer rank sends


def test_a_model_that_does_not_match_the_plan_fails_on_every_rank_before_any_transfer():
    with pytest.raises(RuntimeError) as err:
        run_local(wrong_model_worker, 3, timeout=120)
    text = str(err.value)
    assert "3 of 3 ranks failed" in text
    assert "has shape (176, 64), too small for slice" in text or "too small for slice" in text
    assert "failed their pre-transfer check" in text


def test_cli_reshard_check_prints_json_and_exits_0(capsys):
    rc = main(["reshard-check", "--model", "tiny", "--src", "tp=2,pp=2", "--dst", "tp=1,pp=2",
               "--set", "tie_word_embeddings=true", "--bucket-mb", "0.05"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0, lines
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert summary["ok"] and summary["mismatches"] == 0 and summary["version"] == 7
    assert summary["bytes_moved"] > 0 and summary["seconds"] > 0
    assert summary["elements_checked"] > 0 and summary["senders"] == 4


def test_cli_reshard_check_rejects_impossible_layouts_in_one_line(capsys):
    rc = main(["reshard-check", "--src", "tp=2", "--dst", "tp=4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == ["megatron-rl reshard-check: generator (destination) layout tp=4,pp=1,dp=1 cannot hold the "
                   "model: tp=4 does not divide the query groups (2)"]


def test_cli_reshard_check_refuses_more_processes_than_the_machine_can_run(capsys, monkeypatch):
    """--src dp=64 used to start 129 processes on 2 cores without a word."""
    import megatron_rl.ddma.verify as verify

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(verify, "reshard_check", lambda *a, **kw: pytest.fail("no process may start"))
    assert main(["reshard-check", "--src", "dp=64", "--dst", "dp=65"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "megatron-rl reshard-check: --src dp=64 --dst dp=65 needs 129 processes, more than 4 per CPU core (2 cores "
        "here); pass --force to start them"]
    monkeypatch.setattr(verify, "reshard_check", lambda *a, **kw: {"ok": True})
    assert main(["reshard-check", "--src", "dp=64", "--dst", "dp=65", "--force"]) == 0
    assert main(["reshard-check", "--src", "tp=2", "--dst", "tp=2", "--colocated"]) == 0  # 2 processes


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_generator_matches_direct_quantization_within_the_bound(fmt):
    from megatron_rl.ddma.quant import FORMATS
    from megatron_rl.ddma.verify import reshard_check
    from megatron_rl.models import get_preset
    from megatron_rl.parallel import ParallelLayout

    # row-parallel weights (linear_proj, fc2) arrive in column pieces from both trainer ranks: the scales must
    # still be per output channel of the generator's shard
    summary = reshard_check(get_preset("tiny"), ParallelLayout(tp=2), ParallelLayout(tp=1, pp=2), quantize=fmt,
                            bucket_bytes=16 << 10)
    assert summary["mismatches"] == 0 and summary["ok"], summary
    assert 0.9 < summary["quant_error_over_bound"] <= FORMATS[fmt].ERROR_OVER_HALF_STEP

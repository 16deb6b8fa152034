"""The controller: the deterministic schedule, and a short end-to-end job (async and sync) through the CLI."""

import json
import subprocess
import sys

import pytest

from megatron_rl.controller.schedule import generation_version, pull_before_batch, push_after_step, syncs_needed


@pytest.mark.parametrize("n,s", [(6, 0), (6, 1), (7, 2), (3, 3)])
def test_schedule_pushes_and_pulls_pair_up(n, s):
    pushes = [k + 1 for k in range(n) if push_after_step(k, n, s)]
    pulls = [generation_version(k, s) for k in range(n) if pull_before_batch(k, s)]
    assert pushes == pulls == syncs_needed(n, s)
    for k in range(n):
        # batch k uses the weights after k - s steps; the trainer trains it at version k
        assert k - generation_version(k, s) == min(k, s)


def test_schedule_versions_by_hand():
    assert [generation_version(k, 1) for k in range(5)] == [0, 0, 1, 2, 3]
    assert [generation_version(k, 0) for k in range(3)] == [0, 1, 2]
    # n = 4, s = 1: versions 1 and 2 are pushed (version 3 would serve batch 4, which does not exist)
    assert syncs_needed(4, 1) == [1, 2]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_short_job_end_to_end(tmp_path, mode):
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "run.steps=4", "trainer.warmup_steps_sft=10",
           "run.eval_interval=2", f"rollout.mode={mode}", "rollout.prompts_per_step=4", "data.eval_size=8",
           f"checkpoint.dir={tmp_path}", "run.name=t"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in open(tmp_path / "t" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    expected = [0, 0, 1, 2] if mode == "async" else [0, 1, 2, 3]
    assert [r["generated_with_version"] for r in rows] == expected
    assert all(0 <= r["reward"] <= 1 and r["response_length"] >= 1 for r in rows)
    assert [r["step"] for r in rows if "eval/reward" in r] == [0, 2, 3]
    assert summary["steps"] == 4 and (tmp_path / "t" / "metrics.png").exists()
    assert (tmp_path / "t" / "config.yaml").exists()


def test_jobs_that_cannot_run_yet_fail_before_starting_processes():
    out = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "-c", "configs/smollm2-gsm8k.yaml"],
                         capture_output=True, text=True, timeout=120,
                         cwd=__import__("pathlib").Path(__file__).resolve().parents[1])
    assert out.returncode == 2
    assert "data.dataset='gsm8k' is not yet available" in out.stderr

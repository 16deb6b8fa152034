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


def _final_weights(run_dir):
    """The model tensors of a run's newest checkpoint, read straight from the torch_dist files."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    latest = (run_dir / "latest").read_text().strip()
    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(str(run_dir / latest / "model"), f"{d}/m.pt")
        sd = torch.load(f"{d}/m.pt", weights_only=False)
    return latest, {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def test_killed_runs_resume_to_the_same_result(tmp_path):
    """SIGKILL in the middle of a checkpoint write, then in the middle of a trainer step; each time the same
    command resumes. Final weights and every step's metrics equal an uninterrupted run's."""
    import os

    import torch

    args = ["run.steps=6", "trainer.warmup_steps_sft=10", "run.eval_interval=100", "rollout.prompts_per_step=4",
            "data.eval_size=4", "rollout.max_new_tokens=6", "checkpoint.save_interval=2", f"checkpoint.dir={tmp_path}"]

    def launch(name, failpoint=None):
        env = dict(os.environ)
        env.pop("MEGATRON_RL_FAILPOINT", None)
        if failpoint:
            env["MEGATRON_RL_FAILPOINT"] = failpoint
        return subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", *args, f"run.name={name}"],
                              capture_output=True, text=True, timeout=300, env=env, start_new_session=True)

    ref = launch("ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    first = launch("crash", "checkpoint_between_model_and_optimizer:step_00000004")
    assert first.returncode == -9, first.stderr[-3000:]
    assert (tmp_path / "crash" / "latest").read_text().strip() == "step_00000002"
    second = launch("crash", "train_step:5")  # resumes at step 2, saves step 4, dies inside step 5
    assert second.returncode == -9, second.stderr[-3000:]
    assert (tmp_path / "crash" / "latest").read_text().strip() == "step_00000004"
    third = launch("crash")
    assert third.returncode == 0, third.stderr[-3000:]
    assert "resumed from" in third.stderr and json.loads(third.stdout.strip().splitlines()[-1])["resumed_from_step"] == 4

    name_ref, w_ref = _final_weights(tmp_path / "ref")
    name_new, w_new = _final_weights(tmp_path / "crash")
    assert name_ref == name_new == "step_00000006"
    assert w_ref.keys() == w_new.keys() and len(w_ref) >= 9
    for k in w_ref:
        assert torch.equal(w_ref[k], w_new[k]), k
    rows_ref = [json.loads(x) for x in open(tmp_path / "ref" / "metrics.jsonl")]
    rows_new = [json.loads(x) for x in open(tmp_path / "crash" / "metrics.jsonl")]
    assert [r["step"] for r in rows_new] == list(range(6))  # nothing dropped, nothing counted twice
    for a, b in zip(rows_ref, rows_new):
        for key in ("reward", "loss", "generated_with_version", "response_length"):
            assert a[key] == b[key], (a["step"], key)
    assert not list((tmp_path / "crash").glob("*.tmp"))
    assert sorted(p.name for p in (tmp_path / "crash").glob("step_*")) == ["step_00000004", "step_00000006"]

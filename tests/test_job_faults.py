"""Faults a whole job must survive or end on, in bounded time with a non-zero exit: an update that overflows the
weights, a reward function that never returns or always raises (issue 17)."""

import json
import os
import time
from pathlib import Path

import torch

import warm_cli

REPO = Path(__file__).resolve().parents[1]
TINY = ["trainer.sft_warmup_steps=0", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=4"]


def _train(tmp_path, name, *overrides, timeout=300):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    t0 = time.monotonic()
    out = warm_cli.run(["train", *TINY, *overrides, f"checkpoint.dir={tmp_path}", f"run.name={name}"],
                       timeout=timeout, cwd=REPO, env=env)
    log = tmp_path / name / "failure.log"  # every rank's traceback, where the launcher writes one
    return out, time.monotonic() - t0, out.stderr + (log.read_text() if log.is_file() else "")


def _tensors(d):
    from test_train_checkpoint import _weights

    return _weights(d)


def test_an_overflowing_learning_rate_stops_the_job_and_no_checkpoint_holds_a_non_finite_value(tmp_path):
    out, _, text = _train(tmp_path, "lr", "trainer.lr=1e38", "run.steps=4", "checkpoint.save_interval=2")
    assert out.returncode == 1
    # the line the user sees names the trainer rank and the cause, not a rank the launcher ended afterwards
    assert "(trainer) failed: NonFiniteError: update 1 overflowed the float range" in out.stderr, out.stderr[-3000:]
    steps = sorted((tmp_path / "lr").glob("step_*"))
    assert [p.name for p in steps] == ["step_00000000"]  # the weights before the update, nothing after it
    for sub in ("model", "optimizer"):
        tensors = _tensors(steps[0] / sub)
        assert all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point()), sub


def _prompts(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} plus {i}?"}) + "\n" for i in range(40)))
    return [f"data.path={data}", "data.dataset=jsonl", "data.answer_field=null", "data.eval_size=4",
            "data.eval_samples=1", "reward.kind=function", "reward.timeout_s=0.5"]


def test_a_reward_function_that_never_returns_ends_the_job_in_bounded_time(tmp_path):
    # Before: every response cost its timeout, one after another, for all 200 steps, and the job exited 0.
    # a quarter of a second per call (the function never returns): each batch's deadline is four of them
    out, seconds, text = _train(tmp_path, "hang", *_prompts(tmp_path), "reward.function=reward_fns:sleeps_forever",
                                "run.steps=200", "reward.timeout_s=0.25")
    assert out.returncode == 1 and seconds < 150, (seconds, out.stderr[-3000:])
    assert "(generator) failed: RewardFailureError: reward function 'reward_fns:sleeps_forever' failed on" \
        in out.stderr, out.stderr[-3000:]
    assert "batch timed out after 1 s" in text


def test_a_reward_function_that_always_raises_is_counted_in_the_metrics_and_stops_the_job(tmp_path):
    out, _, text = _train(tmp_path, "raise", *_prompts(tmp_path), "reward.function=reward_fns:always_raises",
                          "run.steps=200")
    assert out.returncode != 0
    assert ("more than half in each of the last 3 batches (last error: ValueError: cannot score" in text), text[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "raise" / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(r["reward_failures"] == 8 and r["reward"] == 0.0 for r in rows)

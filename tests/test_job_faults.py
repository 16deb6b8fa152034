"""Faults a whole job must survive or end on, in bounded time with a non-zero exit: an update that overflows the
weights, a reward function that never returns or always raises (issue 17)."""

import json
import os
import time
from pathlib import Path

import pytest
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
    # What the function printed, and its tracebacks, are in the run's workers.log; the console has the job's lines.
    assert "noise" not in out.stdout + out.stderr and "Traceback" not in out.stdout + out.stderr
    log = (tmp_path / "raise" / "workers.log").read_text()
    assert log.count("reward noise 199 on stdout\n") == log.count("reward noise 199 on stderr\n") >= 8
    assert "reward function 'reward_fns:always_raises' raised:\nTraceback (most recent call last):" in log


GUESS = ["data.dataset=guess-number", "env.max_tokens=24", "env.max_turns=2", "env.num_workers=1", "run.steps=40",
         "data.eval_size=2", "data.eval_samples=1", "run.eval_interval=100"]


@pytest.mark.parametrize("cls, layout, role", [
    ("env_cases:BreaksEveryStep", [], "generator"),  # disjoint: trainer TP2, generator TP1
    ("env_cases:StepIllTyped", ["trainer.tp=1", "generator.colocated=true"], "trainer and generator"),
    ("env_cases:StepDies", ["generator.pp=2"], "generator"),  # a pipelined generator
])
def test_an_environment_failing_every_step_stops_the_run_after_three_batches_with_one_line(tmp_path, cls, layout,
                                                                                             role):
    """Before: the stop was raised in the environments' thread and lost there (tracebacks on the console), and the
    run trained to its last step on episodes that never ran, exit 0."""
    out, _, _ = _train(tmp_path, "env", *GUESS, f"env.cls={cls}", *layout)
    run = tmp_path / "env"
    assert out.returncode == 1, out.stderr[-3000:]
    console = out.stdout + out.stderr
    assert f"({role}) failed: EnvironmentFailureError: env '{cls}' failed on 8 of 8 episodes, and on more than " \
        f"half in each of the last 3 batches" in out.stderr, out.stderr[-3000:]
    assert f"(tracebacks and output: {run / 'workers.log'})" in out.stderr
    assert "Traceback" not in console and "noise" not in console and "a warning from" not in console
    warned = [line for line in console.splitlines() if "episodes, which end with reward 0" in line]
    assert len(warned) == 3 and all(line.startswith("megatron-rl: environment ") for line in warned), warned
    assert len(_rows(run)) <= 2  # stopped at the third batch: no step trained on more episodes that never ran
    log = (run / "workers.log").read_text()
    assert "noise 199 on stdout\n" in log and "noise 199 on stderr\n" in log and "a warning from the environment" in log
    if cls.endswith("BreaksEveryStep"):
        assert f"env {cls}.step raised:\nTraceback (most recent call last):" in log


def _rows(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

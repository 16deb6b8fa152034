"""Jobs whose rollouts are agents (`env.agent`, `agents/`): the user's function plays each episode through the real
`openai` client against the generator's endpoint. The built-in guessing game played by an agent trains on exactly
what the same game played as an environment (`env.cls`) does: the same records, seeds and replies give the same ids,
rewards, losses and weights, in the default disjoint layout (trainer TP2, generator TP1); an agent job killed
mid-run resumes to the same weights and metrics; in the colocated layout an agent job trains, and one whose agent
fails every episode stops after the third batch with one line."""

import json
import os
import re
from pathlib import Path

import pytest
import torch

import warm_cli
from test_controller import _final_weights
from test_episode_jobs import GUESS

pytest.importorskip("openai")

AGENT = [a if not a.startswith("env.cls=") else "env.agent=megatron_rl.agents.guess:play" for a in GUESS]
TESTS = Path(__file__).resolve().parent


def _rows(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_an_agent_trains_as_the_same_game_as_an_environment_does_and_resumes_exactly(tmp_path):
    def launch(name, args, failpoint=None):
        return warm_cli.run_with_failpoint(["train", *args, "run.steps=2", "checkpoint.save_interval=1",
                                            f"checkpoint.dir={tmp_path}", f"run.name={name}"], failpoint)

    for name, args in (("env", GUESS), ("agent", AGENT)):
        proc = launch(name, args)
        assert proc.returncode == 0, proc.stderr[-3000:]
    env, agent = _rows(tmp_path / "env"), _rows(tmp_path / "agent")
    keep = ("step", "reward", "episode/turns", "episode/policy_tokens", "episode/env_tokens", "loss", "samples",
            "env_failures")
    assert [{k: r[k] for k in keep} for r in agent] == [{k: r[k] for k in keep} for r in env]
    assert any(r["episode/env_tokens"] > 0 for r in agent)  # the agent answered between turns
    assert all(r["episode/rewritten"] == 0 for r in agent)
    (_, w_env), (_, w_agent) = _final_weights(tmp_path / "env"), _final_weights(tmp_path / "agent")
    assert all(torch.equal(w_env[k], w_agent[k]) for k in w_env)
    crash = launch("crash", AGENT, "train_step:1")  # dies in step 1, after the checkpoint of step 1
    assert crash.returncode == 1 and re.search(r"died with signal 9", crash.stderr), crash.stderr[-3000:]
    again = launch("crash", AGENT)
    assert again.returncode == 0 and "resumed from" in again.stderr, again.stderr[-3000:]
    _, w_new = _final_weights(tmp_path / "crash")
    assert all(torch.equal(w_agent[k], w_new[k]) for k in w_agent)
    assert [{k: r[k] for k in keep} for r in _rows(tmp_path / "crash")] == [{k: r[k] for k in keep} for r in agent]


def test_a_colocated_job_trains_an_agent_and_one_failing_every_episode_stops_after_three_batches(tmp_path):
    colocated = ["trainer.tp=1", "generator.colocated=true", f"checkpoint.dir={tmp_path}"]
    ok = warm_cli.run(["train", *AGENT, *colocated, "run.steps=1", "run.name=ok"])
    assert ok.returncode == 0, ok.stderr[-3000:]
    (row,) = _rows(tmp_path / "ok")
    assert row["env_failures"] == 0 and row["episode/policy_tokens"] > 0 and row["loss"] == row["loss"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    args = [a for a in AGENT if not a.startswith(("env.agent=", "trainer.sft_warmup_steps"))]
    out = warm_cli.run(["train", *args, "env.agent=agent_cases:always_raises", "trainer.sft_warmup_steps=0",
                        *colocated, "run.steps=40", "run.name=a"], env=env, cwd=TESTS.parent)
    run = tmp_path / "a"
    assert out.returncode == 1, out.stderr[-3000:]
    console = out.stdout + out.stderr
    assert "EnvironmentFailureError: agent 'agent_cases:always_raises' failed on 8 of 8 episodes, and on more than " \
        "half in each of the last 3 batches (last error: ValueError: the agent gave up)" in out.stderr, console[-3000:]
    assert "Traceback" not in console and "agent noise" not in console
    warned = [line for line in console.splitlines() if "episodes, which end with reward 0" in line]
    assert len(warned) == 3 and all(line.startswith("megatron-rl: agent ") for line in warned), warned
    assert len(_rows(run)) <= 2
    log = (run / "workers.log").read_text()
    assert "agent noise on stdout" in log and "agent 'agent_cases:always_raises' raised:\nTraceback" in log

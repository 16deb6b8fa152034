"""Jobs whose rollouts are agents (`env.agent`, `agents/`): the user's function plays each episode through the real
`openai` client against the generator's endpoint. The built-in guessing game played by an agent trains on exactly
what the same game played as an environment (`env.cls`) does: the same records, seeds and replies give the same ids,
rewards, losses and weights, in the default disjoint layout (trainer TP2, generator TP1)."""

import json

import pytest
import torch

import warm_cli
from test_controller import _final_weights
from test_episode_jobs import GUESS

pytest.importorskip("openai")

AGENT = [a if not a.startswith("env.cls=") else "env.agent=megatron_rl.agents.guess:play" for a in GUESS]


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_an_agent_trains_on_exactly_what_the_same_game_as_an_environment_does(tmp_path):
    runs = {}
    for name, args in (("env", GUESS), ("agent", AGENT)):
        proc = warm_cli.run(["train", *args, "run.steps=2", f"checkpoint.dir={tmp_path}", f"run.name={name}"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = _rows(tmp_path / name)
    keep = ("step", "reward", "episode/turns", "episode/policy_tokens", "episode/env_tokens", "loss", "samples",
            "env_failures")
    assert [{k: r[k] for k in keep} for r in runs["agent"]] == [{k: r[k] for k in keep} for r in runs["env"]]
    assert any(r["episode/env_tokens"] > 0 for r in runs["agent"])  # the agent answered between turns
    assert all(r["episode/rewritten"] == 0 for r in runs["agent"])
    (_, w_env), (_, w_agent) = _final_weights(tmp_path / "env"), _final_weights(tmp_path / "agent")
    assert all(torch.equal(w_env[k], w_agent[k]) for k in w_env)

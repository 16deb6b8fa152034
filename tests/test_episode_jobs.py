"""Jobs whose rollouts are episodes (`env.cls`, `environments/play.py`): the built-in guessing game runs in the
default disjoint layout (trainer TP2, generator TP1) and the calculator task colocated, reporting episode metrics,
and a job killed mid-run resumes to the same weights and metrics as an uninterrupted one; turns are rendered one at a time, so the
ids a job trains on are the ids the generator sampled and the observations' ids, never re-tokenized; the trainer
learns only from sampled tokens."""

import json
import re

import torch

from megatron_rl.config import load_config, problems
from megatron_rl.controller.collector import pack
from megatron_rl.environments.play import TurnTemplate
from megatron_rl.controller.scoring import ScoredRollouts
from megatron_rl.training.rl_trainer import make_micro_batches
import warm_cli
from test_controller import _final_weights

GUESS = ["data.dataset=guess-number", "env.cls=megatron_rl.environments.guess:GuessNumber", "env.max_tokens=40",
         "env.max_turns=3", "env.num_workers=1", "rollout.max_new_tokens=6", "trainer.sft_warmup_steps=4",
         "run.eval_interval=100", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "data.eval_size=2",
         "data.eval_samples=2"]


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_killed_episode_job_resumes_to_the_same_weights_and_metrics(tmp_path):
    """With dynamic sampling (`algorithm.dynamic_sampling`): groups without signal refilled from further prompts, each
    refill a pure function of (seed, batch, round), so the resumed run draws what the uninterrupted one drew."""
    args = [*GUESS, "run.steps=3", "checkpoint.save_interval=2", f"checkpoint.dir={tmp_path}",
            "algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_rounds=2"]

    def launch(name, failpoint=None):
        return warm_cli.run_with_failpoint(["train", *args, f"run.name={name}"], failpoint)

    ref = launch("ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    rows = _rows(tmp_path / "ref")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:  # every episode plays at least one turn, and the environment answers between turns
        assert r["episode/turns"] >= 1 and r["episode/policy_tokens"] > 0 and r["env_failures"] == 0
    assert any(r["episode/env_tokens"] > 0 for r in rows) and any("\nhigher" in s or "\nlower" in s
                                                                 for r in rows for s in r["samples"])
    for r in rows:  # the batch's 4 prompts, and at most 2 refill rounds of as many
        assert 1 <= r["sampling/prompts_drawn"] <= 3 and 0 <= r["sampling/groups_with_signal"] <= 1
    assert any(r["sampling/prompts_drawn"] > 1 for r in rows)  # refills were drawn
    crash = launch("crash", "train_step:2")  # dies in step 2, after the checkpoint of step 2 (two steps done)
    assert crash.returncode == 1 and re.search(r"died with signal 9", crash.stderr), crash.stderr[-3000:]
    again = launch("crash")
    assert again.returncode == 0 and "resumed from" in again.stderr, again.stderr[-3000:]
    name_ref, w_ref = _final_weights(tmp_path / "ref")
    name_new, w_new = _final_weights(tmp_path / "crash")
    assert name_ref == name_new and w_ref.keys() == w_new.keys()
    for k in w_ref:
        assert torch.equal(w_ref[k], w_new[k]), k
    keep = ("step", "reward", "episode/turns", "episode/policy_tokens", "episode/env_tokens", "loss", "samples",
            "sampling/prompts_drawn", "sampling/groups_with_signal")
    assert [{k: r[k] for k in keep} for r in _rows(tmp_path / "crash")] == [{k: r[k] for k in keep} for r in rows]


def test_a_colocated_episode_job_runs_the_calculator_task(tmp_path):
    """The colocated layout, and the built-in tool-use task end to end: its warm start's demonstrations (transcripts
    as ids) train, and its episodes are played against the calculator, in a paged KV cache of two episodes'
    tokens."""
    proc = warm_cli.run(["train", "data.dataset=calculator", "env.cls=megatron_rl.environments.calculator:Calculator",
                         "env.max_tokens=48", "env.max_turns=3", "env.num_workers=1", "rollout.max_new_tokens=20",
                         "trainer.sft_warmup_steps=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
                         "data.eval_size=2", "data.eval_samples=1", "run.steps=1", "trainer.tp=1",
                         "generator.colocated=true", "generator.kv_cache_tokens=192", f"checkpoint.dir={tmp_path}",
                         "run.name=c"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(tmp_path / "c")
    assert rows[0]["warm_start_s"] > 0 and all(r["episode/turns"] >= 1 and r["env_failures"] == 0 for r in rows)


def test_episode_settings_that_cannot_work_are_one_line_each(tmp_path):
    # A pipelined generator plays episodes (`inference/pipeline.py`): generator.pp=2 is no problem of its own.
    assert problems(load_config(overrides=[*GUESS, "generator.pp=2", f"checkpoint.dir={tmp_path}"]))[1] == []
    # Environments' episodes play in the live engine; agents and a pipelined generator run batch by batch.
    live = [*GUESS, "rollout.in_flight=true", f"checkpoint.dir={tmp_path}"]
    assert problems(load_config(overrides=live))[1] == []
    (line,) = problems(load_config(overrides=[*live, "generator.pp=2"]))[1]
    assert line == "rollout.in_flight=true: a generator of pp > 1 generates batch by batch (set rollout.in_flight=false)"
    (line,) = [x for x in problems(load_config(overrides=[*live, "env.cls=null",
                                                          "env.agent=megatron_rl.agents.guess:play"]))[1]
               if "in_flight" in x]
    assert line.startswith("rollout.in_flight=true: agents (env.agent) generate batch by batch")
    # Observations that enter some steps after their turns (`env.answer_steps`): environments on one stage only.
    assert problems(load_config(overrides=[*live, "env.answer_steps=4"]))[1] == []
    (line,) = problems(load_config(overrides=[*GUESS, "env.answer_steps=4", "generator.pp=2",
                                              f"checkpoint.dir={tmp_path}"]))[1]
    assert line.startswith("env.answer_steps=4 needs generator.pp=1")
    agents = [*GUESS, "env.cls=null", "env.agent=megatron_rl.agents.guess:play", "env.answer_steps=2",
              f"checkpoint.dir={tmp_path}"]
    assert any(x.startswith("env.answer_steps=2: an agent's next request")
               for x in problems(load_config(overrides=agents))[1])
    (line,) = problems(load_config(overrides=["env.answer_steps=2", f"checkpoint.dir={tmp_path}"]))[1]
    assert line == "env.answer_steps=2 times the answers of episodes: set env.cls too"
    proc = warm_cli.run(["train", "data.dataset=guess-number", "reward.kind=gsm8k", "generator.pp=2",
                         "env.cls=megatron_rl.environments.guess:GuessNumber", f"checkpoint.dir={tmp_path}"])
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert "reward.kind='gsm8k' and reward.function do nothing with it" in line and "pipeline" not in line
    proc = warm_cli.run(["train", "data.dataset=guess-number", f"checkpoint.dir={tmp_path}"])
    assert proc.returncode == 2 and "set env.cls=megatron_rl.environments.guess:GuessNumber" in proc.stderr
    proc = warm_cli.run(["train", "data.dataset=guess-number", "env.cls=tests_nowhere:Env",
                         f"checkpoint.dir={tmp_path}"])
    assert proc.returncode == 2 and "env.cls='tests_nowhere:Env'" in proc.stderr


def test_observations_are_rendered_one_turn_at_a_time_and_never_re_tokenized(smollm2_tokenizer):
    """SmolLM2's chat template: an observation's ids are the template's new turn after the reply's end-of-turn
    token, and the episode's ids (prompt, sampled reply, observation) are kept as they are, though decoding them
    and encoding the text again gives other ids."""
    tok = smollm2_tokenizer
    template = TurnTemplate(tok, chat=True)
    first = {"role": "user", "content": "What is 17 * 3?"}
    prompt = template.prompt(first)
    assert prompt == tok.encode(tok.apply_chat_template([first], add_generation_prompt=True))
    end = [i for i in tok.stop_ids if tok.decode([i], skip_special_tokens=False) == "<|im_end|>"]
    reply = tok.encode(" hel") + tok.encode("lo") + end  # sampled in two pieces: not how " hello" encodes
    assert tok.encode(" hello") != tok.encode(" hel") + tok.encode("lo")
    obs = template.observation({"role": "tool", "content": "51"})
    episode = prompt + reply + obs
    text = tok.decode(episode, skip_special_tokens=False)
    assert tok.encode(text) != episode  # re-tokenizing the episode would change what was sampled
    turns = [first, {"role": "assistant", "content": " hello"}, {"role": "tool", "content": "51"}]
    whole = tok.apply_chat_template(turns, add_generation_prompt=True)
    assert text == whole  # the turns rendered one by one are the template's conversation
    rollouts = ScoredRollouts(0, 0, [prompt], [reply + obs + reply], [[-0.5] * (2 * len(reply) + len(obs))], [1.0],
                              [0], [""], 0.0, 0.0, 0.0,
                              policy_masks=[[True] * len(reply) + [False] * len(obs) + [True] * len(reply)])
    batch = pack([rollouts], pad_id=0)
    assert batch.tokens[0, : len(prompt) + 2 * len(reply) + len(obs)].tolist() == prompt + reply + obs + reply
    learned = batch.response_mask()[0].nonzero().flatten().tolist()
    start = len(prompt)
    assert learned == list(range(start, start + len(reply))) + list(
        range(start + len(reply) + len(obs), start + 2 * len(reply) + len(obs)))
    batch.advantages = torch.ones(1)
    (mb,) = make_micro_batches(batch, 4, 64)
    assert mb["loss_mask"][0].nonzero().flatten().tolist() == learned  # no loss, weight, KL or entropy at the tool's


def test_an_environment_that_fails_to_start_ends_its_episode_and_the_batch_trains(tiny_hf):
    """The constructor or `reset` of one episode's environment raises: that episode samples nothing and returns 0,
    is counted as a failure, and the others play on; the batch still packs for the trainer."""
    from megatron_rl.launch.spawn import run_local
    from episode_workers import failing_environments_worker

    _, cfg, full = tiny_hf
    outs, returns, stats, learned = run_local(failing_environments_worker, 1, cfg, full)[0]
    (ok, ok_tokens, ok_turns), reset, init = outs
    assert ok in ("done", "turns", "length") and ok_tokens > 0 and ok_turns >= 1 and returns[0] > 0
    assert reset == init == ("error", 0, 1) and returns[1:] == [0.0, 0.0]
    assert stats["failures"] == 2 and stats["episodes"] == 3
    assert learned[0] > 0 and learned[1:] == [0, 0]  # nothing of a failed episode is learned from

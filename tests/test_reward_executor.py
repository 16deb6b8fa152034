"""A reward model on ranks of its own (`reward.executor`): a job that scores with it trains exactly as the
in-process path does, survives the reward rank's death, and refuses layouts that cannot work in one line."""

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config, validate
import warm_cli

REPO = Path(__file__).resolve().parents[1]


def _args(d, run_dir, name, *extra):
    return [f"model.checkpoint={d / 'hf'}", "data.dataset=jsonl", f"data.path={d / 'words.jsonl'}",
            "data.answer_field=null", "data.eval_size=4", "data.eval_samples=2", "reward.kind=reward-model",
            f"reward.model={d / 'rm'}", "trainer.sft_warmup_steps=0", "generator.dtype=fp32", "trainer.dtype=fp32",
            "trainer.tp=1", "generator.colocated=true",  # one policy rank (and the controller sends to the scorer)
            "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4",
            "run.eval_interval=2", "run.steps=4", "checkpoint.save_interval=1", f"checkpoint.dir={run_dir}",
            f"run.name={name}", *extra]


def _env(failpoint=None):
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_RL_FAILPOINT"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    if failpoint:
        env["MEGATRON_RL_FAILPOINT"] = failpoint
    return env


def _train_together(*jobs):
    """Independent jobs (args, failpoint) at the same time, each its own `megatron-rl train`: their results in
    order. Each job's ranks wait on one another much of the time; side by side, the two cores stay busy."""
    procs = [warm_cli.start(["train", *args], cwd=REPO, env=_env(failpoint)) for args, failpoint in jobs]
    with ThreadPoolExecutor(len(procs)) as pool:  # every pipe read at once: none fills while another is awaited
        return list(pool.map(warm_cli.finish, procs))


def _rows(run_dir, name):
    return [json.loads(line) for line in (run_dir / name / "metrics.jsonl").read_text().splitlines()]


def test_reward_executor_trains_as_the_in_process_path_resumes_after_its_rank_dies_and_adds_to_a_verifier(
        reward_model_job, tmp_path):
    """The same job twice: the reward model in the generator's leader (the in-process path), and on two TP ranks of
    its own (the policy's one colocated rank, which is also the controller, sends its texts there). The second run's reward rank is killed while it scores batch 2 (the job ends), and the run resumes.
    Every step's reward and held-out reward equal the in-process run's (fp32: the same responses, the same
    scores to rounding), so nothing was lost or scored twice. A third job adds a verifier's reward to the score."""
    args = _args(reward_model_job, tmp_path, "executor", "reward.executor.tp=2", "reward.executor.dp=1")
    ref, died = _train_together((_args(reward_model_job, tmp_path, "in_process"), None),
                                (args, "reward_model_batch:2"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    # named after its source, not the run_dir/initial_model it was converted into
    assert json.loads((tmp_path / "in_process" / "summary.json").read_text())["model"] == "hf"
    assert died.returncode != 0
    assert "reward model" in (tmp_path / "executor" / "failure.log").read_text()  # the dead rank's role is named
    # The resumed run, and a third job (below) beside it.
    both_args = _args(reward_model_job, tmp_path, "both", "reward.executor.tp=2", "reward.executor.dp=1",
                      "reward.kind=function", "reward.function=test_rewards:quarter_reward", "reward.model_coef=2",
                      "run.steps=1")
    again, both = _train_together((args, None), (both_args, None))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr
    want, got = _rows(tmp_path, "in_process"), _rows(tmp_path, "executor")
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    assert len({round(r["reward"], 4) for r in want}) > 1  # real-valued scores that move: the test can fail
    # means of a random model's scores over 8 samples: real-valued, not a verifier's multiples of 1/8
    assert all(abs(x * 8 - round(x * 8)) > 1e-6 for r in want for x in (r["reward"], r.get("eval/reward", 0.1)))
    for w, g in zip(want, got):
        assert g["reward"] == pytest.approx(w["reward"], abs=1e-5), (w, g)
        assert ("eval/reward" in g) == ("eval/reward" in w)
        if "eval/reward" in w:
            assert g["eval/reward"] == pytest.approx(w["eval/reward"], abs=1e-5)
        assert g["time/reward_model_s"] > 0 and "time/reward_model_s" not in w
    # A verifier plus the reward model on its ranks: each sample's reward is the verifier's (a constant 0.25 here) plus
    # reward.model_coef times the model's score. Step 0 samples from the starting weights, as both runs above did.
    assert both.returncode == 0, both.stderr[-3000:]
    first = _rows(tmp_path, "both")[0]
    assert first["step"] == 0
    assert first["reward"] == pytest.approx(0.25 + 2 * want[0]["reward"], abs=1e-5)
    assert first["eval/reward"] == pytest.approx(0.25 + 2 * want[0]["eval/reward"], abs=1e-5)


@pytest.mark.parametrize("overrides, message", [
    (["reward.executor.dp=1"], r"reward.executor.dp=1 places a reward model on ranks of its own, but reward.model "
                               r"is not set"),
    (["reward.model_coef=2"], r"reward.model_coef=2.0 weighs a reward model on ranks of its own"),
    (["reward.executor.dp=-1"], r"reward.executor.dp=-1 must be >= 0"),
    (["reward.executor.dp=2"], r"reward.executor.dp=2 is more than generator.dp=1: each reward replica scores whole "
                               r"generator replicas, so 1 would never score"),
])
def test_reward_executor_settings_that_cannot_work_fail_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, overrides), 3)


def test_reward_executor_layouts_are_checked_against_the_reward_model(reward_model_job):
    d = reward_model_job
    base = [f"model.checkpoint={d / 'hf'}", "data.dataset=jsonl", f"data.path={d / 'words.jsonl'}",
            "data.answer_field=null", "data.eval_size=4", "trainer.sft_warmup_steps=0"]
    rm = [f"reward.model={d / 'rm'}", "reward.executor.dp=1"]
    with pytest.raises(ConfigError, match=r"4 attention heads.*reward.executor.tp=3"):
        validate(load_config(None, base + rm + ["reward.kind=reward-model", "reward.executor.tp=3"]), 8)
    with pytest.raises(ConfigError, match=r"verifier's reward plus a reward model's score needs the reward model on "
                                          r"ranks of its own"):
        validate(load_config(None, base + [f"reward.model={reward_model_job / 'rm'}", "reward.kind=function",
                                           "reward.function=test_rewards:length_reward"]), 8)
    # a verifier plus the reward model on its own ranks is a valid job, and it needs one more rank
    cfg = load_config(None, base + rm + ["reward.kind=function", "reward.function=test_rewards:length_reward"])
    validate(cfg, 4)
    assert cfg.world_size_needed == 4  # trainer 2 + generator 1 + reward model 1
    with pytest.raises(ConfigError, match=r"reward model 1x1\) but the world has 3"):
        validate(cfg, 3)


def test_a_reward_model_on_its_ranks_adds_its_score_of_each_episode_to_the_return(reward_model_job, tmp_path):
    """Episodes (an environment that ends each after one reply with reward 0.25) scored by the reward model on ranks
    of its own: each sample's reward is its return plus reward.model_coef times the model's score of the episode's
    first message, as rendered, followed by the episode (transformers' model, scoring in this process, is the
    reference)."""
    from megatron_rl.config import load_config
    from megatron_rl.controller.tasks import build_task
    from megatron_rl.environments.play import TurnTemplate
    from megatron_rl.rewards.reward_model import RewardModelReward
    from megatron_rl.tokenizers import load_tokenizer

    d = reward_model_job
    args = _args(d, tmp_path, "episodes", "reward.kind=auto", "reward.executor.dp=1", "reward.model_coef=2",
                 "env.cls=env_cases:QuarterAtOnce", "env.num_workers=1", "env.max_tokens=8",
                 "rollout.prompts_per_step=2", "run.steps=1")
    (proc,) = _train_together((args, None))
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = _rows(tmp_path, "episodes")[0]
    tok = load_tokenizer(str(d / "hf"))
    template = TurnTemplate(tok, chat=tok.has_chat_template)
    records = build_task(load_config(None, args), tok, with_reward=False).train_batch(0, 2)
    first = [" ".join(reversed(records[j // 2].prompt.split())) for j in range(4)]  # QuarterAtOnce's first message
    prompts = [tok.decode(template.prompt({"role": "user", "content": m})) for m in first]
    assert len(row["samples"]) == 4 and row["episode/turns"] == 1
    scores = RewardModelReward(str(d / "rm")).score([(p, t) for p, t in zip(prompts, row["samples"])])
    assert len({round(s, 4) for s in scores}) > 1  # real-valued scores: the test can fail
    assert row["reward"] == pytest.approx(0.25 + 2 * sum(scores) / 4, abs=1e-5)
    assert row["time/reward_model_s"] > 0

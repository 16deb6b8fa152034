"""The RL loop and the controller's bookkeeping in one process: the plan every rank walks, checked against the
schedule's rules, and `loop.run` driven by fake executors with the real `Collector`."""

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rl.checkpointing.settings import CheckpointSettings
from megatron_rl.controller import loop
from megatron_rl.controller import scoring
from megatron_rl.controller.collector import Collector, batch_with_advantages, metrics_row, pack
from megatron_rl.controller.scoring import Evaluated, ModelScores, ScoredRollouts, UnscoredRollouts
from megatron_rl.controller.schedule import (Checkpoint, Generate, PushWeights, Train, generation_version, job_plan,
                                             pull_before_batch, push_after_step, save_after, syncs_needed)


def _role_view(plan, role):
    """The actions one role takes part in, in order (what a rank of that executor does)."""
    keep = {"generator": (PushWeights, Generate, Checkpoint), "trainer": (PushWeights, Train, Checkpoint)}[role]
    return [a for a in plan if isinstance(a, keep)]


@pytest.mark.parametrize("n,s,iv", [(6, 0, 2), (6, 1, 0), (7, 2, 3), (3, 3, 1), (5, 1, 50)])
def test_plan_follows_the_schedule(n, s, iv):
    plan = job_plan(n, s, save_interval=iv, eval_interval=2)
    gens = [a for a in plan if isinstance(a, Generate)]
    assert [g.batch for g in gens] == list(range(n))
    assert [g.version for g in gens] == [generation_version(b, s) for b in range(n)]
    assert [a.step for a in plan if isinstance(a, Train)] == list(range(n))
    assert [a.version for a in plan if isinstance(a, PushWeights)] == [0] + syncs_needed(n, s)
    saves = [a.version for a in plan if isinstance(a, Checkpoint)]
    assert saves == ([0] if iv else []) + [k + 1 for k in range(n) if save_after(k, n, iv)]
    assert [g.evaluate for g in gens] == [b % 2 == 0 or b == n - 1 for b in range(n)]
    pos = {a: i for i, a in enumerate(plan)}
    for g in gens:
        # generated before it is trained, with weights that were pushed before, at most s versions old
        assert pos[g] < pos[Train(g.batch)]
        assert pos[PushWeights(g.version)] < pos[g]
        assert g.batch - g.version <= s
        # the generator pulls exactly where the schedule says it does
        earlier = [a for a in plan[:pos[g]] if isinstance(a, (PushWeights, Generate))]
        pulled = isinstance(earlier[-1], PushWeights) and g.batch > 0
        assert pulled == pull_before_batch(g.batch, s)
    for k in range(n):  # the trainer pushes what it has just trained, right after the step (and its checkpoint)
        after = plan[pos[Train(k)] + 1:]
        nxt = [a for a in after if isinstance(a, (PushWeights, Train))]
        assert (nxt[:1] == [PushWeights(k + 1)]) == push_after_step(k, n, s)


def test_plan_by_hand():
    assert job_plan(3, 1, save_interval=2, eval_interval=10) == [
        Checkpoint(0), PushWeights(0), Generate(0, 0, True), Generate(1, 0, False), Train(0), PushWeights(1),
        Generate(2, 1, True), Train(1), Checkpoint(2), Train(2), Checkpoint(3)]


def test_resumed_plan_regenerates_nothing_restored():
    # after 4 of 8 steps at staleness 2: batches 4 and 5 came back with the checkpoint
    plan = job_plan(8, 2, start=4, restored={4, 5}, save_interval=4, eval_interval=100, fresh=False)
    assert plan[0] == PushWeights(4)
    assert [(a.batch, a.version) for a in plan if isinstance(a, Generate)] == [(6, 4), (7, 5)]
    assert [a.step for a in plan if isinstance(a, Train)] == [4, 5, 6, 7]
    assert Checkpoint(0) not in plan and plan[-1] == Checkpoint(8)


def _rollouts(batch, version, rewards, groups):
    n = len(rewards)
    return ScoredRollouts(batch, version, [[1, 2]] * n, [[3] * (i + 1) for i in range(n)],
                    [[-0.5] * (i + 1) for i in range(n)], rewards, groups, ["x"] * n, 0.1, 0.01, 0.0)


def test_collector_packs_replicas_in_order_and_keeps_pending_batches():
    sent = {2: [_rollouts(0, 0, [1.0, 0.0], [1, 1]), _rollouts(1, 0, [0.0, 0.0], [1, 1])]}
    c = Collector([0, 2], lambda src: sent[src].pop(0))
    c.put(_rollouts(0, 0, [1.0, 1.0], [0, 0]))
    c.put(_rollouts(1, 0, [0.0, 1.0], [0, 0]))
    parts = c.take(0)
    batch = batch_with_advantages(parts, pad_id=0, advantage="group_mean")
    # a checkpoint after step 1 at staleness 1 stores batch 1 (received now from rank 2)
    pending = c.pending(1, 1, 4)
    assert list(pending) == [1] and [p["batch"] for p in pending[1]] == [1, 1]
    assert [p.rewards for p in parts] == [[1.0, 1.0], [1.0, 0.0]]
    assert batch.rewards.tolist() == [1.0, 1.0, 1.0, 0.0]
    # group-mean advantages: prompt 0 all right (0, 0), prompt 1 half right (+0.5, -0.5)
    assert batch.advantages.tolist() == [0.0, 0.0, 0.5, -0.5]
    assert batch.tokens[3].tolist() == [1, 2, 3, 3] and batch.behaviour_logprobs[3].tolist() == [0, 0, -0.5, -0.5]
    restored = Collector([0, 2], lambda src: pytest.fail("restored batches are not received"))
    restored.restore(pending)
    assert restored.take(1) == c.collect(1)


def test_pending_batches_keep_their_routes_through_a_checkpoints_rl_state(tmp_path):
    """Routing replay across a resume: a pending batch's routes (a uint8 tensor [prompt + response, layers, k] per
    sample) are saved in rl_state.pt with it and read back (safe_load) as they were, so the resumed trainer replays
    the experts the generator chose."""
    import torch

    from megatron_rl.checkpointing import safe_load

    g = torch.Generator().manual_seed(0)
    part = dataclasses.replace(_rollouts(1, 0, [1.0, 0.0], [0, 0]), routes=[
        torch.randint(0, 8, (3 + i, 2, 2), generator=g, dtype=torch.uint8) for i in range(2)])
    c = Collector([0], lambda src: pytest.fail("this replica's batches are put, not received"))
    c.put(part)
    torch.save({"pending": c.pending(1, 1, 4)}, tmp_path / "rl_state.pt")
    restored = Collector([0], lambda src: pytest.fail("restored batches are not received"))
    restored.restore(safe_load.load_data(tmp_path / "rl_state.pt")["pending"])
    got = restored.take(1)
    assert len(got) == 1 and len(got[0].routes) == 2
    assert all(a.dtype == torch.uint8 and torch.equal(a, b) for a, b in zip(got[0].routes, part.routes))


def test_collector_adds_reward_model_scores_to_each_replicas_rewards():
    """With a reward-model executor, replica d's scores come from its scorer's rank and are added, times the
    coefficient, to the verifier's rewards (the held-out reward too)."""
    sent = {2: [_rollouts(0, 0, [0.0, 1.0], [1, 1])],
            5: [ModelScores(0, 0, [0.5, -1.0], [2.0, 4.0], 0.3)], 6: [ModelScores(0, 1, [1.0, 1.0], [], 0.2)]}
    c = Collector([0, 2], lambda src: sent[src].pop(0), scorers=[5, 6], model_coef=0.5)
    c.put(dataclasses.replace(_rollouts(0, 0, [1.0, 0.0], [0, 0]), eval_reward=0.25))
    parts = c.collect(0)
    assert [p.rewards for p in parts] == [[1.25, -0.5], [0.5, 1.5]]
    assert parts[0].eval_reward == 0.25 + 0.5 * 3.0 and parts[1].eval_reward is None
    assert not any(sent.values())  # each message received once
    parts = c.take(0)
    batch = batch_with_advantages(parts, pad_id=0, advantage="group_mean")
    row = metrics_row(0, parts, batch, {}, train_s=1.0, recv_s=0.0)
    assert row["time/reward_model_s"] == 0.3 and row["reward"] == (1.25 - 0.5 + 0.5 + 1.5) / 4
    with pytest.raises(RuntimeError, match="reward-model scores of batch 1, replica 0 from rank 5, got batch 0"):
        wrong = Collector([0], lambda src: ModelScores(0, 0, [1.0], [], 0.1), scorers=[5])
        wrong.put(_rollouts(1, 0, [1.0], [0]))
        wrong.collect(1)


def documented_metrics() -> set:
    """The fields docs/metrics.md explains (the first column of its table)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `([^`]+)` \|", text, flags=re.M))


def test_every_field_of_a_metrics_row_is_documented_and_every_documented_field_exists():
    """A row with every optional part (held-out reward, reward-model executor, KL reference, a mixture of experts'
    load-balancing loss, in-flight updates' token versions, the generator's occupancy, dynamic sampling's report,
    and agent episodes' statistics) plus the two fields the loop adds equals docs/metrics.md's list; test_controller checks that a real
    job's rows hold no other."""
    episodes = {"episodes": 2, "turns": 3, "policy_tokens": 5, "env_tokens": 2, "env_s": 0.1, "failures": 0,
                "rewritten": 1}
    parts = [dataclasses.replace(_rollouts(0, 0, [1.0, 0.0], [0, 0]), eval_reward=0.5, reward_model_s=0.1,
                                 token_versions=[[0], [0, 1]], occupancy=0.9, episodes=episodes,
                                 sampling={"prompts_drawn": 3, "groups": 2, "with_signal": 1})]
    row = metrics_row(0, parts, pack(parts, pad_id=0), {"moe_aux_loss": 1.0}, train_s=1.0, recv_s=0.0, kl_ref=True)
    assert set(row) | {"time/total_s", "warm_start_s"} == documented_metrics()


def test_in_flight_rows_measure_each_tokens_staleness_and_pack_each_samples_oldest_version():
    """With token versions (rollout.in_flight): a sample's version is its oldest token's; the row's staleness is the
    step's oldest token's, its token mean and the share of tokens older than the newest, by hand."""
    parts = [dataclasses.replace(_rollouts(5, 3, [1.0, 0.0], [0, 0]), token_versions=[[3], [4, 4]])]
    b = pack(parts, pad_id=0)
    assert b.weight_versions.tolist() == [3, 4]
    row = metrics_row(5, parts, b, {}, train_s=1.0, recv_s=0.0)
    assert row["staleness"] == 2 and row["staleness/token_mean"] == 5 - 11 / 3
    assert row["staleness/older_tokens"] == 1 / 3


def test_pack_matches_a_hand_built_batch():
    b = pack([_rollouts(3, 2, [1.0], [0]), _rollouts(3, 2, [0.0, 1.0], [1, 1])], pad_id=9)
    assert b.tokens.tolist() == [[1, 2, 3, 9], [1, 2, 3, 9], [1, 2, 3, 3]]
    assert b.response_lengths.tolist() == [1, 1, 2] and b.weight_versions.tolist() == [2, 2, 2]


class _FakeJob:
    """One colocated rank (trainer, generator and controller) with fake executors that log what they are asked."""

    def __init__(self, n, s, save_interval, resume=None, stop_at_push=None):
        self.stop_at_push, self.pushes = stop_at_push, 0
        self.cfg = SimpleNamespace(run=SimpleNamespace(steps=n, eval_interval=2), algorithm=SimpleNamespace(kl_coef=0),
                                   checkpoint=CheckpointSettings(save_interval=save_interval))
        self.staleness, self.log, self._resume = s, [], resume
        self.version = None
        self.collector = Collector([0], lambda src: pytest.fail("one rank"))
        self.task = SimpleNamespace(score=lambda problems, texts: [float(len(t) % 2) for t in texts], score_failures=0)
        self.tok = SimpleNamespace(decode=lambda ids: "y" * len(ids))
        job = self

        class Generator:
            def generate(self, batch, version):
                assert version == job.version, "generates with the weights it holds"
                job.log.append(("generate", batch, version))
                outs = [SimpleNamespace(prompt_ids=[1], token_ids=[2] * (1 + i), logprobs=[-1.0] * (1 + i))
                        for i in range(4)]
                return UnscoredRollouts(batch=batch, version=version, problems=[None] * 4, groups=[0, 0, 1, 1],
                                        outputs=outs, texts=["y" * (1 + i) for i in range(4)], gen_s=0.0)

            def evaluate(self):
                job.log.append(("evaluate", job.version))
                return Evaluated(problems=[None] * 4, texts=["y", "yy", "yy", "yy"])  # mean reward 0.25

        class Trainer:
            def start(self, progress):
                job.log.append(("warm-start",))

            def step(self, batch, step):
                job.log.append(("train", int(batch.weight_versions[0])))
                return {"loss": float(batch.advantages.abs().sum())}

        self.generator, self.trainer, self.reward_model = Generator(), Trainer(), None

    def resume(self):
        return self._resume

    def stop_requested(self):
        self.pushes += 1
        return self.pushes == self.stop_at_push

    def push_weights(self, version):
        self.version = version
        self.log.append(("push", version))
        return 0.0

    def score(self, generated, evaluated, *, push_s):
        return scoring.score(self.task, generated, evaluated, wait_s=push_s)

    def send_rollouts(self, rollouts):
        self.collector.put(rollouts)

    def scored_rollouts(self, k):
        self.log.append(("batch", k))
        return self.collector.take(k)

    def batch_with_advantages(self, k, parts):
        return batch_with_advantages(parts, pad_id=0, advantage="group_mean")

    def checkpoint(self, version):
        self.log.append(("checkpoint", version))

    def raise_if_checkpoint_failed(self):
        pass

    def finish(self):
        self.log.append(("finish",))


def test_loop_walks_the_plan_with_fake_executors():
    job = _FakeJob(3, 1, save_interval=2)
    steps = []
    rows = loop.run(job, progress=lambda phase, done, total, text: steps.append((phase, done)))
    assert job.log == [("warm-start",), ("checkpoint", 0), ("push", 0), ("generate", 0, 0), ("evaluate", 0),
                       ("generate", 1, 0), ("batch", 0), ("train", 0), ("push", 1), ("generate", 2, 1),
                       ("evaluate", 1), ("batch", 1), ("train", 0), ("checkpoint", 2), ("batch", 2), ("train", 1),
                       ("checkpoint", 3), ("finish",)]
    assert [r["step"] for r in rows] == [0, 1, 2] and [r["staleness"] for r in rows] == [0, 1, 1]
    assert [r.get("eval/reward") for r in rows] == [0.25, None, 0.25]
    # rewards: responses of 1..4 tokens, odd lengths score 1
    assert all(r["reward"] == 0.5 for r in rows) and steps == [("rl", 1), ("rl", 2), ("rl", 3)]


def test_resumed_loop_skips_the_warm_start_and_restored_batches():
    job = _FakeJob(4, 1, save_interval=2, resume=(2, {2}))
    job.collector.restore({2: [vars(_rollouts(2, 1, [1.0, 0.0], [0, 0]))]})
    rows = loop.run(job)
    assert ("warm-start",) not in job.log and ("checkpoint", 0) not in job.log
    assert [e for e in job.log if e[0] == "generate"] == [("generate", 3, 2)]
    assert [r["step"] for r in rows] == [2, 3] and rows[0]["generated_with_version"] == 1


def test_a_stop_request_saves_at_the_next_weight_push_and_leaves():
    job = _FakeJob(6, 1, save_interval=0, stop_at_push=2)  # the signal arrives during step 0
    rows = loop.run(job)
    assert job.log[-4:] == [("batch", 0), ("train", 0), ("checkpoint", 1), ("finish",)]
    assert [e for e in job.log if e[0] == "generate"] == [("generate", 0, 0), ("generate", 1, 0)]
    assert [r["step"] for r in rows] == [0]
    # the checkpoint after step 1 keeps batch 1, generated before the stop, as pending
    assert list(job.collector.pending(1, 1, 6)) == [1]


def test_save_interval_0_keeps_only_the_final_checkpoint():
    """save_interval=0 used to write no checkpoint at all, so that the run could be neither resumed nor extended."""
    assert [a for a in job_plan(5, 1, save_interval=0) if isinstance(a, Checkpoint)] == [Checkpoint(5)]
    assert [a for a in job_plan(5, 1, start=2, save_interval=0, fresh=False) if isinstance(a, Checkpoint)] == [
        Checkpoint(5)]


def test_save_final_false_skips_only_the_checkpoint_after_the_last_step():
    def saves(**kw):
        return [a.version for a in job_plan(6, 1, **kw) if isinstance(a, Checkpoint)]

    assert saves(save_interval=0, save_final=False) == []
    assert saves(save_interval=4, save_final=False) == [0, 4]
    assert saves(save_interval=3, save_final=False) == [0, 3, 6]  # the last step falls on the interval: kept
    assert saves(save_interval=4) == [0, 4, 6]


def test_the_log_prob_gap_warning_comes_once_when_the_windowed_mean_passes_the_threshold():
    from megatron_rl.controller.metrics import GAP_WINDOW, LOGP_GAP_WARN, GapWatch

    said = []
    watch = GapWatch(4, said.append)
    below, above = LOGP_GAP_WARN * 0.5, LOGP_GAP_WARN * 1.5
    for step, gap in enumerate([above] * 2 + [below] * GAP_WINDOW):  # no window of 5 averages above it
        watch.see({"step": step, "logp_diff_mean": gap})
    assert said == []
    for step in range(10, 10 + 2 * GAP_WINDOW):
        watch.see({"step": step, "logp_diff_mean": above} if step % 2 else {"step": step})  # rows without it too
    # the window's mean passes the threshold with its third row of 1.5x (3 x 1.5 + 2 x 0.5 > 5): step 15
    assert len(said) == 1 and "rollout staleness 4" in said[0] and f"past {LOGP_GAP_WARN}" in said[0]
    assert said[0].startswith("megatron-rl: warning: at step 15 ")


def test_the_log_prob_gap_warning_sits_between_the_studys_staleness_1_and_staleness_4_runs():
    """LOGP_GAP_WARN is a measurement (docs/benchmarks.md, the seeded staleness study): fed the study's runs step by
    step, GapWatch stays silent on every staleness 1 run, which learned as well as sync, and warns on every
    staleness 4 run, which did not."""
    import json
    from pathlib import Path

    from megatron_rl.controller.metrics import GapWatch

    study = json.loads((Path(__file__).resolve().parents[1] / "docs" / "data" / "staleness-seeds.json").read_text())
    warned = {}
    for run in study["results"]:
        if not run.get("train") or run["setting"] == "sync":
            continue  # runs kept without their per-step rows
        said = []
        watch = GapWatch(int(run["setting"].split("-")[0].removeprefix("async")), said.append)
        for step, _, _, gap in run["train"]:
            watch.see({"step": step, "logp_diff_mean": gap})
        warned[(run["setting"], run["seed"])] = bool(said)
    ones = [w for (setting, _), w in warned.items() if setting.startswith("async1")]
    fours = [w for (setting, _), w in warned.items() if setting.startswith("async4")]
    assert len(ones) >= 4 and len(fours) >= 8, warned
    assert not any(ones) and all(fours), warned


def test_a_run_that_cannot_learn_is_told_once_naming_the_step():
    """`trainer.lr=1e6` on the default job: the gradient norm exactly 0 at every step and, from step 1, the policy
    uniform (the rows below are that run's own, rounded). Uniform is judged against the entropy of a uniform
    distribution and of a model fresh from its initialization (logits of std 0.2), both computed by torch."""
    import torch

    from megatron_rl.controller.metrics import STUCK_STEPS, StuckWatch

    vocab = 300
    uniform = torch.distributions.Categorical(logits=torch.zeros(vocab)).entropy().item()
    fresh = torch.distributions.Categorical(logits=0.2 * torch.randn(64, vocab, generator=torch.Generator()
                                                                       .manual_seed(0))).entropy().mean().item()
    collapsed = [{"step": 0, "grad_norm": 0.0, "entropy": 4.6947}] + [
        {"step": s, "grad_norm": 0.0, "entropy": 5.7037821} for s in range(1, 8)]
    said = []
    watch = StuckWatch(vocab, said.append)
    for row in collapsed:
        watch.see(row)
    assert abs(5.7037821 - uniform) < 1e-6 and len(said) == 1, said
    assert said[0].startswith(f"megatron-rl: warning: at step {STUCK_STEPS - 1} the gradient norm has been exactly 0 "
                              f"for {STUCK_STEPS} steps in a row and the policy uniform over the 300 tokens")
    assert "collapsed" in said[0] and "trainer.lr" in said[0] and "\n" not in said[0]

    def told(rows):
        out = []
        w = StuckWatch(vocab, out.append)
        for step, (grad, entropy) in enumerate(rows):
            w.see({"step": step, **({} if grad is None else {"grad_norm": grad}), "entropy": entropy})
        return out

    almost = STUCK_STEPS - 1
    learning = [(0.0, fresh)] * almost + [(0.3, fresh)] + [(0.0, fresh)] * almost  # never enough zeros in a row
    assert told(learning) == [] and told([(0.2, fresh)] * 20) == []
    assert fresh < uniform - 5 * 1e-3  # a fresh model is not "uniform"
    # Rows without a gradient norm neither break nor extend a run of zeros.
    gaps = [(0.0, fresh), (None, fresh)] * STUCK_STEPS
    out = told(gaps)
    assert len(out) == 1 and out[0].startswith(f"megatron-rl: warning: at step {2 * STUCK_STEPS - 2} the gradient "
                                               f"norm has been exactly 0 for {STUCK_STEPS} steps in a row: the run is "
                                               f"not learning")
    # Uniform with a gradient: collapsed all the same.
    out = told([(1.5, uniform)] * STUCK_STEPS)
    assert len(out) == 1 and f"at step {STUCK_STEPS - 1} the policy has been uniform" in out[0]

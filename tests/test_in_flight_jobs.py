"""Jobs with `rollout.in_flight`: the next batch's prompts fill the slots the current batch frees, weights land under
running sequences, and a checkpoint carries the partly sampled batch (`inference/live.py`). A disjoint TP2 trainer
with a TP1 generator, killed inside a trainer step, resumes to the uninterrupted run's weights and metrics (the
caches kept at a push, recomputed at the push after a checkpoint); a colocated job with two generator replicas,
recomputing at every push and refilling groups without signal, trains within the staleness bound, each replica's batch in flight saved, and resumes
from a kill the same way; a job of episodes (the guessing game, with dynamic sampling), killed with episodes
mid-flight in its checkpoint (their environments' answers outstanding), resumes the same way too."""

import json

import torch

import warm_cli
from test_controller import _final_weights
from test_episode_jobs import GUESS

BASE = ["run.steps=5", "trainer.sft_warmup_steps=10", "run.eval_interval=100", "rollout.prompts_per_step=4",
        "data.eval_size=4", "rollout.max_new_tokens=8", "checkpoint.save_interval=2", "rollout.in_flight=true"]


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _in_flight(step_dir) -> dict:
    """replica -> the sequences its live engine held at the save: (tokens sampled, finish)."""
    state = torch.load(step_dir / "rl_state.pt", weights_only=True)["in_flight"]
    return {d: [(len(q["tokens"]), q["finish"]) for q in s["sequences"]] for d, s in state.items() if s}


def _resumed_as_uninterrupted(ref_dir, resumed, run_dir, keys) -> list:
    """The resumed command resumed from step 2 and ended with the uninterrupted run's weights and metric rows (the
    uninterrupted run's rows, returned)."""
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["resumed_from_step"] == 2
    (name_ref, w_ref), (name_new, w_new) = _final_weights(ref_dir), _final_weights(run_dir)
    assert name_ref == name_new == "step_00000005" and w_ref.keys() == w_new.keys()
    for k in w_ref:
        assert torch.equal(w_ref[k], w_new[k]), k
    rows_ref, rows_new = _rows(ref_dir), _rows(run_dir)
    assert [r["step"] for r in rows_new] == list(range(5))
    for a, b in zip(rows_ref, rows_new):
        for key in keys:
            assert a[key] == b[key], (a["step"], key)
    return rows_ref


def test_a_killed_in_flight_job_resumes_to_the_same_weights_and_metrics(tmp_path):
    # 16 samples a batch in 24 slots: 8 of the next batch's start beside each batch.
    args = [*BASE, "rollout.staleness=2", "generator.max_batch_size=24", f"checkpoint.dir={tmp_path}"]

    def launch(name, failpoint=None):
        return warm_cli.run_with_failpoint(["train", *args, f"run.name={name}"], failpoint)

    ref = launch("ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    crash = launch("crash", "train_step:3")  # after step 2's checkpoint, with batch 3 partly sampled in it
    assert crash.returncode == 1 and "died with signal 9" in crash.stderr, crash.stderr[-3000:]
    assert (tmp_path / "crash" / "latest").read_text().strip() == "step_00000002"
    (held,) = _in_flight(tmp_path / "crash" / "step_00000002").values()
    assert any(n > 0 and finish is None for n, finish in held)  # sequences saved mid-flight, their caches gone
    rows_ref = _resumed_as_uninterrupted(tmp_path / "ref", launch("crash"), tmp_path / "crash",
                                         ("reward", "loss", "generated_with_version", "response_length",
                                          "staleness/token_mean"))
    assert all(r["staleness"] <= 2 for r in rows_ref) and max(r["staleness"] for r in rows_ref) == 2
    assert all(0 <= r["staleness/token_mean"] <= r["staleness"] for r in rows_ref)
    assert any(r["staleness/older_tokens"] > 0 for r in rows_ref)  # some samples span a weight switch


def test_a_colocated_in_flight_job_with_two_replicas_keeps_every_token_within_the_bound_and_resumes(tmp_path):
    """With the caches recomputed at every push (`rollout.recompute_cache`) and dynamic sampling (each replica
    refills its groups without signal in its live engine, ahead of its next batch); killed inside step 3, with each
    replica's batch in flight in checkpoint 2, it resumes to the uninterrupted run's weights and metrics."""
    # Two replicas of 8 samples a batch, in 12 slots each.
    args = [*BASE, "rollout.staleness=1", "generator.colocated=true", "generator.dp=2", "generator.max_batch_size=12",
            "rollout.recompute_cache=true", "algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_rounds=1",
            f"checkpoint.dir={tmp_path}"]

    def launch(name, failpoint=None):
        return warm_cli.run_with_failpoint(["train", *args, f"run.name={name}"], failpoint)

    run = launch("c")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _rows(tmp_path / "c")
    assert [r["step"] for r in rows] == list(range(5))
    assert all(r["staleness"] <= 1 for r in rows) and all(0 <= r["staleness/token_mean"] <= 1 for r in rows)
    assert any(r["sampling/prompts_drawn"] > 1 for r in rows)  # refills were drawn
    saved = _in_flight(tmp_path / "c" / "step_00000004")
    assert sorted(saved) == [0, 1] and all(len(s) == 8 for s in saved.values())  # each replica's batch 4 was queued
    crash = launch("crash", "train_step:3")
    assert crash.returncode == 1 and "died with signal 9" in crash.stderr, crash.stderr[-3000:]
    assert sorted(_in_flight(tmp_path / "crash" / "step_00000002")) == [0, 1]
    _resumed_as_uninterrupted(tmp_path / "c", launch("crash"), tmp_path / "crash",
                              ("reward", "loss", "generated_with_version", "response_length", "staleness/token_mean",
                               "sampling/prompts_drawn", "sampling/groups_with_signal"))


def test_a_killed_in_flight_episode_job_resumes_to_the_same_weights_and_metrics(tmp_path):
    """Episodes of the guessing game in the live engine (disjoint: trainer TP2, generator TP1): 8 episodes a batch
    in 12 slots, so 4 of the next batch's play beside each batch and see the push land mid-episode; each
    observation enters 2 steps after its turn (`env.answer_steps`), so a checkpoint may hold two starts outstanding.
    With dynamic sampling: groups without signal are refilled in the live engine, behind the next batch."""
    args = [*GUESS, "run.steps=5", "checkpoint.save_interval=2", "rollout.in_flight=true", "rollout.staleness=2",
            "generator.max_batch_size=12", "env.answer_steps=2", "algorithm.dynamic_sampling=true",
            "algorithm.dynamic_sampling_rounds=2", f"checkpoint.dir={tmp_path}"]

    def launch(name, failpoint=None):
        return warm_cli.run_with_failpoint(["train", *args, f"run.name={name}"], failpoint)

    ref = launch("ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    crash = launch("crash", "train_step:3")
    assert crash.returncode == 1 and "died with signal 9" in crash.stderr, crash.stderr[-3000:]
    state = torch.load(tmp_path / "crash" / "step_00000002" / "rl_state.pt", weights_only=True)["in_flight"][0]
    seqs = state["sequences"]
    # Episodes saved mid-flight: past their first turn and not over, their replies (and rewards) kept with them.
    assert any(q["episode"] and q["turns"] >= 1 and q["finish"] != "done" for q in seqs)
    assert any(e["replies"] for batch in state["episodes"].values() for e in batch)
    rows_ref = _resumed_as_uninterrupted(tmp_path / "ref", launch("crash"), tmp_path / "crash",
                                         ("reward", "loss", "generated_with_version", "episode/turns",
                                          "episode/env_tokens", "staleness/token_mean", "sampling/prompts_drawn",
                                          "sampling/groups_with_signal"))
    assert all(r["staleness"] <= 2 for r in rows_ref)
    assert any(r["staleness/older_tokens"] > 0 for r in rows_ref)  # some episodes span a weight switch
    assert all(1 <= r["sampling/prompts_drawn"] <= 3 for r in rows_ref)
    assert any(r["sampling/prompts_drawn"] > 1 for r in rows_ref)  # refills were drawn

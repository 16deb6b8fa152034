"""The pipeline-parallel generator (generator.pp > 1) against the one-stage generator on the same weights: greedy
tokens and log-probs over mixed prompt lengths, stop tokens and max lengths, and seeded sampling, at TP1 x PP2 and
TP2 x PP2; multi-turn episodes at TP1 x PP2; every rank of the replica returns the same outputs."""

import pytest

from megatron_rl.inference import GenerationRequest, SamplingParams
from megatron_rl.launch.spawn import run_local
from conftest import make_tiny_llama
from episode_workers import pipeline_episodes_worker
from gen_workers import pipeline_worker

pytest.importorskip("transformers")

PROMPTS = [[5, 17, 42, 99], [7], [250, 3, 3, 3, 8, 61, 12, 4, 90], [1, 2], list(range(30, 52)), [64, 65, 66]]


@pytest.fixture(scope="module")
def tiny4():
    """A random 4-layer Llama (GQA, untied; 4 layers split into 2 stages) in Megatron names, fp32."""
    _, ours, weights = make_tiny_llama(num_layers=4, seed=1, name="tiny4-test")
    return ours, weights


def _greedy(max_new, stop=()):
    return SamplingParams(temperature=0, max_new_tokens=max_new, stop_token_ids=stop)


def _batches(stops):
    """Greedy requests of mixed prompt and output lengths (some stop early on a token), over 3 slots: lanes of one
    and two slots at PP2, slots reused; seeded sampling (top-p, top-k, n=2) over 4 slots; one slot for all."""
    greedy = [GenerationRequest(p, _greedy(3 + 2 * i, stops.get(i, ()))) for i, p in enumerate(PROMPTS)]
    greedy.append(GenerationRequest(list(range(1, 60)), _greedy(20)))  # ends at the context's end (64)
    sampled = [GenerationRequest(p, SamplingParams(temperature=0.9, top_p=0.95, top_k=40, max_new_tokens=6 + i,
                                                   seed=100 + i, n=2)) for i, p in enumerate(PROMPTS)]
    return [(greedy, 3), (sampled, 4), (greedy[:3], 1)]


def test_pipelined_generator_equals_one_stage(tiny4):
    cfg, full = tiny4
    # Stop tokens from the one-stage greedy outputs: requests 0 and 4 stop on their third token.
    probe = run_local(pipeline_worker, 1, cfg, full, 1, 1, _batches({})[:1])[0][1][0]
    stops = {i: (probe[i][0][2],) for i in (0, 4)}
    batches = _batches(stops)
    (_, want), = run_local(pipeline_worker, 1, cfg, full, 1, 1, batches)
    finishes = [f for _, _, f in want[0]]
    assert finishes.count("stop") >= 2 and "length" in finishes
    assert len({len(t) for t, _, _ in want[0]}) > 2 and len(want[0][-1][0]) == 5  # mixed lengths; context end
    assert want[1][0][0] != want[1][1][0]  # the two samples of a request differ
    for tp, pp in ((1, 2), (2, 2)):
        ranks = run_local(pipeline_worker, tp * pp, cfg, full, tp, pp, batches)
        assert sorted(r for r, _ in ranks) == sorted((t, p) for t in range(tp) for p in range(pp))
        for (tp_rank, pp_rank), got in ranks:
            for b, (g, w) in enumerate(zip(got, want)):
                where = (tp, pp, tp_rank, pp_rank, b)
                assert [t for t, _, _ in g] == [t for t, _, _ in w], where
                assert [f for _, _, f in g] == [f for _, _, f in w], where
                gap = max(abs(x - y) for (_, lg, _), (_, lw, _) in zip(g, w) for x, y in zip(lg, lw))
                assert gap < 1e-5, (where, gap)


def test_pipelined_episodes_equal_one_stage(tiny4):
    """Episodes against the scripted environment (`episode_workers.py`: 2, 3 or 4 turns by request, observations of
    1 to 3 ids) on a PP2 generator: greedy over 3 slots (lanes of one and two slots) and seeded sampling with stop
    tokens (n=2) over 4, more episodes than slots in both, some ending on their environment, some at max_turns, one
    on its token budget. Tokens, policy masks, turns and finish reasons equal the one-stage generator's (so every
    observation was prefilled at its own positions, and each sampling stream went on across turns), log-probs to
    rounding, and no `start` is left without its `finish`."""
    cfg, full = tiny4
    greedy = [GenerationRequest(p, _greedy(10 if i == 4 else 3 + i % 3)) for i, p in enumerate(PROMPTS)]
    stops = tuple(range(0, 300, 12))
    sampled = [GenerationRequest(p, SamplingParams(temperature=1.0, max_new_tokens=5, stop_token_ids=stops,
                                                   seed=40 + i, n=2)) for i, p in enumerate(PROMPTS)]
    batches = [(greedy, 3), (sampled, 4)]
    (_, want), = run_local(pipeline_episodes_worker, 1, cfg, full, 1, batches, 3, 16)
    finishes = [e[3] for episodes, _ in want for e in episodes]
    assert {"done", "turns", "length"} <= set(finishes) and finishes.count("length") >= 1
    assert {e[4] for episodes, _ in want for e in episodes} == {2, 3}
    assert all(False in e[2] for episodes, _ in want for e in episodes)  # observations in every episode
    ranks = run_local(pipeline_episodes_worker, 2, cfg, full, 2, batches, 3, 16)
    assert sorted(r for r, _ in ranks) == [0, 1]
    for pp_rank, got in ranks:
        for b, ((g, left), (w, _)) in enumerate(zip(got, want)):
            assert not left, (pp_rank, b)
            assert [(t, m, f, n) for t, _, m, f, n in g] == [(t, m, f, n) for t, _, m, f, n in w], (pp_rank, b)
            gap = max(abs(x - y) for e, f in zip(g, w) for x, y in zip(e[1], f[1]))
            assert gap < 1e-5, (pp_rank, b, gap)


def test_job_with_a_pp2_generator_runs_and_resumes(tmp_path):
    """`megatron-rl train generator.pp=2` for 4 steps, then relaunched for 6 (it resumes at step 4): every step's
    metrics equal those of one 6-step launch with a one-stage generator (DDMA pushes into both stages). Sync mode,
    where a run extended at a checkpoint continues exactly as an uninterrupted one (in async mode the batch after
    the checkpoint would be generated with newer weights)."""
    import json

    import warm_cli

    base = ["train", "trainer.sft_warmup_steps=10", "trainer.tp=1",
            "rollout.mode=sync", "rollout.prompts_per_step=4", "data.eval_size=4", "run.eval_interval=3", "rollout.max_new_tokens=8",
            "checkpoint.save_interval=2", f"checkpoint.dir={tmp_path}"]

    def launch(*args):
        out = warm_cli.run(base + list(args))
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def rows(name):
        skip = ("time/", "tokens_per_s", "warm_start_s", "generator/")  # (a pipelined generator has no occupancy)
        return [{k: v for k, v in json.loads(x).items() if not k.startswith(skip)}
                for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    assert launch("generator.pp=2", "run.steps=4", "run.name=pp2")["resumed_from_step"] == 0
    assert launch("generator.pp=2", "run.steps=6", "run.name=pp2")["resumed_from_step"] == 4
    assert launch("generator.pp=1", "run.steps=6", "run.name=pp1")["resumed_from_step"] == 0
    got, want = rows("pp2"), rows("pp1")
    assert [r["step"] for r in got] == list(range(6)) and "eval/reward" in got[3]
    # The trainer-generator log-prob gaps measure rounding, which the generator's layout moves by ~1e-7 in fp32
    # (this machine's "auto" without native bf16); every other field is equal.
    rounding = ("logp_diff_mean", "logp_diff_max", "kl_mu_pi", "is_weight_max", "is_weight_mean")
    for g, w in zip(got, want):
        assert {k: v for k, v in g.items() if k not in rounding} == {k: v for k, v in w.items() if k not in rounding}
        for k in rounding:
            assert g[k] == pytest.approx(w[k], abs=1e-6), (g["step"], k)

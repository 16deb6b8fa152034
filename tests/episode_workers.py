"""Worker functions for the multi-turn generation tests: a scripted environment over token ids (no text), the same
on every rank, and a reference that plays each episode turn by turn with fresh single-turn requests."""

from __future__ import annotations

from typing import Optional

from megatron_rl.inference import GenerationRequest, Generator, SamplingParams
from megatron_rl.inference.engine import Engine
from megatron_rl.inference.episodes import EndedTurn, Turns
from gen_workers import _setup


def observation(request: int, sample: int, turn: int, reply: tuple) -> Optional[list[int]]:
    """The scripted environment: episode (request, sample) ends after 2 + request % 3 turns; until then it answers
    with 1 to 3 ids that depend on the reply (so an episode's course depends on what the model said)."""
    if turn >= 2 + request % 3:
        return None
    return [(sum(reply) + 7 * turn + request) % 200 + 3, 250 - turn, 11][: 1 + (request + turn) % 3]


class ScriptedTurns(Turns):
    """`started`: the outstanding starts, oldest first (up to `answer_steps` of them); `log`: every start's turns."""

    def __init__(self, max_turns: int, max_tokens: int, answer_steps: int = 1):
        self.max_turns, self.max_tokens, self.answer_steps = max_turns, max_tokens, answer_steps
        self.turns: dict = {}
        self.started: list[list[EndedTurn]] = []
        self.log: list[list[EndedTurn]] = []

    def start(self, ended: list[EndedTurn]) -> None:
        assert len(self.started) < self.answer_steps, "more starts outstanding than answer_steps"
        self.started.append(list(ended))
        self.log.append(list(ended))

    def finish(self) -> list[Optional[list[int]]]:
        out = []
        for e in self.started.pop(0):
            t = self.turns[(e.request, e.sample)] = self.turns.get((e.request, e.sample), 0) + 1
            out.append(observation(e.request, e.sample, t, e.reply))
        return out


class JoinedTurns(ScriptedTurns):
    """A live engine's `Turns` over several batches' `ScriptedTurns` (`Turns.empty`/`join`): each turn answered as
    its own batch would answer it, the episode's turn count kept in that batch's turns."""

    def __init__(self, max_turns: int, max_tokens: int, answer_steps: int = 1):
        super().__init__(max_turns, max_tokens, answer_steps)
        self.of: dict = {}  # the live engine's request -> (its batch's turns, its request there)

    def join(self, batch: ScriptedTurns, requests: list) -> None:
        self.of.update({r: (batch, k) for k, r in enumerate(requests) if r is not None})

    def finish(self) -> list[Optional[list[int]]]:
        out = []
        for e in self.started.pop(0):
            batch, k = self.of[e.request]
            t = batch.turns[(k, e.sample)] = batch.turns.get((k, e.sample), 0) + 1
            out.append(observation(k, e.sample, t, e.reply))
        return out


ScriptedTurns.empty = lambda self: JoinedTurns(self.max_turns, self.max_tokens, self.answer_steps)


def live_episodes_worker(rank, world_size, cfg, full, tp, lookahead, a_new, b_new, answer_steps=1):
    """Two batches of scripted episodes in the live engine (`inference/live.py`): batch A run while batch B plays
    beside it, then new weights (`live_weights`) switched in with B's episodes mid-flight (their caches recomputed),
    then B run; again with the state snapshotted after A (B's environments' answers outstanding) and restored into a
    fresh generator. `a_new`, `b_new`: each request's tokens a turn (B's of 1 or 2, so that some of them end at
    the step at which A's last episode ends: the snapshot then holds answers not yet taken). Returns the outputs, batch A played batch
    by batch (`Generator.generate`, the reference), the outstanding answers at the snapshot, and each output re-scored
    teacher-forced under each version's weights."""
    import copy

    from megatron_rl.inference.live import LiveGeneration
    from megatron_rl.models.sharding import load_full_state_dict
    from gen_workers import live_weights, scored_by_version

    batch_a = [GenerationRequest(list(range(3 + i, 9 + i)), SamplingParams(temperature=1.0, max_new_tokens=new,
                                                                            seed=i)) for i, new in enumerate(a_new)]
    batch_b = [GenerationRequest(list(range(20 + i, 25 + i)), SamplingParams(temperature=1.0, max_new_tokens=new,
                                                                              seed=10 + i)) for i, new in enumerate(b_new)]
    as_tuples = lambda xs: [(o.token_ids, o.logprobs, o.policy_mask, o.versions, o.finish_reason, o.turns)  # noqa
                            for o in xs]

    def fresh():
        g, model = _setup(cfg, full, tp)
        gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=4, max_len=64, lookahead=lookahead)
        return g, model, LiveGeneration(gen, 64, filtering=False, noise=True, version=0)

    g, model = _setup(cfg, full, tp)
    reference = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=4, max_len=64).generate(
        batch_a, turns=ScriptedTurns(4, 30, answer_steps))

    def play(restore: bool):
        g, model, live = fresh()
        ta, tb = ScriptedTurns(4, 30, answer_steps), ScriptedTurns(4, 30, answer_steps)
        a, b = live.add(batch_a, ta), live.add(batch_b, tb)
        out_a = live.run(a)
        outstanding = sum(len(seqs) for _, seqs in live.episodes.answering)
        if restore:
            state, counts = live.snapshot({"b": b}), copy.deepcopy(tb.turns)  # what a checkpoint holds
            g, model, live = fresh()
            b = live.restore(state)["b"]
            tb = ScriptedTurns(4, 30, answer_steps)
            tb.turns = counts
            live.rejoin(b, tb)
        load_full_state_dict(model, live_weights(full), cfg, g.pgs)
        live.switch(1, recompute=True)
        return out_a + live.run(b), outstanding, (g, model), live.gen.lookahead

    outs, outstanding, (g, model), used_lookahead = play(False)
    restored, _, _, _ = play(True)
    scored = scored_by_version(model, cfg, g, full, outs)
    return {"outs": as_tuples(outs), "restored": as_tuples(restored), "reference": as_tuples(reference),
            "outstanding": outstanding, "scored": scored, "lookahead": used_lookahead}


def episodes_worker(rank, world_size, cfg, full, tp, requests, max_batch, max_turns, max_tokens, lookahead=None,
                    count_prefill=False, kv_cache_tokens=None, answer_steps=1):
    """Episodes from one `generate` call: (tokens, logprobs, policy mask, finish reason, turns) each; and, with
    `count_prefill`, the positions each prefill call filled (with `kv_cache_tokens`, a paged cache)."""
    g, model = _setup(cfg, full, tp)
    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=max_batch, max_len=128, lookahead=lookahead,
                    kv_cache_tokens=kv_cache_tokens)
    filled = []
    prefill = Engine.prefill
    if count_prefill:  # the positions each prefill fills, per admitted sequence: [cached, last token)
        def counting(engine, admitted):
            filled.append([(s.req, s.cached, len(s.history) - 1) for s in admitted])
            return prefill(engine, admitted)

        Engine.prefill = counting
    turns = ScriptedTurns(max_turns, max_tokens, answer_steps)
    try:
        outs = gen.generate(requests, turns=turns)
    finally:
        Engine.prefill = prefill
    return [(o.token_ids, o.logprobs, o.policy_mask, o.finish_reason, o.turns) for o in outs], filled


def pipeline_episodes_worker(rank, world_size, cfg, full, pp, batches, max_turns, max_tokens):
    """Each (requests, max_batch) played as episodes against the scripted environment by one replica of `pp` stages
    (TP1, fp32): this rank's pp rank, and per batch the episodes (tokens, logprobs, policy mask, finish reason, turns)
    and whether a `start` was left without its `finish`."""
    from megatron_rl.models import build_gpt_model
    from megatron_rl.models.sharding import load_full_state_dict
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology

    g = build_topology([ExecutorPlacement("generator", ParallelLayout(pp=pp))])["generator"]
    model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa")
    load_full_state_dict(model, full, cfg, g.pgs)
    out = []
    for requests, max_batch in batches:
        gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=max_batch, max_len=64, pp_group=g.pgs.pp)
        turns = ScriptedTurns(max_turns, max_tokens)
        outs = gen.generate(requests, turns=turns)
        out.append(([(o.token_ids, o.logprobs, o.policy_mask, o.finish_reason, o.turns) for o in outs],
                    bool(turns.started)))
    return g.pp_rank, out


def reference_worker(rank, world_size, cfg, full, tp, requests, max_turns, max_tokens):
    """Each greedy episode played turn by turn: the whole history sent again as a fresh prompt every turn (no cache
    kept between turns), the scripted environment's ids appended."""
    g, model = _setup(cfg, full, tp)
    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=4, max_len=128)
    out = []
    for i, r in enumerate(requests):
        history, tokens, logprobs, mask, finish = list(r.prompt_ids), [], [], [], None
        for turn in range(1, max_turns + 1):
            budget = min(r.params.max_new_tokens, max_tokens - len(tokens))
            params = SamplingParams(temperature=0, max_new_tokens=budget, stop_token_ids=r.params.stop_token_ids)
            reply = gen.generate([GenerationRequest(history, params)])[0]
            tokens += reply.token_ids
            logprobs += reply.logprobs
            mask += [True] * len(reply.token_ids)
            history += reply.token_ids
            obs = observation(i, 0, turn, tuple(reply.token_ids))
            if obs is None:
                finish = "done"
                break
            if turn == max_turns:
                finish = "turns"
                break
            if len(tokens) + len(obs) + 1 > max_tokens:
                finish = "length"
                break
            tokens += obs
            logprobs += [0.0] * len(obs)
            mask += [False] * len(obs)
            history += obs
        out.append((tokens, logprobs, mask, finish, turn))
    return out



def failing_environments_worker(rank, world_size, cfg, full):
    """Episodes of `env_cases:Misbehaves` whose environment fails to start (its constructor, its reset) beside one
    that behaves, through the job's own `Episodes` (byte tokenizer, plain turns): each output, the returns and the
    statistics, and whether the batch packs for the trainer."""
    from megatron_rl.controller.collector import pack
    from megatron_rl.environments.play import Episodes
    from megatron_rl.controller.scoring import ScoredRollouts
    from megatron_rl.data import PromptRecord
    from megatron_rl.environments.settings import EnvSettings
    from megatron_rl.tokenizers.byte import ByteTokenizer

    g, model = _setup(cfg, full, 1)
    tok = ByteTokenizer()
    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=4, max_len=128)
    env = EnvSettings(cls="env_cases:Misbehaves", max_turns=2, max_tokens=40, timeout_s=5.0, num_workers=1)
    episodes = Episodes(env, tok, chat=False, replica_group=g.pgs.mp, is_leader=True,
                        sampling=SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=(tok.eos_id,)))
    try:
        records = [PromptRecord("ok", "count:", metadata={"turns": 2}),
                   PromptRecord("reset", "count:", metadata={"reset": "raise"}),
                   PromptRecord("init", "count:", metadata={"init": "raise"})]
        reqs, turns = episodes.requests(records, [11, 12, 13], 1)
        outs = gen.generate(reqs, turns=turns)
        returns, stats = turns.returns(), turns.statistics(outs)
    finally:
        episodes.close()
    part = ScoredRollouts(0, 0, [o.prompt_ids for o in outs], [o.token_ids for o in outs], [o.logprobs for o in outs],
                          returns, [0, 1, 2], [], 0.0, 0.0, 0.0,
                          policy_masks=[o.policy_mask for o in outs])
    batch = pack([part], pad_id=0)
    return ([(o.finish_reason, len(o.token_ids), o.turns) for o in outs], returns, stats,
            batch.response_mask().sum(1).tolist())

"""Worker functions for the generator's tests."""

from __future__ import annotations

import torch

from megatron_rl.inference import GenerationRequest, Generator, SamplingParams
from megatron_rl.models import build_gpt_model
from megatron_rl.models.sharding import load_full_state_dict
from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
from megatron_rl.training.engine import model_forward
from megatron_rl.training.logprobs import target_logprobs


def _setup(cfg, full, tp):
    g = build_topology([ExecutorPlacement("generator", ParallelLayout(tp=tp))])["generator"]
    model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa")
    load_full_state_dict(model, full, cfg, g.pgs)
    return g, model


def generate_worker(rank, world_size, cfg, full, tp, requests, max_batch, lookahead=None):
    g, model = _setup(cfg, full, tp)
    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=max_batch, max_len=64, lookahead=lookahead)
    return [(o.token_ids, o.logprobs, o.finish_reason, o.error) for o in gen.generate(requests)]


def lookahead_worker(rank, world_size, cfg, full, tp, batches):
    """Each (requests, max_batch) decoded reading each step's tokens at once, then one step late (lookahead)."""
    g, model = _setup(cfg, full, tp)
    out = []
    for requests, max_batch in batches:
        pair = []
        for lookahead in (False, True):
            gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=max_batch, max_len=64,
                            lookahead=lookahead)
            pair.append([(o.token_ids, o.logprobs, o.finish_reason) for o in gen.generate(requests)])
        out.append(pair)
    return out


def paged_worker(rank, world_size, cfg, full, tp, requests, runs):
    """The same requests through a slot cache and through paged caches: each run (slots, tokens or None) gives the
    outputs and the generator's paging statistics."""
    g, model = _setup(cfg, full, tp)
    out = []
    for slots, tokens in runs:
        gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=slots, max_len=64, kv_cache_tokens=tokens)
        outputs = gen.generate(requests)
        out.append(([(o.token_ids, o.logprobs, o.finish_reason) for o in outputs],
                    {k: v for k, v in gen.stats.items() if k in ("kv_blocks_peak", "kv_blocks", "preempted")}))
    return out


def parity_worker(rank, world_size, cfg, full, tp):
    """Sample, then score the samples with the trainer's forward: behaviour log-probs must agree."""
    g, model = _setup(cfg, full, tp)
    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=3, max_len=64)
    reqs = [GenerationRequest(list(range(5 + i, 12 + 2 * i)), SamplingParams(temperature=0.7, max_new_tokens=10,
                                                                             seed=i, n=2)) for i in range(3)]
    outs = gen.generate(reqs)
    diffs = []
    for o in outs:
        seq = torch.tensor([o.prompt_ids + o.token_ids])
        with torch.no_grad():
            logits = model_forward(model, seq, False)
            lp = target_logprobs(logits, seq, g.pgs.tp, cfg.vocab_size, 0.7)[0, len(o.prompt_ids):]
        diffs.append((lp - torch.tensor(o.logprobs)).abs().max().item())
    return diffs


def int8_generate_worker(rank, world_size, cfg, full, tp, requests, how="quantize"):
    """Greedy generation with int8 weights quantized from `full`; also the weight bytes before and after.

    how="quantize": load `full` into a model, then quantize it in place. how="build": build the int8 generator
    directly (its matrices never exist in full precision) and fill it the way a sync would: int8 weights from the
    quantized shards, the other parameters copied."""
    from megatron_rl.ddma.quant import quantize_int8
    from megatron_rl.inference.quantized import build_int8_generator, quantize_generator, weight_bytes

    g, model = _setup(cfg, full, tp)
    before = weight_bytes(model)
    if how == "quantize":
        targets = quantize_generator(model, cfg, g.layout, g.pgs.pp.rank(), g.pgs.tp.rank())
    else:
        reference = dict(model.named_parameters())
        model, targets = build_int8_generator(cfg, g.layout, g.pgs, attention="sdpa")
        assert not any(p.is_meta for p in model.parameters())
        with torch.no_grad():
            for name, p in model.named_parameters():
                assert not p.any(), name  # built at zero: the sync writes every weight
                p.copy_(reference[name])
            for name, w8 in targets.items():
                q = quantize_int8(reference[name])
                w8.qweight.copy_(q.qweight)
                w8.scale.copy_(q.scale)
    after = weight_bytes(model, targets)
    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=4, max_len=64)
    outs = gen.generate(requests)
    return [(o.token_ids, o.logprobs) for o in outs], before, after, sorted(targets)


def _e4m3_round_trip(w: torch.Tensor) -> torch.Tensor:
    """Per-row e4m3: scale = max |row| / 448 (1 for a zero row), w ~ e4m3(w / scale) * scale, in float32."""
    w = w.to(torch.float32)
    scale = w.abs().amax(dim=1, keepdim=True) / 448
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32) * scale


def fp8_push_worker(rank, world_size, cfg, full, trainer_tp, gen_tp, requests, dtype=torch.float32):
    """A TP`trainer_tp` trainer (ranks 0..) pushes into an fp8 generator at TP`gen_tp` (the next ranks) by DDMA,
    twice (different weights first: the second push must overwrite everything in place).

    Generator ranks return: the parameters whose dequantized fp8 weights differ from `_e4m3_round_trip` of the same
    local shard of a dense generator loaded directly, the other parameters that differ from it, whether the codes
    stayed in the same storage, the weight bytes (dense, fp8), and greedy outputs (tokens, log-probs) of three
    models at that layout: the fp8 generator, the dense one holding the e4m3 round trips, and the dense one with
    the weights themselves, plus the log-probs the full-precision model gives the fp8 generator's tokens."""
    from megatron_rl.ddma.sync import WeightSync
    from megatron_rl.ddma.transport import TransportSettings
    from megatron_rl.inference.quantized import build_quantized_generator, weight_bytes

    topo = build_topology([ExecutorPlacement("trainer", ParallelLayout(tp=trainer_tp), 0),
                           ExecutorPlacement("generator", ParallelLayout(tp=gen_tp), trainer_tp)])
    t, g = topo["trainer"], topo["generator"]
    trainer = build_gpt_model(cfg, t.layout, t.pgs, attention="sdpa", params_dtype=dtype) if t.is_member else None
    model = targets = None
    if g.is_member:
        model, targets = build_quantized_generator("fp8", cfg, g.layout, g.pgs, attention="sdpa", params_dtype=dtype)
    sync = WeightSync(cfg, t, g, settings=TransportSettings(quantize="fp8", bucket_bytes=16 << 10))
    storage = None
    for step, weights in ((1, {k: v.flip(-1) for k, v in full.items()}), (2, full)):
        if trainer is not None:
            load_full_state_dict(trainer, weights, cfg, t.pgs)
        sync.sync(trainer, None if model is None else {**dict(model.named_parameters()), **targets},
                  step=step if t.is_member else None)
        if targets is not None and storage is None:
            storage = {n: w.qweight.data_ptr() for n, w in targets.items()}
    if model is None:
        return None
    dense = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", params_dtype=dtype)
    load_full_state_dict(dense, full, cfg, g.pgs)
    want = dict(dense.named_parameters())
    rounded = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", params_dtype=dtype)
    load_full_state_dict(rounded, full, cfg, g.pgs)
    fp8_bad, other_bad = [], []
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if name in targets:
                ref = _e4m3_round_trip(want[name])
                if not torch.equal(targets[name].dequantize(), ref):
                    fp8_bad.append(name)
                p.copy_(ref)
        for name, p in model.named_parameters():
            if not torch.equal(p, want[name]):
                other_bad.append(name)
    in_place = storage == {n: w.qweight.data_ptr() for n, w in targets.items()}
    outputs = {}
    for key, m in (("fp8", model), ("rounded", rounded), ("dense", dense)):
        gen = Generator(m, cfg.vocab_size, g.pgs.tp, max_batch_size=4, max_len=64)
        outputs[key] = [(o.token_ids, o.logprobs) for o in gen.generate(requests)]
    scored = []  # the full-precision model's log-probs of the fp8 generator's tokens (teacher-forced)
    for req, (tokens, _) in zip(requests, outputs["fp8"]):
        seq = torch.tensor([req.prompt_ids + tokens])
        with torch.no_grad():
            logits = model_forward(dense, seq, False)
            lp = target_logprobs(logits, seq, g.pgs.tp, cfg.vocab_size, 1.0)[0, len(req.prompt_ids):]
        scored.append(lp.tolist())
    return {"fp8_bad": fp8_bad, "other_bad": other_bad, "in_place": in_place, "names": sorted(targets),
            "bytes": (weight_bytes(dense), weight_bytes(model, targets)),
            "codes": {str(w.qweight.dtype) for w in targets.values()}, "outputs": outputs, "scored": scored}


def pipeline_worker(rank, world_size, cfg, full, tp, pp, batches):
    """Each (requests, max_batch) generated by one replica of tp x pp ranks (fp32); what this rank returns, with its
    (tp rank, pp rank)."""
    g = build_topology([ExecutorPlacement("generator", ParallelLayout(tp=tp, pp=pp))])["generator"]
    model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa")
    load_full_state_dict(model, full, cfg, g.pgs)
    out = []
    for requests, max_batch in batches:
        gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=max_batch, max_len=64, pp_group=g.pgs.pp)
        out.append([(o.token_ids, o.logprobs, o.finish_reason) for o in gen.generate(requests)])
    return (g.tp_rank, g.pp_rank), out


def live_worker(rank, world_size, cfg, full, tp, kv_cache_tokens=None, cuda_rules_on=False, recompute=True):
    """The live engine (`inference/live.py`) over two batches: batch A run, then new weights switched in while batch
    B's sequences (queued beside A) are mid-flight, then B run; again with the state snapshotted after A and restored
    into a fresh generator. Returns the outputs, each output's log-probs re-scored teacher-forced under the weights of
    each version (0: `full`, 1: `live_weights(full)`), and an abort's effect on the slots and blocks. The switch
    recomputes the running sequences' caches, or with `recompute=False` keeps them: each output's log-probs are then
    also scored by `kept_cache_logprobs`. (The restore's own first switch always recomputes: its caches are empty.) With
    `cuda_rules_on`, under CUDA's rules (`compat/cuda_rules.py`): pinned non-blocking copies, the decode step captured,
    each step launched before the last is read (lookahead), which a switch and the end of a run read first. Last,
    where sequences queued `ahead` wait (their places in `waiting`)."""
    import os

    from megatron_rl.compat import cuda_rules
    from megatron_rl.inference.live import LiveGeneration

    if cuda_rules_on:
        os.environ[cuda_rules.ENV] = "1"
        cuda_rules.install_nccl_rules()

    spread = lambda i, new: GenerationRequest(list(range(3 + i, 8 + i)), SamplingParams(  # noqa: E731
        temperature=1.0, top_p=0.95, max_new_tokens=new, seed=i))
    batch_a = [spread(i, 4 + 8 * (i % 3)) for i in range(5)]
    batch_b = [spread(10 + i, 20 + 4 * i) for i in range(4)]

    def play(restore_after_a: bool):
        g, model = _setup(cfg, full, tp)
        gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=4, max_len=64, kv_cache_tokens=kv_cache_tokens)
        live = LiveGeneration(gen, 64, filtering=True, noise=True, version=0)
        a, b = live.add(batch_a), live.add(batch_b)
        out_a = live.run(a)
        occupancy = gen.stats["occupancy"]
        if restore_after_a:
            state = live.snapshot({"b": b})
            g, model = _setup(cfg, full, tp)
            gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=4, max_len=64,
                            kv_cache_tokens=kv_cache_tokens)
            live = LiveGeneration(gen, 64, filtering=True, noise=True, version=0)
            b = live.restore(state)["b"]
        load_full_state_dict(model, live_weights(full), cfg, g.pgs)
        live.switch(1, recompute or restore_after_a)
        return out_a + live.run(b), occupancy, (g, model)

    outs, occupancy, (g, model) = play(False)
    restored, _, _ = play(True)
    scored = scored_by_version(model, cfg, g, full, outs)
    kept = [kept_cache_logprobs(model, cfg, g, full, o) for o in outs] if not recompute else None
    # An abort: a running sequence's slot and blocks are free at once.
    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=4, max_len=64, kv_cache_tokens=kv_cache_tokens)
    live = LiveGeneration(gen, 64, filtering=True, noise=True, version=0)
    handles = live.add(batch_b)
    with gen.decoding(live.cache):
        live.engine.step()
        victim = live.engine.running[0]
        blocks = len(live.engine.pool.held[0]) if live.engine.pool is not None else 0
        free_before = (len(live.engine.free), len(live.engine.pool.free) if live.engine.pool is not None else 0)
        live.engine.abort(victim)
        free_after = (len(live.engine.free), len(live.engine.pool.free) if live.engine.pool is not None else 0)
    rest = live.run([h for h in handles if h is not victim])
    # Queued ahead (a batch's refills, `add(..., ahead=True)`): before every waiting sequence, in their own order.
    waiting = live.add(batch_a)
    refills = live.add(batch_b[:2], ahead=True)
    ahead = [live.engine.waiting.index(s) for s in refills + waiting]
    as_tuples = lambda xs: [(o.token_ids, o.logprobs, o.versions, o.finish_reason) for o in xs]  # noqa: E731
    return {"outs": as_tuples(outs), "restored": as_tuples(restored), "scored": scored, "occupancy": occupancy,
            "lookahead": gen.lookahead, "kept": kept, "ahead": ahead,
            "abort": (victim.finish, blocks, free_before, free_after), "rest": [o.finish_reason for o in rest]}


def scored_by_version(model, cfg, g, full, outs) -> dict:
    """version -> each output's tokens' log-probs (temperature 1), teacher-forced under that version's weights (0:
    `full`, 1: `live_weights(full)`); the model is left with version 1's."""
    scored = {}
    for version, weights in ((0, full), (1, live_weights(full))):
        load_full_state_dict(model, weights, cfg, g.pgs)
        scored[version] = []
        for o in outs:
            seq = torch.tensor([o.prompt_ids + o.token_ids])
            with torch.no_grad():
                lp = target_logprobs(model_forward(model, seq, False), seq, g.pgs.tp, cfg.vocab_size, 1.0)
            scored[version].append(lp[0, len(o.prompt_ids):].tolist())
    return scored


def live_weights(full: dict) -> dict:
    """Version 1 of the live-engine test: every matrix scaled by 0.8 (a different policy, as confident)."""
    return {k: v * 0.8 if v.dim() == 2 else v for k, v in full.items()}


def kept_cache_logprobs(model, cfg, g, full, out) -> list[float]:
    """The log-probs (temperature 1) of `out`'s tokens as a kept cache makes them: every position fed before the
    switch cached by version 0's weights, and the rest fed under version 1's, attending to that cache; one chunk
    each, on a cache of its own (`IncrementalForward`)."""
    from megatron_rl.inference.kv_forward import IncrementalForward

    history = out.prompt_ids + out.token_ids
    # Positions fed under version 0: none for a sequence admitted after the switch (a prefill and the first decode
    # run in one step), else the prompt and the version-0 tokens but the last.
    sampled_before = sum(v == 0 for v in out.versions)
    before = len(out.prompt_ids) + sampled_before - 1 if sampled_before else 0
    fwd = IncrementalForward(model, g.pgs.tp, False)
    cache = fwd.allocate_cache(1, 64)
    fwd.prepare(64)
    chunks = []
    with torch.no_grad():
        for weights, lo, hi in ((full, 0, before), (live_weights(full), before, len(history) - 1)):
            load_full_state_dict(model, weights, cfg, g.pgs)
            if hi > lo:
                logits = fwd(torch.tensor([history[lo:hi]]), torch.arange(lo, hi)[None], torch.tensor([0]), cache,
                             kv_len=hi)
                chunks.append(torch.log_softmax(logits[0, :, : cfg.vocab_size].float(), -1))
    lp = torch.cat(chunks)  # row j predicts history[j + 1]
    targets = torch.tensor(history[1:])
    return lp.gather(1, targets[:, None])[:, 0][len(out.prompt_ids) - 1:].tolist()

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

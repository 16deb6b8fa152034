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


def generate_worker(rank, world_size, cfg, full, tp, requests, max_batch):
    g, model = _setup(cfg, full, tp)
    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=max_batch, max_len=64)
    return [(o.token_ids, o.logprobs, o.finish_reason, o.error) for o in gen.generate(requests)]


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

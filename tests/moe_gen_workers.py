"""Worker functions for the mixture-of-experts generator's tests (tests/test_moe_generator.py)."""

from __future__ import annotations

import os

import torch

from megatron_rl.inference import GenerationRequest, Generator, SamplingParams
from megatron_rl.models import build_gpt_model
from megatron_rl.models.sharding import load_full_state_dict
from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
from megatron_rl.training.engine import model_forward
from megatron_rl.training.logprobs import target_logprobs

PROMPTS = [[5, 17, 42, 99], [7], [250, 3, 3, 3, 8, 61, 12, 4, 90], [1, 2]]
TEMPERATURE = 0.8


def requests() -> list[GenerationRequest]:
    """Each prompt greedy, then sampled (two samples each, seeded) at TEMPERATURE."""
    greedy = [GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=10)) for p in PROMPTS]
    return greedy + [GenerationRequest(p, SamplingParams(temperature=TEMPERATURE, max_new_tokens=10, seed=i, n=2))
                     for i, p in enumerate(PROMPTS)]


def _model(cfg, full, layout):
    g = build_topology([ExecutorPlacement("generator", layout)])["generator"]
    model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa")
    load_full_state_dict(model, full, cfg, g.pgs)
    return g, model


def _lp_gap(model, g, cfg, outputs) -> float:
    """The largest gap between the log-probs the generator recorded and the trainer's teacher-forced forward of the
    same sequences (at each output's temperature: 1 for greedy): one right-padded forward per temperature (causal
    attention and per-token routing: the padding changes no real position)."""
    temps = [r.params.temperature or 1.0 for r in requests() for _ in range(max(r.params.n, 1))]
    gap = 0.0
    for t in sorted(set(temps)):
        mine = [o for o, ot in zip(outputs, temps) if ot == t]
        seqs = [o.prompt_ids + o.token_ids for o in mine]
        batch = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
        for i, seq in enumerate(seqs):
            batch[i, :len(seq)] = torch.tensor(seq)
        with torch.no_grad():
            lp = target_logprobs(model_forward(model, batch, False), batch, g.pgs.tp, cfg.vocab_size, t)
        for i, o in enumerate(mine):
            p, n = len(o.prompt_ids), len(o.token_ids)
            gap = max(gap, (lp[i, p:p + n] - torch.tensor(o.logprobs)).abs().max().item())
    return gap


def generate_worker(rank, world_size, cases, layout_kw, runs):
    """For each (cfg, full weights) at `layout_kw`: per run (max_batch, kv_cache_tokens or None) the outputs of
    `requests()` (tokens, log-probs) and their largest log-prob gap against the teacher-forced forward."""
    out = []
    for cfg, full in cases:
        g, model = _model(cfg, full, ParallelLayout(**layout_kw))
        per_run = []
        for max_batch, kv_tokens in runs:
            gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=max_batch, max_len=64,
                            kv_cache_tokens=kv_tokens)
            outputs = gen.generate(requests())
            per_run.append(([(o.token_ids, o.logprobs) for o in outputs], _lp_gap(model, g, cfg, outputs)))
        out.append(per_run)
    return out


def quantized_worker(rank, world_size, cfg, full, layout_kw, formats):
    """Per 8-bit format: a generator built without its full-precision matrices and filled as a sync fills it (the
    8-bit weights quantized from this rank's shards of `full`, the rest copied), and a full-precision generator
    holding the same weights dequantized. Returns, per format: (the 8-bit generator's outputs, the full-precision
    one's, the quantized names, {expert weight name: (dequantized, the full-precision local shard)})."""
    from megatron_rl.ddma.quant import quantize
    from megatron_rl.inference.quantized import build_quantized_generator

    g, _ = _model(cfg, full, ParallelLayout(**layout_kw))
    out = []
    for fmt in formats:
        _, model = _model(cfg, full, ParallelLayout(**layout_kw))
        params = dict(model.named_parameters())
        shards = {n: p.detach().clone() for n, p in params.items()}
        model8, targets = build_quantized_generator(fmt, cfg, g.layout, g.pgs, attention="sdpa")
        with torch.no_grad():
            for name, p in model8.named_parameters():
                p.copy_(shards[name])
            for name, w8 in targets.items():
                q = quantize(shards[name], fmt)
                w8.qweight.copy_(q.qweight)
                w8.scale.copy_(q.scale)
                params[name].copy_(w8.dequantize(params[name].dtype))
        outputs = [[(o.token_ids, o.logprobs) for o in Generator(m, cfg.vocab_size, g.pgs.tp, max_batch_size=3,
                                                                   max_len=64).generate(requests())]
                   for m in (model8, model)]
        experts = {n: (w8.dequantize(torch.float32), shards[n]) for n, w8 in targets.items() if ".local_experts." in n}
        out.append((*outputs, sorted(targets), experts))
    return out


def pipeline_worker(rank, world_size, cfg, full, pp):
    """The greedy and sampled outputs of one replica of `pp` stages (tokens, log-probs)."""
    g, model = _model(cfg, full, ParallelLayout(pp=pp))
    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=3, max_len=64, pp_group=g.pgs.pp)
    return [(o.token_ids, o.logprobs) for o in gen.generate(requests())]


def cuda_rules_worker(rank, world_size, cfg, full, layout_kw):
    """With the CUDA-rules mode on, then off: the outputs (tokens, log-probs, recorded routes: their pinned,
    non-blocking copies to the host run under CUDA's rules), whether the generator captured its decode step, its
    lookahead, and whether `cuda_graphs=True` was refused; with it on, also what the capture check says of one MoE
    layer's forward (the reason there is no graph)."""
    from megatron_rl.compat import cuda_rules

    os.environ[cuda_rules.ENV] = "1"
    cuda_rules.install_nccl_rules()
    out = {}
    for mode in ("1", "0"):
        os.environ[cuda_rules.ENV] = mode
        g, model = _model(cfg, full, ParallelLayout(**layout_kw))
        gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=3, max_len=64, record_routes=True)
        outputs = gen.generate(requests())
        try:
            Generator(model, cfg.vocab_size, g.pgs.tp, cuda_graphs=True)
            refused = None
        except ValueError as e:
            refused = str(e)
        out[mode] = {"outputs": [(o.token_ids, o.logprobs) for o in outputs], "graph": gen.stats["cuda_graph"],
                     "routes": [o.routes for o in outputs],
                     "lookahead": gen.lookahead, "refused": refused}
        if mode == "1":
            try:
                with torch.no_grad(), cuda_rules.CaptureChecker("an MoE layer"):
                    model.decoder.layers[0].mlp(torch.randn(1, 3, cfg.hidden_size))
                out["capture"] = None
            except cuda_rules.CaptureError as e:
                out["capture"] = str(e)
    os.environ[cuda_rules.ENV] = "1"
    return out

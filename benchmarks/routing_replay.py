"""Routing replay (R3): the trainer-generator log-prob gap of a mixture-of-experts model with and without replaying
the generator's routes.

    python benchmarks/routing_replay.py      # a tiny random Qwen3-MoE (4 layers, 32 experts, top-4), CPU

The generator samples in bf16 (recording each token's experts per layer, `Generator(record_routes=True)`); the
trainer's forward of the same sequences runs in fp32 from the same weights, routing by itself and replaying the
generator's routes (`models.moe.replaying`). Reports the share of response tokens whose experts differ in some
layer, and the mean and largest |trainer log-prob - generator log-prob| over response tokens, each way. Ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402


def _config(experts: int, topk: int, layers: int):
    from megatron_rl.models.presets import ModelConfig

    return ModelConfig(name="bench-moe", family="qwen3_moe", num_layers=layers, hidden_size=256, ffn_hidden_size=512,
                       num_attention_heads=8, num_query_groups=4, head_dim=32, vocab_size=2048,
                       max_position_embeddings=1024, tie_word_embeddings=False,
                       num_moe_experts=experts, moe_ffn_hidden_size=128, moe_router_topk=topk)


def _measure(rank, world_size, cfg, prompts: int, new_tokens: int, seed: int) -> dict:
    from megatron_rl.inference import GenerationRequest, Generator, SamplingParams
    from megatron_rl.models import build_gpt_model
    from megatron_rl.models.moe import record_routes, recorded_routes, replaying
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
    from megatron_rl.training.engine import model_forward
    from megatron_rl.training.logprobs import target_logprobs

    g = build_topology([ExecutorPlacement("bench", ParallelLayout())])["bench"]
    trainer = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", seed=seed)
    generator = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", params_dtype=torch.bfloat16, seed=seed)
    with torch.no_grad():
        for p, q in zip(generator.parameters(), trainer.parameters()):
            p.copy_(q)
    rng = torch.Generator().manual_seed(seed)
    requests = [GenerationRequest(torch.randint(0, cfg.vocab_size, (16,), generator=rng).tolist(),
                                  SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=i))
                for i in range(prompts)]
    outputs = Generator(generator, cfg.vocab_size, g.pgs.tp, max_batch_size=prompts, max_len=256,
                        record_routes=True).generate(requests)
    stats = {"own": [0, 0, 0.0, 0.0], "replay": [0, 0, 0.0, 0.0]}  # flipped tokens, tokens, gap sum, gap max
    for o in outputs:
        seq = torch.tensor([o.prompt_ids + o.token_ids])
        p, n = len(o.prompt_ids), len(o.token_ids)
        for how, routes in (("own", None), ("replay", o.routes[None])):
            record_routes(trainer)
            with torch.no_grad(), replaying(trainer, routes):
                lp = target_logprobs(model_forward(trainer, seq, False), seq, g.pgs.tp, cfg.vocab_size)[0, p:]
            used = recorded_routes(trainer)[:, 0].sort(-1).values  # [s, layers, k]
            record_routes(trainer, False)
            flipped = (used[p - 1:p + n - 1] != o.routes[p - 1:p + n - 1].long().sort(-1).values).any(-1).any(-1)
            gap = (lp - torch.tensor(o.logprobs)).abs()
            s = stats[how]
            s[0] += int(flipped.sum())
            s[1] += n
            s[2] += float(gap.sum())
            s[3] = max(s[3], float(gap.max()))
    return {f"{how}_{key}": v for how, (f, n, total, top) in stats.items()
            for key, v in (("routed_differently", f / n), ("lp_gap_mean", total / n), ("lp_gap_max", top))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from megatron_rl.launch.spawn import run_local

    cfg = _config(a.experts, a.topk, a.layers)
    out = run_local(_measure, 1, cfg, a.prompts, a.new_tokens, a.seed)[0]
    print(f"routed differently: {out['own_routed_differently']:.2%} of response tokens without replay, "
          f"{out['replay_routed_differently']:.2%} with")
    print(f"log-prob gap mean / max: {out['own_lp_gap_mean']:.2e} / {out['own_lp_gap_max']:.2e} without replay, "
          f"{out['replay_lp_gap_mean']:.2e} / {out['replay_lp_gap_max']:.2e} with")
    emit({"benchmark": "routing_replay", **vars(a), **out})


if __name__ == "__main__":
    main()

"""Long, uneven rollouts in the trainer: a packed RL step against a padded one (issue 57).

    python benchmarks/long_sequences.py                          # SmolLM2-135M shape, 8 sequences of 64-2,048
    python benchmarks/long_sequences.py --preset tiny --sequences 8 --max-len 256     # a quick look

One process, fp32, the trainer's real step (`RLTrainer.step`: Megatron-Core DDP, distributed optimizer, AIPO).
The batch: `--sequences` sequences of a 32-token prompt and a response, total lengths spread evenly over
[--min-len, --max-len] (seeded), random tokens and behaviour log-probs, RLOO advantages over groups of 4. The same
weights take one step with padded micro-batches (`trainer.packing=false`: `--micro-batch` rows each, padded to the
longest sequence) and one with packed ones (the default budget: the same tokens per micro-batch as a padded one).

Printed: each step's time and tokens per second (real tokens, not padding), their ratio beside two ceilings: the
tokens the padded step computes over the packed one's, and the FLOPs' (`_flop_ceiling`: the layers' matmuls on every
token computed, attention on every pair of positions each causal call covers, the output layer on the response
tokens alone in both layouts); and how far apart the two steps' loss, gradient norm, metrics and gradients are (fp32
rounding: a different summation order). The generator's part: the slot cache against a paged cache of the same
memory (`decode_comparison`). Ends with one JSON line holding `packed_speedup` and `cache_capacity_ratio`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402

PROMPT = 32


def rollouts(vocab: int, n: int, lo: int, hi: int, seed: int):
    from megatron_rl.algorithms import compute_advantages
    from megatron_rl.rollout import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(lo, hi, n).round().long()[torch.randperm(n, generator=g)]
    s = int(lengths.max())
    tokens = torch.randint(0, vocab, (n, s), generator=g)
    prompt = torch.full((n,), PROMPT)
    response = lengths - PROMPT
    pos = torch.arange(s)[None]
    mask = (pos >= prompt[:, None]) & (pos < lengths[:, None])
    logp_mu = torch.where(mask, -torch.rand(n, s, generator=g) * 4 - 8, torch.zeros(n, s))
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    groups = torch.arange(n) // 4
    batch = RolloutBatch(tokens, prompt, response, logp_mu, rewards, groups, torch.zeros(n, dtype=torch.long))
    batch.advantages = compute_advantages(rewards, groups, "rloo")
    return batch


def _step(rank, world_size, args, packing: bool):
    from megatron_rl.algorithms import AIPOSettings
    from megatron_rl.models import build_gpt_model, get_preset
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
    from megatron_rl.training.rl_trainer import RLTrainer, RLTrainerSettings
    from megatron_rl.training.settings import LRSchedule, TrainerSettings

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = get_preset(args.preset)
    layout = ParallelLayout(tp=1)
    g = build_topology([ExecutorPlacement("trainer", layout)])["trainer"]
    model = build_gpt_model(cfg, layout, g.pgs, attention="sdpa", seed=args.seed)
    settings = RLTrainerSettings(TrainerSettings(micro_batch_size=args.micro_batch, packing=packing),
                                 AIPOSettings(rho=2.0), LRSchedule(lr=1e-6), temperature=1.0)
    trainer = RLTrainer(model, cfg, g, settings)
    batch = rollouts(cfg.vocab_size, args.sequences, args.min_len, args.max_len, args.seed)
    micro = trainer.micro_batches(batch)
    computed = sum(mb["tokens"].numel() for mb in micro)
    attended = sum(_attended_pairs(mb) for mb in micro)
    t0 = time.perf_counter()
    metrics = trainer.step(batch)
    seconds = time.perf_counter() - t0
    grads = torch.cat([b.grad_data.float().flatten() for b in trainer.engine.model.buffers])
    return {"seconds": seconds, "metrics": metrics, "grads": grads, "micro_batches": len(micro),
            "computed_tokens": computed, "attended_pairs": attended, "real_tokens": int((batch.prompt_lengths + batch.response_lengths).sum())}


def _attended_pairs(mb: dict) -> int:
    """The (query, key) pairs a micro-batch's causal attention computes: a padded row attends over its whole length
    (padding included: one causal call), a packed row within each of its segments (one causal call each)."""
    if "host_bounds" in mb:
        b = mb["host_bounds"]
        return sum((y - x) * (y - x + 1) // 2 for x, y in zip(b[:-1], b[1:]))
    rows, s = mb["tokens"].shape
    return rows * s * (s + 1) // 2


def _decode(rank, world_size, args, kv_cache_tokens, slots: int):
    """64 sequences of a 32-token prompt and lengths spread over [--min-len, --max-len] (each request's own
    max_new_tokens, no stop token), decoded in `slots` slots of a slot cache, or a paged one of `kv_cache_tokens`."""
    from megatron_rl.inference import GenerationRequest, Generator, SamplingParams
    from megatron_rl.models import build_gpt_model, get_preset
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = get_preset(args.gen_preset)
    g = build_topology([ExecutorPlacement("generator", ParallelLayout())])["generator"]
    model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", seed=args.seed)
    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=slots, max_len=args.max_len,
                    kv_cache_tokens=kv_cache_tokens, cuda_graphs=False)
    rng = torch.Generator().manual_seed(args.seed)
    lengths = torch.linspace(args.min_len, args.max_len, args.gen_sequences).round().long()
    lengths = lengths[torch.randperm(args.gen_sequences, generator=rng)].tolist()
    reqs = [GenerationRequest(torch.randint(3, cfg.vocab_size, (PROMPT,), generator=rng).tolist(),
                              SamplingParams(temperature=1.0, seed=i, max_new_tokens=n - PROMPT, stop_token_ids=[]))
            for i, n in enumerate(lengths)]
    t0 = time.perf_counter()
    outs = gen.generate(reqs)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": sum(len(o.token_ids) for o in outs), "cache_bytes": gen._cache.nbytes(),
            "mean_batch": gen.stats["mean_batch"], "preempted": gen.stats.get("preempted", 0),
            "first_tokens": [o.token_ids[:8] for o in outs]}


def decode_comparison(args) -> dict:
    """The slot cache (`--slots` slots of --max-len tokens) against a paged cache of the same tokens holding up to
    all the sequences at once: the sequences decoding together on average, tokens per second, memory."""
    from megatron_rl.launch.spawn import run_local

    out = {}
    for name, tokens, slots in (("slot", None, args.slots), ("paged", args.slots * args.max_len, args.gen_sequences)):
        r = run_local(_decode, 1, args, tokens, slots, timeout=None)[0]
        out[name] = r
        print(f"{name:5s} cache: {r['cache_bytes'] / 2**20:.0f} MiB, {r['mean_batch']:.1f} sequences a decode step, "
              f"{r['tokens'] / r['seconds']:.0f} tokens/s, {r['preempted']} preempted", flush=True)
    same = out["slot"]["first_tokens"] == out["paged"]["first_tokens"]
    ratio = out["paged"]["mean_batch"] / out["slot"]["mean_batch"]
    rate = {k: r["tokens"] / r["seconds"] for k, r in out.items()}
    print(f"paged / slot sequences decoding at once in the same memory: {ratio:.2f}x; tokens per second "
          f"{rate['paged'] / rate['slot']:.2f}x; same first tokens: {same}")
    return {"cache_capacity_ratio": ratio, "decode_speedup": (out["slot"]["seconds"] / out["paged"]["seconds"]),
            "decode": {k: {kk: v for kk, v in r.items() if kk != "first_tokens"} for k, r in out.items()},
            "decode_same_first_tokens": same}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=2, help="rows of a padded micro-batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gen-preset", default="tiny", help="the generator's model")
    p.add_argument("--gen-sequences", type=int, default=64)
    p.add_argument("--slots", type=int, default=16, help="slots of the slot cache, whose tokens the paged one gets")
    p.add_argument("--skip-train", action="store_true")
    args = p.parse_args()
    result = {"lengths": [args.min_len, args.max_len], "gen_preset": args.gen_preset,
              "gen_sequences": args.gen_sequences, "slots": args.slots, "threads": torch.get_num_threads(),
              **decode_comparison(args)}
    if not args.skip_train:
        result.update(packed_comparison(args))
    emit(result)


def _flop_ceiling(args, pad: dict, pk: dict) -> tuple[float, float]:
    """What packing can gain in FLOPs, from the model's shapes (multiply-adds of one forward; the backward scales
    every term alike). The layers' matmuls run on every token computed (padding included); attention on every
    (query, key) pair each causal call covers, quadratic in a padded row's length, in each packed sequence's; the
    output layer only on the response tokens (`engine.logits_only_at`) whichever way the batch is laid out, so a large
    vocabulary's share of the work does not shrink with the padding. Returns (matmuls only, matmuls and attention)."""
    from megatron_rl.models import get_preset

    m = get_preset(args.preset)
    kv = m.num_query_groups * m.kv_channels
    q = m.num_attention_heads * m.kv_channels
    body = m.num_layers * (m.hidden_size * (q + 2 * kv) + q * m.hidden_size + 3 * m.hidden_size * m.ffn_hidden_size)
    pair = m.num_layers * 2 * q  # QK^T and AV: kv_channels multiply-adds a pair, each head
    out = m.vocab_size * m.hidden_size * (pk["real_tokens"] - args.sequences * PROMPT)

    def work(r: dict, attention: bool) -> float:
        return body * r["computed_tokens"] + out + (pair * r["attended_pairs"] if attention else 0)

    return work(pad, False) / work(pk, False), work(pad, True) / work(pk, True)


def packed_comparison(args) -> dict:
    """The RL step, padded and packed (the module docstring)."""
    from megatron_rl.launch.spawn import run_local

    out = {}
    for name, packing in (("padded", False), ("packed", True)):
        r = run_local(_step, 1, args, packing, timeout=None)[0]
        out[name] = r
        print(f"{name:6s}: {r['micro_batches']} micro-batches, {r['computed_tokens']} tokens computed for "
              f"{r['real_tokens']} real, {r['seconds']:.1f} s, {r['real_tokens'] / r['seconds']:.0f} tokens/s",
              flush=True)
    pad, pk = out["padded"], out["packed"]
    speedup = pad["seconds"] / pk["seconds"]
    ceiling = pad["computed_tokens"] / pk["computed_tokens"]
    matmul_ceiling, flop_ceiling = _flop_ceiling(args, pad, pk)
    grad_diff = float((pad["grads"] - pk["grads"]).abs().max() / pad["grads"].abs().max())
    keys = ("loss", "grad_norm", "is_weight_mean", "entropy", "kl_mu_pi", "logp_diff_mean")
    rel = {k: abs(pk["metrics"][k] - pad["metrics"][k]) / max(abs(pad["metrics"][k]), 1e-12) for k in keys}
    print(f"packed / padded tokens per second: {speedup:.2f}x (the tokens' ceiling {ceiling:.2f}x; the FLOPs' "
          f"{flop_ceiling:.2f}x with attention, {speedup / flop_ceiling:.2f} of it; {matmul_ceiling:.2f}x without)")
    print(f"largest gradient difference {grad_diff:.1e} of the largest gradient; metrics' relative differences: "
          + ", ".join(f"{k} {v:.1e}" for k, v in rel.items()))
    return {"preset": args.preset, "sequences": args.sequences, "padded_s": pad["seconds"],
            "packed_s": pk["seconds"], "packed_speedup": speedup, "padding_ceiling": ceiling,
            "flop_ceiling": flop_ceiling, "matmul_ceiling": matmul_ceiling,
            "padded_tokens_computed": pad["computed_tokens"], "packed_tokens_computed": pk["computed_tokens"],
            "real_tokens": pk["real_tokens"], "max_grad_rel_diff": grad_diff, "metric_rel_diff": rel}

if __name__ == "__main__":
    main()

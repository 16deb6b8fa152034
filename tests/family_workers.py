"""Worker functions for the Qwen2 / Qwen3 / Mistral tests that need several ranks."""

from __future__ import annotations

import torch

from megatron_rl.algorithms import AIPOSettings
from megatron_rl.ddma.sync import WeightSync
from megatron_rl.inference import GenerationRequest, Generator, SamplingParams
from megatron_rl.models import build_gpt_model
from megatron_rl.models.sharding import load_full_state_dict
from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
from megatron_rl.training.engine import model_forward
from megatron_rl.training.logprobs import target_logprobs
from megatron_rl.training.rl_trainer import RLTrainer, RLTrainerSettings
from megatron_rl.training.settings import LRSchedule, TrainerSettings
from rl_workers import make_rollouts

PROMPTS = [[5, 17, 42, 99], [7, 8], [250, 3, 3, 3, 8, 61, 12, 4, 90]]


def _trainer(cfg, full, group):
    model = build_gpt_model(cfg, group.layout, group.pgs, attention="sdpa")
    load_full_state_dict(model, full, cfg, group.pgs)
    settings = RLTrainerSettings(TrainerSettings(micro_batch_size=4, adam_eps=1e-4, clip_grad=10.0),
                                 AIPOSettings(rho=2.0), LRSchedule(lr=1e-3), temperature=0.8)
    return model, RLTrainer(model, cfg, group, settings)


def train_push_worker(rank, world_size, cases):
    """Ranks 0-1: a TP2 trainer; rank 2: a TP1 generator. For each (family, cfg, full weights): one RL step at TP2,
    a DDMA push into the generator (built with other weights), then on the generator rank the same step taken by
    a TP1 trainer of its own (the reference), and the generator's sampling log-probs against its forward.

    The generator rank returns, per family: the largest difference between a pushed weight and the reference
    step's, the names of tensors the push left unchanged, those the step left unchanged, and the largest log-prob
    gap."""
    topo = build_topology([ExecutorPlacement("trainer", ParallelLayout(tp=2), 0),
                           ExecutorPlacement("generator", ParallelLayout(tp=1), 2)])
    t, g = topo["trainer"], topo["generator"]
    out = []
    for family, cfg, full in cases:
        batch = make_rollouts(cfg.vocab_size, seed=len(family))
        sync = WeightSync(cfg, t, g)
        if t.is_member:
            model, trainer = _trainer(cfg, full, t)
            trainer.step(batch)
            sync.sync(model, None, step=1)
            continue
        gen = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", seed=77)
        before = {n: p.detach().clone() for n, p in gen.named_parameters()}
        sync.sync(None, gen)
        ref, ref_trainer = _trainer(cfg, full, g)
        start = {n: p.detach().clone() for n, p in ref.named_parameters()}
        ref_trainer.step(batch)
        want = dict(ref.named_parameters())
        untrained = [n for n, p in want.items() if torch.equal(p, start[n])]
        gap = max((p - want[n]).abs().max().item() for n, p in gen.named_parameters())
        unchanged = [n for n, p in gen.named_parameters() if torch.equal(p, before[n])]
        generator = Generator(gen, cfg.vocab_size, g.pgs.tp, max_batch_size=2, max_len=64)
        reqs = [GenerationRequest(p, SamplingParams(temperature=0.8, max_new_tokens=8, seed=i))
                for i, p in enumerate(PROMPTS)]
        lp_gap = 0.0
        for o in generator.generate(reqs):
            seq = torch.tensor([o.prompt_ids + o.token_ids])
            with torch.no_grad():
                lp = target_logprobs(model_forward(gen, seq, False), seq, g.pgs.tp, cfg.vocab_size, 0.8)
            lp_gap = max(lp_gap, (lp[0, len(o.prompt_ids):] - torch.tensor(o.logprobs)).abs().max().item())
        out.append((family, gap, unchanged, untrained, lp_gap))
    return out if g.is_member else None


def int8_families_worker(rank, world_size, cases, requests):
    """For each (cfg, full weights): greedy outputs of an int8 generator at TP`world_size` built without its
    full-precision matrices and filled as a sync fills it (int8 weights from the quantized shards)."""
    from gen_workers import int8_generate_worker

    return [int8_generate_worker(rank, world_size, cfg, full, world_size, requests, "build")[0]
            for cfg, full in cases]


def checkpoint_logits_worker(rank, world_size, ckpts, layout_kw, tokens):
    """Each checkpoint loaded into a GPTModel at `layout_kw`; its full logits (unpadded vocabulary) on the last
    stage's TP rank 0, None elsewhere."""
    from megatron.core import dist_checkpointing

    from megatron_rl.checkpointing.inspect import read_model
    from megatron_rl.models.sharding import model_sharded_state_dict
    from megatron_rl.training.engine import run_schedule

    group = build_topology([ExecutorPlacement("x", ParallelLayout(**layout_kw))])["x"]
    out = []
    for ckpt in ckpts:
        cfg, _ = read_model(ckpt)
        model = build_gpt_model(cfg, group.layout, group.pgs, attention="sdpa", seed=99)
        sharded = model_sharded_state_dict(model, group.pgs.dp_cp)
        model.load_state_dict(dist_checkpointing.load(sharded, str(ckpt / "model")))
        got = []

        def grab(logits, mb):
            shards = [torch.empty_like(logits) for _ in range(group.layout.tp)]
            torch.distributed.all_gather(shards, logits.contiguous(), group=group.pgs.tp)
            got.append(torch.cat(shards, -1)[..., : cfg.vocab_size])
            return logits.sum() * 0, torch.ones((), dtype=torch.int64), {}

        with torch.no_grad():
            run_schedule(model, group.pgs, [{"tokens": tokens}], grab, forward_only=True)
        out.append(got[0] if got and group.pgs.tp.rank() == 0 else None)
    return out

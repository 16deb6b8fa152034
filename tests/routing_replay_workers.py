"""Worker functions for the routing-replay tests (tests/test_routing_replay.py)."""

from __future__ import annotations

import torch

from megatron_rl.inference import Generator
from megatron_rl.models.moe import record_routes, recorded_routes, replaying
from megatron_rl.parallel import ParallelLayout
from megatron_rl.training.engine import model_forward
from moe_gen_workers import _model, requests


def forward_routes(model, tokens: torch.Tensor, routes=None):
    """The logits of a full forward of `tokens` [b, s] (replaying `routes` [b, s, layers, k] when given) and the routes
    it took, [b, s, layers, k]."""
    record_routes(model)
    try:
        with torch.no_grad(), replaying(model, routes):
            logits = model_forward(model, tokens, False)
        return logits, recorded_routes(model).transpose(0, 1)
    finally:
        record_routes(model, False)


def generator_routes_worker(rank, world_size, cfg, full, layout_kw, runs):
    """Per run (max_batch, kv_cache_tokens or None): the generator's outputs' routes against a full forward of the
    same tokens: (tokens routed differently, tokens compared, the routes' dtype and shapes right, sequences
    preempted)."""
    g, model = _model(cfg, full, ParallelLayout(**layout_kw))
    out = []
    for max_batch, kv_tokens in runs:
        gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=max_batch, max_len=64,
                        kv_cache_tokens=kv_tokens, record_routes=True)
        outputs = gen.generate(requests())
        differ = compared = 0
        shapes = True
        for o in outputs:
            seq = torch.tensor([o.prompt_ids + o.token_ids])
            _, want = forward_routes(model, seq)
            n = seq.shape[1] - 1  # the last token is never fed to the generator
            shapes &= o.routes.dtype == torch.uint8 and tuple(o.routes.shape) == (n + 1, cfg.num_layers,
                                                                                    cfg.moe_router_topk)
            got = o.routes[:n].long().sort(-1).values
            differ += int((got != want[0, :n].sort(-1).values).any(-1).any(-1).sum())
            compared += n
        out.append((differ, compared, shapes, gen.stats.get("preempted", 0)))
    return out


def perturbed_router(full: dict, scale: float, seed: int = 7) -> dict:
    """`full` with every router weight moved by `scale` x its own standard deviation of noise (some routes flip)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * v.std() * torch.randn(v.shape, generator=g) if k.endswith("router.weight") else v
            for k, v in full.items()}


def rollouts_worker(rank, world_size, cfg, full):
    """The generator's (TP1) outputs of `requests()` as one replica's `ScoredRollouts` fields."""
    g, model = _model(cfg, full, ParallelLayout())
    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=4, max_len=64, record_routes=True)
    outputs = gen.generate(requests())
    return dict(prompt_ids=[o.prompt_ids for o in outputs], token_ids=[o.token_ids for o in outputs],
                logprobs=[o.logprobs for o in outputs], routes=[o.routes for o in outputs])


def _trainer(cfg, full, layout_kw, replay: bool, packed: bool, micro: int = 4):
    from megatron_rl.algorithms import AIPOSettings
    from megatron_rl.models import build_gpt_model
    from megatron_rl.models.sharding import load_full_state_dict
    from megatron_rl.parallel import ExecutorPlacement, build_topology
    from megatron_rl.training.rl_trainer import RLTrainer, RLTrainerSettings
    from megatron_rl.training.settings import LRSchedule, TrainerSettings

    layout = ParallelLayout(**layout_kw)
    g = build_topology([ExecutorPlacement("trainer", layout)])["trainer"]
    model = build_gpt_model(cfg, layout, g.pgs, attention="sdpa")
    load_full_state_dict(model, full, cfg, g.pgs)
    settings = RLTrainerSettings(TrainerSettings(micro_batch_size=micro, adam_eps=1e-4, clip_grad=10.0, packing=packed,
                                                 routing_replay=replay),
                                 AIPOSettings(rho=2.0), LRSchedule(lr=1e-3), temperature=0.8)
    return g, model, RLTrainer(model, cfg, g, settings)


def _dispatched(model, hits: list):
    """Forward hooks on every router of `model` appending (layer index, routing map [tokens, experts]) to `hits`."""
    from megatron_rl.models.moe import moe_layers

    return [layer.router.register_forward_hook(lambda m, args, out, i=i: hits.append((i, out[1].detach())))
            for i, layer in moe_layers(model)]


def trainer_routes_worker(rank, world_size, cfg, full, batch, packed):
    """TP1 trainer on `batch` (routes recorded by a generator of other weights): per routing_replay setting, how
    many real tokens (not a sequence's last) its routers dispatched to other experts than the batch's routes say,
    out of how many, from the routing maps the routers returned (a forward hook), in the log-prob pass's forward."""
    from megatron_rl.training.engine import run_schedule

    out = {}
    for replay in (False, True):
        g, model, trainer = _trainer(cfg, full, dict(), replay, packed, micro=16)
        want = trainer.micro_batches(batch) if replay else _trainer_mbs_with_routes(trainer, batch)
        mbs = trainer.micro_batches(batch)
        hits: list = []
        handles = _dispatched(trainer.model, hits)
        with torch.no_grad():
            run_schedule(trainer.model, g.pgs, mbs, _no_loss, forward_only=True)
        for h in handles:
            h.remove()
        differ = total = 0
        for j, mb in enumerate(want):
            b, s = mb["tokens"].shape
            real = _real_not_last(mb, batch)
            for i, routing_map in hits[j * cfg.num_layers:(j + 1) * cfg.num_layers]:
                used = routing_map.view(s, b, -1).transpose(0, 1)  # [b, s, experts]
                expected = torch.zeros_like(used).scatter_(-1, mb["routes"][:, :, i].long(), True)
                differ += int(((used != expected).any(-1) & real).sum())
                total += int(real.sum())
        out[replay] = (differ, total)
    return out


def _no_loss(logits, mb):
    return logits.sum() * 0, torch.ones((), dtype=torch.long), {}


def _trainer_mbs_with_routes(trainer, batch):
    """The micro-batches a replaying trainer would build (their routes), whatever `trainer`'s setting."""
    from dataclasses import replace

    t = trainer.settings.trainer
    trainer.settings.trainer = replace(t, routing_replay=True)
    try:
        return trainer.micro_batches(batch)
    finally:
        trainer.settings.trainer = t


def _real_not_last(mb: dict, batch) -> torch.Tensor:
    """[b, s]: the positions of a micro-batch holding a sequence's token other than its last (those have routes)."""
    if "segments" in mb:  # packed: a token is another's last where the next one belongs to another sequence
        seg = mb["segments"]
        nxt = torch.cat([seg[:, 1:], torch.full_like(seg[:, :1], -1)], 1)
        return (seg >= 0) & (nxt == seg)
    lengths = torch.zeros(mb["tokens"].shape[0], dtype=torch.long)
    n = min(batch.size, lengths.shape[0])
    lengths[:n] = (batch.prompt_lengths + batch.response_lengths)[:n]  # one micro-batch in these tests
    return torch.arange(mb["tokens"].shape[1])[None] < (lengths - 1)[:, None]


def rl_step_worker(rank, world_size, cfg, full, batch, layout_kw, packed, micro):
    """One AIPO step with routing replay at `layout_kw`: its metrics and the weights after it."""
    from full_state import gather_full_state_dict

    g, model, trainer = _trainer(cfg, full, layout_kw, True, packed, micro)
    metrics = trainer.step(batch)
    return {"metrics": metrics, "params": gather_full_state_dict(model, cfg, g.pgs)}

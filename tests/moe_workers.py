"""Worker functions for the mixture-of-experts tests that need several ranks."""

from __future__ import annotations

import torch

from megatron_rl.models import build_gpt_model
from full_state import gather_full_state_dict
from megatron_rl.models.sharding import load_full_state_dict
from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
from megatron_rl.training.engine import model_forward


def logits_worker(rank, world_size, cases, tokens, layout):
    """For each (cfg, logical weights): the model at `layout` loaded from them, whether gathering its weights back
    gives them bit for bit, and (last stage) its logits over the unpadded vocabulary gathered over TP."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    g = build_topology([ExecutorPlacement("moe", ParallelLayout(**layout))])["moe"]
    out = []
    for cfg, full in cases:
        model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa")
        load_full_state_dict(model, full, cfg, g.pgs)
        back = gather_full_state_dict(model, cfg, g.pgs)
        same = back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)
        with torch.no_grad():
            logits = model_forward(model, tokens, False)
        if g.is_last_stage:
            logits = gather_from_tensor_model_parallel_region(logits, group=g.pgs.tp)[..., :cfg.vocab_size]
        out.append((same, logits if g.is_last_stage else None))
    return out



def moe_batch(vocab: int, n: int = 8, seed: int = 0):
    """`n` rollouts of 12-19 tokens (prompt 4-7, response 8-12) in rows of 20, with RLOO advantages and no
    routes: no two sequences fit a packed row of 20 tokens, so packed micro-batches hold one sequence each at every
    DP size, and a layout's micro-batches are the same whatever it is (the load-balancing loss is per
    micro-batch)."""
    from megatron_rl.algorithms import compute_advantages
    from megatron_rl.rollout import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    s = 20
    tokens = torch.randint(0, vocab, (n, s), generator=g)
    prompt = torch.randint(4, 8, (n,), generator=g)
    response = torch.randint(8, 13, (n,), generator=g)
    pos = torch.arange(s)[None]
    resp_mask = (pos >= prompt[:, None]) & (pos < (prompt + response)[:, None])
    logp_mu = torch.where(resp_mask, -torch.rand(n, s, generator=g) * 6 - 3, torch.zeros(n, s))
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    groups = torch.arange(n) // 4
    batch = RolloutBatch(tokens, prompt, response, logp_mu, rewards, groups, torch.zeros(n, dtype=torch.long))
    batch.advantages = compute_advantages(rewards, groups, "rloo")
    return batch


def moe_trainer(cfg, full, g, packed: bool, coeff: float, micro: int, clip_grad: float = 0.05):
    """An fp32 RLTrainer of `cfg` loaded from the logical weights `full` on the executor groups `g`, the trainer
    routing by itself, with the load-balancing loss's coefficient `coeff`; packed rows of 20 tokens or padded
    micro-batches of `micro` rows per DP rank; gradients clipped (to `clip_grad`: the grad norm shapes the update)."""
    from megatron_rl.algorithms import AIPOSettings
    from megatron_rl.training.rl_trainer import RLTrainer, RLTrainerSettings
    from megatron_rl.training.settings import LRSchedule, TrainerSettings

    model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", params_dtype=torch.float32)
    load_full_state_dict(model, full, cfg, g.pgs)
    t = TrainerSettings(micro_batch_size=micro, adam_eps=1e-4, clip_grad=clip_grad, packing=packed,
                        max_tokens_per_micro_batch=20 if packed else 0, moe_aux_loss_coeff=coeff)
    return RLTrainer(model, cfg, g, RLTrainerSettings(t, AIPOSettings(rho=2.0), LRSchedule(lr=1e-3), temperature=0.8))


def rl_step_worker(rank, world_size, cases, batch, layout, runs):
    """For each (cfg, logical weights) of `cases` and each (packed, coefficient, micro-batch rows) of `runs`: one
    AIPO step of a trainer at `layout` (`moe_trainer`): its metrics and the logical weights after it."""
    g = build_topology([ExecutorPlacement("trainer", ParallelLayout(**layout))])["trainer"]
    out = []
    for cfg, full in cases:
        for packed, coeff, micro in runs:
            trainer = moe_trainer(cfg, full, g, packed, coeff, micro)
            metrics = trainer.step(batch)
            out.append({"metrics": metrics, "params": gather_full_state_dict(trainer.model.module, cfg, g.pgs)})
    return out


def balance_worker(rank, world_size, cfg, full, batch, coeff):
    """One AIPO step of a TP1 trainer (padded micro-batches of 2 rows): its `moe_aux_loss`, and the same loss from
    transformers' `load_balancing_loss_func` (divided by k: it sums the top-k assignments' fractions) on each
    micro-batch's router logits, computed here from the router's input and weight in the training forward, each
    layer's averaged over micro-batches weighted by their response tokens, then over layers."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from megatron_rl.models.moe import moe_layers

    g = build_topology([ExecutorPlacement("trainer", ParallelLayout())])["trainer"]
    trainer = moe_trainer(cfg, full, g, False, coeff, 2)
    logits: list = []
    hooks = [layer.router.register_forward_hook(
        lambda m, args, out: logits.append(torch.nn.functional.linear(args[0].float(), m.weight.float()).detach()))
        for _, layer in moe_layers(trainer.model)]
    mbs = trainer.micro_batches(batch)
    metrics = trainer.step(batch)
    for h in hooks:
        h.remove()
    per_layer = torch.zeros(cfg.num_layers, dtype=torch.float64)
    weights = 0.0
    for j, mb in enumerate(mbs):
        w = float(mb["loss_mask"].sum())
        weights += w
        for i in range(cfg.num_layers):
            gate = logits[j * cfg.num_layers + i].transpose(0, 1)  # [s, b, E] -> [b, s, E]
            hf = load_balancing_loss_func((gate.reshape(-1, cfg.num_moe_experts),), cfg.num_moe_experts,
                                          cfg.moe_router_topk, mb["real_tokens"].long())
            per_layer[i] += w * float(hf) / cfg.moe_router_topk
    return metrics["moe_aux_loss"], float((per_layer / weights).mean()), len(logits) == len(mbs) * cfg.num_layers

"""Worker functions for the RL trainer's multi-process tests."""

from __future__ import annotations

import torch

from megatron_rl.algorithms import AIPOSettings, compute_advantages
from megatron_rl.models import build_gpt_model, get_preset
from full_state import gather_full_state_dict
from megatron_rl.models.sharding import load_full_state_dict
from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
from megatron_rl.rollout import RolloutBatch
from megatron_rl.training.settings import LRSchedule, TrainerSettings
from megatron_rl.training.rl_trainer import RLTrainer, RLTrainerSettings


def random_full_state(seed: int = 0) -> dict:
    """Full (TP=1) weights of the tiny preset, random but well scaled, so a step visibly moves them."""
    cfg = get_preset("tiny")
    g = torch.Generator().manual_seed(seed)
    h, f, L = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.kv_channels
    full = {"embedding.word_embeddings.weight": torch.randn(cfg.vocab_size, h, generator=g) * 0.5,
            "output_layer.weight": torch.randn(cfg.vocab_size, h, generator=g) * 0.1,
            "decoder.final_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g)}
    for i in range(L):
        p = f"decoder.layers.{i}."
        full[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        full[p + "pre_mlp_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        full[p + "self_attention.linear_qkv.weight"] = torch.randn(qkv, h, generator=g) * 0.1
        full[p + "self_attention.linear_proj.weight"] = torch.randn(h, h, generator=g) * 0.1
        full[p + "mlp.linear_fc1.weight"] = torch.randn(2 * f, h, generator=g) * 0.1
        full[p + "mlp.linear_fc2.weight"] = torch.randn(h, f, generator=g) * 0.1
    return full


def make_rollouts(vocab: int, n: int = 8, s: int = 20, seed: int = 0, nan_at=None, long_first=False) -> RolloutBatch:
    """`long_first`: the first sequence 36 tokens long, the others 9-20 as usual (token-balanced DP shares then
    hold different numbers of sequences)."""
    s = 40 if long_first else s
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, s), generator=g)
    prompt = torch.randint(3, 8, (n,), generator=g)
    response = torch.minimum(torch.randint(4, 13, (n,), generator=g), s - prompt)
    if long_first:
        response[0] = 36 - prompt[0]
    pos = torch.arange(s)[None]
    resp_mask = (pos >= prompt[:, None]) & (pos < (prompt + response)[:, None])
    logp_mu = torch.where(resp_mask, -torch.rand(n, s, generator=g) * 6 - 3, torch.zeros(n, s))
    if nan_at is not None:  # a response token of sequence nan_at
        logp_mu[nan_at, prompt[nan_at]] = float("nan")
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    groups = torch.arange(n) // 4
    batch = RolloutBatch(tokens, prompt, response, logp_mu, rewards, groups, torch.zeros(n, dtype=torch.long))
    batch.advantages = compute_advantages(rewards, groups, "rloo")
    return batch


def rl_step_worker(rank, world_size, layout_kw, state_path, aipo_kw, micro, nan_first=False, packed=None,
                   long_first=False):
    """One AIPO step; `packed`: None for padded micro-batches, else packed ones of that many tokens (0: the
    default budget)."""
    layout = ParallelLayout(**layout_kw)
    cfg = get_preset("tiny")
    g = build_topology([ExecutorPlacement("trainer", layout)])["trainer"]
    full = torch.load(state_path)
    model = build_gpt_model(cfg, layout, g.pgs, attention="sdpa")
    load_full_state_dict(model, full, cfg, g.pgs)
    aipo = AIPOSettings(**aipo_kw)
    reference = None
    if aipo.kl_coef:
        reference = build_gpt_model(cfg, layout, g.pgs, attention="sdpa", seed=5)
        ref_full = {k: v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(9))
                    for k, v in full.items()}
        load_full_state_dict(reference, ref_full, cfg, g.pgs)
    settings = RLTrainerSettings(TrainerSettings(micro_batch_size=micro, adam_eps=1e-4, clip_grad=10.0,
                                                 packing=packed is not None, max_tokens_per_micro_batch=packed or 0),
                                 aipo, LRSchedule(lr=1e-3), temperature=0.8)
    trainer = RLTrainer(model, cfg, g, settings, reference_model=reference)
    out = {}
    if nan_first:
        before = gather_full_state_dict(model, cfg, g.pgs)
        out["nan_metrics"] = trainer.step(make_rollouts(cfg.vocab_size, nan_at=3))
        after = gather_full_state_dict(model, cfg, g.pgs)
        out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    out["metrics"] = trainer.step(make_rollouts(cfg.vocab_size, long_first=long_first))
    out["params"] = gather_full_state_dict(model, cfg, g.pgs)
    out["one_rank_syncs_skipped"] = "start_param_sync" in vars(trainer.engine.model)
    return out


def one_rank_syncs_worker(rank, world_size, state_path):
    """Two steps of the same single-rank trainer with Megatron-Core's one-rank gradient and parameter collectives
    skipped (the engine's default there) and run: the weights after each."""
    cfg = get_preset("tiny")
    layout = ParallelLayout(tp=1)
    g = build_topology([ExecutorPlacement("trainer", layout)])["trainer"]
    out = {}
    for how in ("skipped", "run"):
        model = build_gpt_model(cfg, layout, g.pgs, attention="sdpa")
        load_full_state_dict(model, torch.load(state_path), cfg, g.pgs)
        settings = RLTrainerSettings(TrainerSettings(micro_batch_size=4), AIPOSettings(rho=2.0), LRSchedule(lr=1e-3))
        trainer = RLTrainer(model, cfg, g, settings)
        ddp = trainer.engine.model
        out[how, "was_skipped"] = "start_param_sync" in vars(ddp)
        if how == "run":
            for name in ("start_grad_sync", "finish_grad_sync", "start_param_sync"):
                delattr(ddp, name)  # back to DistributedDataParallel's own methods
        for step in range(2):
            trainer.step(make_rollouts(cfg.vocab_size, seed=step))
        out[how] = gather_full_state_dict(model, cfg, g.pgs)
    return out


def logits_at_positions_worker(rank, world_size, state_path):
    """Log-probs, entropies and parameter gradients of one micro-batch's loss, from the whole [b, s, vocab] logits
    and from the logits at the loss's positions only (`engine.logits_only_at`); and the same with no position."""
    from megatron_rl.training.engine import model_forward
    from megatron_rl.training.logprobs import target_logprobs_and_entropy
    from megatron_rl.training.rl_trainer import make_micro_batches

    cfg = get_preset("tiny")
    layout = ParallelLayout(tp=1)
    g = build_topology([ExecutorPlacement("trainer", layout)])["trainer"]
    model = build_gpt_model(cfg, layout, g.pgs, attention="sdpa")
    load_full_state_dict(model, torch.load(state_path), cfg, g.pgs)
    mb = make_micro_batches(make_rollouts(cfg.vocab_size), 8, 24)[0]
    out = {}
    for name, mask in (("some", mb["loss_mask"]), ("none", torch.zeros_like(mb["loss_mask"]))):
        positions = torch.nn.functional.pad(mask[:, 1:], (0, 1))
        for how in ("whole", "selected"):
            model.zero_grad()
            logits = model_forward(model, mb["tokens"], False, positions if how == "selected" else None)
            lp, ent = target_logprobs_and_entropy(logits, mb["tokens"], g.pgs.tp, cfg.vocab_size, 0.8, mask=mask,
                                                  logits_at_mask=how == "selected")
            weights = torch.linspace(-1, 1, lp.numel()).view_as(lp)
            ((lp * weights).sum() + 0.3 * ent.sum()).backward()
            grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
                     for n, p in model.named_parameters()}
            out[name, how] = dict(shape=tuple(logits.shape), lp=lp.detach(), ent=ent.detach(), grads=grads)
    return out

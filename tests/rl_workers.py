"""Worker functions for the RL trainer's multi-process tests."""

from __future__ import annotations

import torch

from megatron_rl.algorithms import AIPOSettings, compute_advantages
from megatron_rl.models import build_gpt_model, get_preset
from megatron_rl.models.sharding import gather_full_state_dict, load_full_state_dict
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


def make_rollouts(vocab: int, n: int = 8, s: int = 20, seed: int = 0, nan_at=None) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, s), generator=g)
    prompt = torch.randint(3, 8, (n,), generator=g)
    response = torch.minimum(torch.randint(4, 13, (n,), generator=g), s - prompt)
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


def rl_step_worker(rank, world_size, layout_kw, state_path, aipo_kw, micro, nan_first=False):
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
    settings = RLTrainerSettings(TrainerSettings(micro_batch_size=micro, adam_eps=1e-4, clip_grad=10.0), aipo,
                                 LRSchedule(lr=1e-3), temperature=0.8)
    trainer = RLTrainer(model, cfg, g, settings, reference_model=reference)
    out = {}
    if nan_first:
        before = gather_full_state_dict(model, cfg, g.pgs)
        out["nan_metrics"] = trainer.step(make_rollouts(cfg.vocab_size, nan_at=3))
        after = gather_full_state_dict(model, cfg, g.pgs)
        out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    out["metrics"] = trainer.step(make_rollouts(cfg.vocab_size))
    out["params"] = gather_full_state_dict(model, cfg, g.pgs)
    return out

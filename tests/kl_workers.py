"""Worker functions for the KL-reference tests (run under megatron_rl.launch.spawn.run_local)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl.algorithms import AIPOSettings
from megatron_rl.checkpointing.layout import CheckpointError
from megatron_rl.checkpointing.megatron_state import saved_with_reference
from megatron_rl.checkpointing.training import TrainCheckpointer
from megatron_rl.models import build_gpt_model, get_preset
from megatron_rl.models.sharding import load_full_state_dict
from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
from megatron_rl.training.settings import LRSchedule, TrainerSettings
from megatron_rl.training.reference import make_reference
from full_state import gather_full_state_dict
from rl_workers import make_rollouts


def _trainer(layout_kw, state_path=None, seed=0):
    """A trainer with kl_coef > 0 and no reference yet, and the builder its policy came from."""
    from megatron_rl.training.rl_trainer import RLTrainer, RLTrainerSettings

    layout = ParallelLayout(**layout_kw)
    cfg = get_preset("tiny")
    g = build_topology([ExecutorPlacement("trainer", layout)])["trainer"]

    def build():
        return build_gpt_model(cfg, layout, g.pgs, attention="sdpa", seed=seed)

    model = build()
    if state_path is not None:
        load_full_state_dict(model, torch.load(state_path), cfg, g.pgs)
    settings = RLTrainerSettings(TrainerSettings(micro_batch_size=4, adam_eps=1e-4, clip_grad=10.0),
                                 AIPOSettings(rho=2.0, kl_coef=0.5), LRSchedule(lr=1e-2), temperature=0.8)
    return cfg, layout, g, build, RLTrainer(model, cfg, g, settings)


def train_and_save(rank, world_size, layout_kw, state_path, root):
    """make_reference after construction (as after a warm start), two AIPO steps with the KL term, a checkpoint with
    the reference and one without."""
    cfg, layout, g, build, trainer = _trainer(layout_kw, state_path)
    out = {}
    try:
        trainer.step(make_rollouts(cfg.vocab_size))
    except ValueError as e:
        out["no_reference_error"] = str(e)
    rng = torch.get_rng_state()
    trainer.set_reference(make_reference(trainer.model, build))
    ref = trainer.reference
    out["rng_untouched"] = torch.equal(rng, torch.get_rng_state())
    out["policy_start"] = gather_full_state_dict(trainer.model.module, cfg, g.pgs)
    out["reference_start"] = gather_full_state_dict(ref, cfg, g.pgs)
    out["frozen"] = not ref.training and not any(p.requires_grad for p in ref.parameters())
    out["metrics"] = [trainer.step(make_rollouts(cfg.vocab_size, seed=i)) for i in range(2)]
    out["no_grad"] = all(p.grad is None for p in ref.parameters())
    out["policy_end"] = gather_full_state_dict(trainer.model.module, cfg, g.pgs)
    out["reference_end"] = gather_full_state_dict(ref, cfg, g.pgs)
    rl_state = {"step": 2, "weight_version": 2} if rank == 0 else None
    out["path"] = str(TrainCheckpointer(f"{root}/with").save(2, trainer.engine, reference=ref, layout=layout,
                                                             model_cfg=cfg, rl_state=rl_state))
    out["path_without"] = str(TrainCheckpointer(f"{root}/without").save(2, trainer.engine, layout=layout,
                                                                        model_cfg=cfg, rl_state=rl_state))
    out["saved_with_reference"] = [saved_with_reference(out["path"]), saved_with_reference(out["path_without"])]
    return out


def load_reference(rank, world_size, layout_kw, path, path_without):
    """A fresh trainer and reference (other random weights), restored from `path`; then the reference-less
    checkpoint refused for a run that needs one."""
    cfg, layout, g, build, trainer = _trainer(layout_kw, seed=77)
    ref = make_reference(trainer.model, build)
    out = {"before": gather_full_state_dict(ref, cfg, g.pgs)}
    TrainCheckpointer(Path(path).parent).load(path, trainer.engine, reference=ref)
    out["reference"] = gather_full_state_dict(ref, cfg, g.pgs)
    out["policy"] = gather_full_state_dict(trainer.model.module, cfg, g.pgs)
    try:
        TrainCheckpointer(Path(path_without).parent).load(path_without, trainer.engine, reference=ref)
    except CheckpointError as e:
        out["refused"] = str(e)
    return out

"""Worker functions for tests/test_trainer_options.py: a trainer built from `megatron-rl config` options, stepped
while recording what each optimizer step saw (the learning rate it used, the gradients, the weights before and
after)."""

from __future__ import annotations

import torch

from megatron_rl.config import load_config
from megatron_rl.controller.executors import TrainerExecutor, build_policy, lr_schedule
from megatron_rl.controller.tasks import build_task
from megatron_rl.models import get_preset
from megatron_rl.models.sharding import load_full_state_dict
from megatron_rl.parallel import ExecutorPlacement, build_topology
from megatron_rl.tokenizers import ByteTokenizer
from megatron_rl.training.engine import NonFiniteError, TrainEngine
from megatron_rl.training.lm_loss import make_lm_loss


def _params(model) -> dict:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _record_optimizer_steps(optimizer, model, log: list, grads: bool = True) -> None:
    """Wrap `optimizer.step` to log, per call, the learning rate and weight decay of each group as the step sees
    them and (with `grads`) every parameter's main gradient and value just before the update."""
    inner = optimizer.step

    def step(*args, **kwargs):
        entry = {"lr": [g["lr"] for g in optimizer.param_groups]}
        if grads:
            entry["grads"] = {n: p.main_grad.detach().cpu().clone() for n, p in model.named_parameters()}
            entry["before"] = _params(model)
        log.append(entry)
        return inner(*args, **kwargs)

    optimizer.step = step


def lm_batch(vocab: int, seed: int, batch: int = 4, seq: int = 12) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    loss_mask = torch.ones(batch, seq)
    loss_mask[:, :3] = 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {"tokens": tokens.to(device), "loss_mask": loss_mask.to(device)}


def rl_optimizer_worker(rank, world_size, overrides, state_path, steps):
    """The RL-path engine of a config (no warm start): `steps` LM steps on distinct batches, then the non-finite
    sequence NaN, finite, NaN, NaN, ... until the engine stops."""
    cfg = load_config(None, overrides)
    model_cfg = get_preset("tiny")
    g = build_topology([ExecutorPlacement("trainer", cfg.trainer.layout)])["trainer"]
    model = build_policy(cfg, model_cfg, g)
    load_full_state_dict(model, torch.load(state_path), model_cfg, g.pgs)
    engine = TrainEngine.create(model, g.pgs, cfg.trainer, lr_schedule(cfg))
    loss_fn = make_lm_loss(g.pgs.tp, model_cfg.vocab_size)
    log: list = []
    _record_optimizer_steps(engine.optimizer, model, log)
    out = {"dtypes": sorted({str(p.dtype) for p in model.parameters()}),
           "main_grad_dtypes": sorted({str(p.main_grad.dtype) for p in model.parameters()}),
           "metrics": [], "after": []}
    for k in range(steps):
        out["metrics"].append(engine.step([lm_batch(model_cfg.vocab_size, seed=100 + k)], loss_fn))
        out["after"].append(_params(model))
    out["log"] = log

    def nan_loss(logits, mb):
        loss_sum, n, metrics = loss_fn(logits, mb)
        return loss_sum * float("nan"), n, {"loss": metrics["loss"] * float("nan")}

    seq, unchanged = [], []
    batch = lm_batch(model_cfg.vocab_size, seed=999)
    steps_before = len(log)
    try:
        for poisoned in [True, False] + [True] * 10:
            before = _params(model)
            m = engine.step([batch], nan_loss if poisoned else loss_fn)
            seq.append((poisoned, m["skipped"], m["nonfinite_total"]))
            if poisoned:
                after = _params(model)
                unchanged.append(all(torch.equal(before[n], after[n]) for n in before))
        out["nonfinite_error"] = None
    except NonFiniteError as e:
        out["nonfinite_error"] = str(e)
    out["nonfinite_seq"], out["nonfinite_unchanged"] = seq, unchanged
    out["nonfinite_optimizer_steps"] = len(log) - steps_before
    out["nonfinite_in_a_row"] = engine.nonfinite_in_a_row
    return out


def warm_start_worker(rank, world_size, overrides):
    """The trainer executor of a config with a supervised warm start: the learning rate of each of its steps, then
    the engine's learning rate once RL begins."""
    cfg = load_config(None, overrides)
    model_cfg = get_preset("tiny")
    g = build_topology([ExecutorPlacement("trainer", cfg.trainer.layout)])["trainer"]
    tok = ByteTokenizer()
    task = build_task(cfg, tok, with_reward=False)
    model = build_policy(cfg, model_cfg, g)
    ex = TrainerExecutor(cfg, model_cfg, g, model, task, lambda text: tok.encode(text, add_bos=tok.bos_id is not None),
                         tok)
    log: list = []
    _record_optimizer_steps(ex.engine.optimizer, model, log, grads=False)
    ex.start(lambda *a: None)
    rl_lrs = []
    for _ in range(8):  # the rate of each RL step: the engine steps the scheduler once after every kept step
        rl_lrs.append([grp["lr"] for grp in ex.engine.optimizer.param_groups])
        ex.engine.scheduler.step(increment=1)
    return {"warm_lrs": [e["lr"] for e in log], "rl_lrs": rl_lrs,
            "settings": ex.engine.settings}

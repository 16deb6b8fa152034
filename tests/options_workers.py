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
from megatron_rl.training.guard import MIN_HISTORY, CollapseError
from megatron_rl.training.lm_loss import make_lm_loss


def _params(model) -> dict:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _record_optimizer_steps(optimizer, model, log: list, grads: bool = True) -> None:
    """Wrap the optimizer's update to log, per update, the learning rate and weight decay of each group as it sees
    them and (with `grads`) every parameter's main gradient and value just before it. An update is
    `optimizer.step` (which prepares, measures and clips the gradients, then updates), or `step_with_ready_grads`
    called alone, as the engine does after measuring the norm itself for the step guard
    (`TrainEngine._step_measured`); that entry also holds `update_grad_norm`, the norm of the gradients the update
    applies (after their clipping)."""
    inner_step, inner_ready = optimizer.step, optimizer.step_with_ready_grads
    inside: list = []

    def entry() -> dict:
        out = {"lr": [g["lr"] for g in optimizer.param_groups]}
        if grads:
            out["grads"] = {n: p.main_grad.detach().cpu().clone() for n, p in model.named_parameters()}
            out["before"] = _params(model)
        return out

    def step(*args, **kwargs):
        log.append(entry())
        inside.append(True)
        try:
            return inner_step(*args, **kwargs)
        finally:
            inside.pop()

    def ready(*args, **kwargs):
        if not inside:
            e = entry()
            e["update_grad_norm"] = sum(float(p.grad.double().pow(2).sum()) for g in optimizer.param_groups
                                        for p in g["params"] if p.grad is not None) ** 0.5
            log.append(e)
        return inner_ready(*args, **kwargs)

    optimizer.step, optimizer.step_with_ready_grads = step, ready


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
    out["guard"] = _guard_sequence(engine, loss_fn, model, model_cfg.vocab_size, log)
    return out


def _guard_sequence(engine, loss_fn, model, vocab: int, log: list) -> dict:
    """The step guard of RL steps (steps given their token statistics): MIN_HISTORY steps on distinct batches, a
    step whose loss (so gradient) is planted 1000x, a step whose planted log-prob gap is 0.5 nats, a normal step (at
    half the learning rate), then gap steps until the guard stops the run."""
    healthy = {"logp_diff_mean": 0.004, "kl_mu_pi": 0.0003}
    gap = {**healthy, "logp_diff_mean": 0.5}
    out = {"taken": [], "reported_norms": []}
    for k in range(MIN_HISTORY):
        m = engine.step([lm_batch(vocab, seed=500 + k)], loss_fn, guard_stats=lambda: healthy)
        out["taken"].append(m["guarded"])
        out["reported_norms"].append(m["grad_norm"])
    out["history_norms"] = list(engine.guard.history["grad_norm"])

    def spiked(logits, mb):
        loss_sum, n, metrics = loss_fn(logits, mb)
        return loss_sum * 1000.0, n, metrics

    calls = len(log)
    m = engine.step([lm_batch(vocab, seed=600)], spiked, guard_stats=lambda: healthy)
    seen = log[-1]["update_grad_norm"]
    out["spike"] = {"guarded": m["guarded"], "skipped": m["skipped"], "reason": m.get("guard_reason"),
                    "optimizer_steps": len(log) - calls, "seen_norm": seen,
                    "norm_joined": engine.guard.history["grad_norm"][-1]}
    before, calls = _params(model), len(log)
    m = engine.step([lm_batch(vocab, seed=601)], loss_fn, guard_stats=lambda: gap)
    after = _params(model)
    out["gap_skip"] = {"skipped": m["skipped"], "reason": m.get("guard_reason"), "optimizer_steps": len(log) - calls,
                       "unchanged": all(torch.equal(before[n], after[n]) for n in before)}
    scheduled = [g["lr"] for g in engine.optimizer.param_groups]
    m = engine.step([lm_batch(vocab, seed=602)], loss_fn, guard_stats=lambda: healthy)
    out["after_gap"] = (m["guarded"], m["guard_lr_scale"], log[-1]["lr"], scheduled,
                        [g["lr"] for g in engine.optimizer.param_groups])
    counters = engine.counters()
    gaps = []
    try:
        for _ in range(10):
            gaps.append(engine.step([lm_batch(vocab, seed=603)], loss_fn, guard_stats=lambda: gap)["guarded"])
        out["collapse"] = None
    except CollapseError as e:
        out["collapse"] = str(e)
    out["gaps"] = gaps
    engine.load_counters(counters)  # a resume restores the guard's history and count as they were saved
    out["restored"] = (engine.guard.in_a_row, engine.guard.total, engine.guard.lr_scale,
                       engine.guard.history["grad_norm"][-1])
    saved = counters["step_guard"]
    out["saved"] = (saved["in_a_row"], saved["total"], saved["lr_scale"], saved["history"]["grad_norm"][-1])
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


def measured_step_worker(rank, world_size, overrides, state_path, steps):
    """Per clip_grad (one that clips every step, and one that never does): `steps` RL steps whose statistics the
    guard accepts, taken by two engines from the same weights, one with the step guard (it prepares and measures
    the gradients once and finishes the step itself, `TrainEngine._step_measured`) and one without (Megatron-Core's
    own `optimizer.step`): each one's reported grad norms and, on this rank, its weights after."""
    import dataclasses

    cfg = load_config(None, overrides)
    model_cfg = get_preset("tiny")
    g = build_topology([ExecutorPlacement("trainer", cfg.trainer.layout)])["trainer"]
    loss_fn = make_lm_loss(g.pgs.tp, model_cfg.vocab_size)
    healthy = {"logp_diff_mean": 0.004, "kl_mu_pi": 0.0003}
    out = {}
    for clip in (0.05, 1e6):
        for spike in (5.0, 0.0):
            model = build_policy(cfg, model_cfg, g)
            load_full_state_dict(model, torch.load(state_path), model_cfg, g.pgs)
            settings = dataclasses.replace(cfg.trainer, clip_grad=clip, spike_factor=spike)
            engine = TrainEngine.create(model, g.pgs, settings, lr_schedule(cfg))
            norms = [engine.step([lm_batch(model_cfg.vocab_size, seed=700 + k)], loss_fn,
                                 guard_stats=lambda: healthy)["grad_norm"] for k in range(steps)]
            out[(clip, spike)] = (norms, _params(model))
    return out

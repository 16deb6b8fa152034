"""Worker run on every rank of a real CPU job by tests/test_plan.py: what the job's executors actually allocate."""

from __future__ import annotations

import torch


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def allocated_worker(rank, world_size, cfg, run_dir):
    """Build the job's executors (`Job`, as `megatron-rl train` does), take one optimizer step so that Adam's state
    exists, and report the bytes of every buffer the trainer and generator hold on this rank."""
    from pathlib import Path

    from megatron_rl.config import validate
    from megatron_rl.controller.job import Job
    from megatron_rl.training.lm_loss import make_lm_loss

    job = Job(cfg, validate(cfg, world_size), Path(run_dir))
    out = {"rank": rank}
    if job.trainer is not None:
        engine = job.trainer.engine
        g = torch.Generator().manual_seed(rank)
        tokens = torch.randint(0, job.model_cfg.vocab_size, (2, 16), generator=g)
        engine.step([{"tokens": tokens, "loss_mask": torch.ones(2, 16)}],
                    make_lm_loss(job.trainer_groups.pgs.tp, job.model_cfg.vocab_size))
        ddp = engine.model
        distributed = cfg.trainer.use_distributed_optimizer
        params = (sum(_nbytes(b.param_data) for b in ddp.buffers) if distributed
                  else sum(_nbytes(p) for p in ddp.module.parameters()))
        main = state = 0
        for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
            for group in getattr(opt, "shard_fp32_from_float16_groups", None) or getattr(
                    opt, "fp32_from_float16_groups", []):
                main += sum(_nbytes(p) for p in group)
            seen = set()
            for s in opt.optimizer.state.values():
                for v in s.values():
                    if isinstance(v, torch.Tensor) and id(v) not in seen:
                        seen.add(id(v))
                        state += _nbytes(v)
        out["trainer"] = {"pp": job.trainer_groups.pp_rank, "dp": job.trainer_groups.dp_rank, "parameters": params,
                          "gradients": sum(_nbytes(b.grad_data) for b in ddp.buffers), "main_weights": main,
                          "optimizer_state": state}
    if job.generator is not None:
        from megatron_rl.inference.quantized import weight_bytes

        out["generator"] = {"pp": job.generator_groups.pp_rank,
                            "weights": weight_bytes(job.generator.model, job.generator.quantized)}
    if job.model_cfg.num_parameters() > 10_000_000:  # a checkpoint of the small models only (time)
        return out
    engine = job.trainer.engine if job.trainer is not None else None
    job.ckpt.save(1, engine, layout=job.trainer_groups.layout, model_cfg=job.model_cfg)
    job.ckpt.wait()
    if job.trainer is not None:
        out["trainer"]["checkpoint"] = job.ckpt.last_staged_bytes
        out["trainer"]["tp"] = job.trainer_groups.tp_rank
    return out


def saved_activations_worker(rank, world_size, preset, dtype, micro_batch, seq):
    """Bytes of the distinct storages autograd keeps for the backward pass of one trainer forward (no parameters)."""
    from megatron_rl.models import build_gpt_model, get_preset
    from megatron_rl.models.precision import DTYPES
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
    from megatron_rl.training.engine import model_forward

    cfg = get_preset(preset)
    layout = ParallelLayout(world_size, 1, 1)
    g = build_topology([ExecutorPlacement("trainer", layout)])["trainer"]
    model = build_gpt_model(cfg, layout, g.pgs, attention="sdpa", params_dtype=DTYPES[dtype])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            kept[s.data_ptr()] = s.nbytes()
        return t

    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model_forward(model, tokens, False)
    return sum(kept.values())

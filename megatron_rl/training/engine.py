"""Megatron-Core training machinery for one executor: DDP, the (distributed) optimizer and the pipeline schedule,
all on the executor's own process groups.

`TrainEngine.step` runs one optimizer step over a list of micro-batches with any per-token loss: the loss
function returns (sum of per-token losses, number of tokens, metrics), Megatron-Core sums both over micro-batches
and DP ranks (`calculate_per_token_loss`) and scales the gradients by the global token count, so a step is
independent of how the batch is split over DP ranks and micro-batches.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
import megatron_rl.compat.megatron_core  # noqa: F401 - first: Megatron-Core without wandb and Inductor
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_rl.models.moe import balancing, replaying
from megatron_rl.training.guard import StepGuard
from megatron_rl.training.reference import unwrap
from megatron_rl.training.settings import LRSchedule, TrainerSettings

# loss_fn(logits_shard [b, s, v/tp], micro_batch) -> (loss_sum, num_tokens, metrics)
LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, torch.Tensor, dict]]


class NonFiniteError(RuntimeError):
    """Training cannot go on: too many steps in a row had a non-finite loss or gradient, or an update made the
    weights non-finite."""


def current_device() -> Optional[torch.device]:
    """The device of this rank's collectives and small tensors: its GPU, or None (the CPU) without CUDA."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def _causal_mask(seq_len: int) -> torch.Tensor:
    # Megatron's convention: True = masked out. Needed by the local attention spec; SDPA ignores None.
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool), diagonal=1)


def model_forward(model: torch.nn.Module, tokens: torch.Tensor, needs_mask: bool,
                  logit_positions: Optional[torch.Tensor] = None, packed: Optional[dict] = None) -> torch.Tensor:
    """GPTModel forward on [b, s] tokens with positions 0..s-1 (causal). On the last stage: the logits [b, s, v/tp],
    or, with `logit_positions` ([b, s] bool), only those positions' logits, [1, n, v/tp] in the mask's row-major
    order (`logits_only_at`). `packed`: a packed micro-batch (`training.packing`; b = 1, its sequences' bounds and
    positions, and `cp_group`), whose sequences attend within themselves only."""
    b, s = tokens.shape
    params = None
    if packed is not None:
        if needs_mask:
            raise ValueError("packed micro-batches need SDPA's or transformer-engine's attention (trainer.attention "
                             "'local' builds a mask for one sequence a row): set trainer.packing=false")
        cu = packed["cu_seqlens"]
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=packed["max_seqlen"],
                                 max_seqlen_kv=packed["max_seqlen"], cp_group=packed["cp_group"])
        params.host_bounds = packed["host_bounds"]  # read by SDPAttention, saving a device-to-host copy a layer
        position_ids = packed["position_ids"]
        mask = None
    else:
        position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
        mask = _causal_mask(s).to(tokens.device) if needs_mask else None
    with logits_only_at(model, logit_positions):
        return model(tokens, position_ids, mask, packed_seq_params=params)


@contextlib.contextmanager
def logits_only_at(model: torch.nn.Module, positions: Optional[torch.Tensor]):
    """Within the block, the model's output layer runs only on the hidden states at `positions` ([b, s] bool), and
    the model returns their logits as [1, n, v/tp] (row-major order of `positions`) instead of [b, s, v/tp].

    A loss over response tokens reads no prompt position's logits; computing them anyway costs the output layer's
    matmul forward and backward, the [s, b] -> [b, s] transpose of the whole [b, s, vocab] block and its gradient,
    for every prompt position. The selection is a forward pre-hook on Megatron-Core's output layer (present on the
    last pipeline stage only; elsewhere, or with `positions` None, nothing changes); gradients reach the selected
    hidden states through the indexing. Sequence parallelism shards the output layer's input along the sequence,
    so there the selection is refused."""
    gpt = unwrap(model)
    layer = gpt.output_layer if positions is not None and getattr(gpt, "post_process", False) else None
    if layer is None:
        yield
        return
    if getattr(layer, "sequence_parallel", False):
        raise ValueError("logits at chosen positions need the output layer's whole sequence; sequence parallelism "
                         "shards it")

    def pick(module, args, kwargs):
        hidden = args[0]  # [s, b, h]
        return (hidden.transpose(0, 1)[positions].unsqueeze(1),) + tuple(args[1:]), kwargs

    handle = layer.register_forward_pre_hook(pick, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def skip_syncs_of_one_rank(ddp: DistributedDataParallel) -> bool:
    """With one data-parallel rank, Megatron-Core's DDP still reduce-scatters the gradient buffer and all-gathers the
    parameter buffer (or all-reduces the gradients) over that one rank: collectives whose result is their input.
    Gloo runs them as copies of the whole buffer, 1-2 s of a 13 s CPU step of SmolLM2-135M (its fp32 gradients and
    bf16 weights, 538 and 269 MB); NCCL launches them too. Turn them into nothing on `ddp` where that changes
    nothing: every bucket group communicates within a single rank, and no bucket scales or checks its gradients on
    the way (`calculate_per_token_loss` sets the scaling factor to 1). Returns whether they were turned off."""
    cfg = ddp.ddp_config
    groups = list(ddp.bucket_groups) + list(ddp.expert_parallel_bucket_groups)

    def alone(bg) -> bool:
        group = (bg.intra_distributed_optimizer_instance_group if cfg.use_distributed_optimizer
                 else bg.data_parallel_group)
        return group.size() == 1 and all(b.gradient_scaling_factor == 1.0 for b in bg.buckets)

    if (not groups or cfg.num_distributed_optimizer_instances != 1 or cfg.check_for_nan_in_grad
            or cfg.check_for_large_grads or not all(alone(bg) for bg in groups)):
        return False
    ddp.start_grad_sync = ddp.finish_grad_sync = ddp.start_param_sync = lambda *args, **kwargs: None
    return True


def _uses_local_attention(model: torch.nn.Module) -> bool:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return any(isinstance(m, DotProductAttention) for m in model.modules())


def _use_fused_adam(optimizer) -> None:
    """Pick the fastest path of torch's AdamW that computes the same update, for groups whose parameters are all
    floating-point tensors of the current device kind (the fp32 main-weight shards of the distributed optimizer).

    Without transformer-engine or apex, Megatron-Core steps torch's AdamW with its default path: multi-tensor
    (foreach) on GPUs, per-parameter on CPUs. On GPUs torch's single-kernel fused path is faster. On CPUs the
    per-parameter path runs about a dozen tensor operations per parameter from Python (each also through the CPU
    redirect of `megatron_rl.compat`); the foreach path runs the same per-tensor kernels with the same scalars from
    one call per operation, so the weights come out bit for bit the same."""
    cuda = torch.cuda.is_available()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            if group["params"] and all(p.is_cuda == cuda and p.is_floating_point() for p in group["params"]):
                group["fused"], group["foreach"] = (True, False) if cuda else (False, True)


@contextlib.contextmanager
def _world_is(group):
    """Make the default group mean `group` for the duration of a call.

    Megatron-Core 0.16's `get_megatron_optimizer` aligns parameter groups with an `all_gather_object` over the
    whole world (`get_world_size()` and no group). In a job the world also holds the generator, which never joins
    that collective, so the trainer would hang. Inside this context both calls refer to the executor's group.
    """
    real_size, real_gather = dist.get_world_size, dist.all_gather_object

    def world_size(group_=None):
        return real_size(group if group_ is None else group_)

    def all_gather_object(object_list, obj, group_=None):
        return real_gather(object_list, obj, group=group if group_ is None else group_)

    dist.get_world_size, dist.all_gather_object = world_size, all_gather_object
    try:
        yield
    finally:
        dist.get_world_size, dist.all_gather_object = real_size, real_gather


def run_schedule(model: torch.nn.Module, pgs: ProcessGroupCollection, micro_batches: list[dict], loss_fn: LossFn,
                 forward_only: bool = False, needs_mask: bool = False) -> list:
    """Megatron-Core's forward/backward schedule (1F1B when PP > 1) over micro-batches of equal shape.

    Each micro-batch is a dict with `tokens` [b, s]; `loss_fn(logits_shard, micro_batch)` runs on the last stage.
    A micro-batch with `logit_positions` ([b, s] bool) gets only those positions' logits, [1, n, v/tp]
    (`logits_only_at`); one with `cu_seqlens` is packed (`training.packing`); one with `routes` ([b, s, layers, k])
    routes its tokens to those experts in every MoE layer of this stage (routing replay, `models.moe.replaying`);
    one with `real_tokens` ([b, s] bool) and `moe_aux_weight` (0-d) has its MoE layers' load-balancing loss computed
    over those tokens with that weight (`models.moe.balancing`).
    """

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        packed = {**batch, "cp_group": pgs.cp} if "cu_seqlens" in batch else None
        # Routing replay (the generator's experts) and the load-balancing loss's tokens and weight (`models/moe.py`)
        with replaying(chunk, batch.get("routes")), balancing(chunk, batch.get("real_tokens"),
                                                              batch.get("moe_aux_weight")):
            output = model_forward(chunk, batch["tokens"], needs_mask, batch.get("logit_positions"), packed)
        return output, lambda logits: loss_fn(logits, batch)

    b, s = micro_batches[0]["tokens"].shape
    for mb in micro_batches:
        if tuple(mb["tokens"].shape) != (b, s):
            raise ValueError(f"micro-batches must share one shape; got {tuple(mb['tokens'].shape)} and {(b, s)}")
    pp = pgs.pp.size()
    kwargs: dict = {"pg_collection": pgs}
    if pp > 1:
        config = model.config if hasattr(model, "config") else model.module.config
        kwargs["p2p_communicator"] = P2PCommunicator(pp_group=pgs.pp, config=config)
    fb = get_forward_backward_func(pp_size=pp, vp_size=None)
    return fb(forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
              num_microbatches=len(micro_batches), seq_length=s, micro_batch_size=b, forward_only=forward_only,
              **kwargs)


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Are all values of all tensors finite? One sum per tensor (non-finite when any value is, or when values
    near the dtype's limit overflow the sum: no healthy state is that large); `isfinite(t).all()` costs four
    passes and two temporaries."""
    sums = [t.sum().float() for t in tensors if t.numel()]
    return not sums or bool(torch.isfinite(torch.stack(sums)).all())  # one device-to-host read


@dataclass
class TrainEngine:
    """DDP-wrapped model chunk, optimizer and LR schedule of one trainer executor rank."""

    model: DistributedDataParallel
    optimizer: Any
    scheduler: OptimizerParamScheduler
    pgs: ProcessGroupCollection
    settings: TrainerSettings
    schedule: LRSchedule
    needs_mask: bool = False
    steps_done: int = 0
    nonfinite_in_a_row: int = 0
    nonfinite_total: int = 0
    guard: Optional[StepGuard] = None  # RL steps' spike guard (`step`), from trainer.spike_factor

    @classmethod
    def create(cls, model: torch.nn.Module, pgs: ProcessGroupCollection, settings: TrainerSettings,
               schedule: LRSchedule, bucket_size: Optional[int] = None) -> "TrainEngine":
        """The optimizer as `settings` (the trainer section) says, stepping the learning rate along `schedule`."""
        config = model.config
        config.calculate_per_token_loss = True
        config.finalize_model_grads_func = finalize_model_grads
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=settings.use_distributed_optimizer,
            bucket_size=bucket_size,
        )
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model, pg_collection=pgs)
        skip_syncs_of_one_rank(ddp)
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=schedule.lr,
            min_lr=schedule.min_lr,
            weight_decay=settings.weight_decay,
            adam_beta1=settings.adam_beta1,
            adam_beta2=settings.adam_beta2,
            adam_eps=settings.adam_eps,
            clip_grad=settings.clip_grad,
            use_distributed_optimizer=settings.use_distributed_optimizer,
            bf16=config.bf16,
            fp16=config.fp16,
            params_dtype=config.params_dtype,
        )
        with _world_is(pgs.intra_dist_opt):
            optimizer = get_megatron_optimizer(opt_config, [ddp], pg_collection=pgs, use_gloo_process_groups=False)
        _use_fused_adam(optimizer)
        scheduler = OptimizerParamScheduler(
            optimizer,
            init_lr=0.0 if schedule.warmup_steps else schedule.lr,
            max_lr=schedule.lr,
            min_lr=schedule.min_lr,
            lr_warmup_steps=schedule.warmup_steps,
            lr_decay_steps=max(schedule.total_steps, schedule.warmup_steps + 1),
            lr_decay_style=schedule.decay_style,
            start_wd=settings.weight_decay,
            end_wd=settings.weight_decay,
            wd_incr_steps=max(schedule.total_steps, 1),
            wd_incr_style="constant",
        )
        guard = StepGuard(settings.spike_factor, settings.max_guarded_steps) if settings.spike_factor else None
        return cls(ddp, optimizer, scheduler, pgs, settings, schedule, needs_mask=_uses_local_attention(model),
                   guard=guard)

    def start_constant_schedule(self, lr: float, warmup_steps: int = 0) -> None:
        """From the next step on: a linear warm-up from 0 over `warmup_steps` steps to `lr`, then `lr` (RL after a
        supervised warm start, which ran a schedule of its own). The scheduler counts its steps afresh."""
        s = self.scheduler
        s.num_steps, s.lr_warmup_steps, s.lr_decay_style = 0, warmup_steps, "constant"
        s.init_lr = 0.0 if warmup_steps else lr
        self.set_peak_lr(lr)

    def set_peak_lr(self, lr: float) -> None:
        """Change the constant schedule's learning rate, keeping its progress through the warm-up (a resumed run
        with another trainer.lr)."""
        s = self.scheduler
        s.max_lr = s.min_lr = lr
        if not s.lr_warmup_steps:
            s.init_lr = lr
        for group in self.optimizer.param_groups:
            # Megatron-Core's scheduler reads per-group max_lr / min_lr before its own.
            group["max_lr"] = group["min_lr"] = lr
            group["lr"] = s.get_lr(group)

    @property
    def is_last_stage(self) -> bool:
        return self.pgs.pp.rank() == self.pgs.pp.size() - 1

    def forward_backward(self, micro_batches: list[dict], loss_fn: LossFn, forward_only: bool = False) -> list:
        """Run the pipeline schedule; returns the loss functions' outputs (last stage only, else [])."""
        return run_schedule(self.model, self.pgs, micro_batches, loss_fn, forward_only, self.needs_mask)

    def _zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        with warnings.catch_warnings():
            # Megatron-Core's distributed optimizer reads `.grad` of its non-leaf shard views while zeroing (its own
            # source marks the line "throws grad-access warning"); harmless, and printed by every trainer rank.
            warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf Tensor")
            self.optimizer.zero_grad()

    def step(self, micro_batches: list[dict], loss_fn: LossFn,
             guard_stats: Optional[Callable[[], dict[str, float]]] = None) -> dict:
        """One optimizer step over this rank's micro-batches. Returns metrics (loss, grad norm, lr, skipped).

        A non-finite loss or gradient anywhere in the executor skips the update (weights and optimizer state
        untouched) and is counted; `settings.max_nonfinite_steps` skips in a row stop the run. An update of finite
        gradients that makes the weights non-finite (an overflowing learning rate) cannot be undone without a copy
        of the weights and optimizer state, so it stops the run (NonFiniteError) before the weights go anywhere:
        no weight push, no checkpoint.

        With `guard_stats` (the step's token statistics, the same on every rank; RL steps) and a `guard`, the
        gradient norm is measured before the update and the guard (`training/guard.py`) may skip the step or scale
        its gradient down: then "guarded" is 1 and "guard_reason" says why; a step it takes runs at its `lr_scale` of
        the scheduler's rate ("guard_lr_scale"). The norm it measured is the one the step clips with
        (`_step_measured`): the gradients are prepared and measured once.
        """
        self._zero_grad()
        outputs = self.forward_backward(micro_batches, loss_fn)
        loss = self._reduce_loss(outputs)
        if not (math.isfinite(loss) and self._grads_finite()):
            self.nonfinite_in_a_row += 1
            self.nonfinite_total += 1
            self._zero_grad()
            if self.nonfinite_in_a_row >= self.settings.max_nonfinite_steps:
                raise NonFiniteError(
                    f"{self.nonfinite_in_a_row} training steps in a row had a non-finite loss or gradient "
                    f"(limit trainer.max_nonfinite_steps={self.settings.max_nonfinite_steps}); stopping. Last loss: "
                    f"{loss}. Check the rewards and behaviour log-probs of recent rollouts, or lower the LR.")
            return {"loss": loss, "grad_norm": math.nan, "lr": self.optimizer.param_groups[0]["lr"],
                    "skipped": True, "guarded": 0.0, "guard_lr_scale": self.guard.lr_scale if self.guard else 1.0,
                    "nonfinite_total": self.nonfinite_total}
        self.nonfinite_in_a_row = 0
        lr = self.optimizer.param_groups[0]["lr"]
        scale, verdict, measured = 1.0, None, None
        if self.guard is not None and guard_stats is not None:
            self.optimizer.prepare_grads()  # the main gradients, as the optimizer's step makes them
            grad_norm = measured = float(self.optimizer.get_grad_norm())
            scale = self.guard.lr_scale  # this step's (taking it restores some for the next)
            verdict = self.guard.check({"grad_norm": grad_norm, **guard_stats()})
            if verdict.skip:
                self._zero_grad()
                return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "skipped": True, "guarded": 1.0,
                        "guard_lr_scale": self.guard.lr_scale, "guard_reason": verdict.reason,
                        "nonfinite_total": self.nonfinite_total}
        rates = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:  # the guard's smaller step, for this update only
            g["lr"] *= scale
        try:
            if measured is None:
                update_successful, grad_norm, _ = self.optimizer.step()
            else:
                update_successful, grad_norm = self._step_measured(measured, verdict.grad_scale), measured
        except RuntimeError as e:  # torch's Adam: a step size (lr / bias correction) beyond the float range
            if "overflow" not in str(e):
                raise
            raise NonFiniteError(self._broken_update(loss, lr, "overflowed the float range")) from None
        finally:
            for g, rate in zip(self.optimizer.param_groups, rates):
                g["lr"] = rate
        if update_successful and not self._main_params_finite():
            raise NonFiniteError(self._broken_update(loss, lr, "made the weights non-finite"))
        if update_successful:
            self.scheduler.step(increment=1)
            self.steps_done += 1
        out = {"loss": loss, "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
               "lr": self.optimizer.param_groups[0]["lr"], "skipped": not update_successful, "guarded": 0.0,
               "guard_lr_scale": scale, "nonfinite_total": self.nonfinite_total}
        if verdict is not None and verdict.reason is not None:  # its gradient scaled: the norm as measured
            out.update(grad_norm=measured, guarded=1.0, guard_reason=verdict.reason)
        return out

    def _step_measured(self, norm: float, grad_scale: float) -> bool:
        """The rest of the optimizer's step once its gradients are prepared and their norm is `norm` (Megatron-Core's
        `ChainedOptimizer.step` after its norm): each optimizer's gradients clipped by that total norm to
        `clip_grad`, or where the guard scales the gradient (`grad_scale` < 1) to `grad_scale` x `norm` if that is
        smaller, then the update. Whether it was taken."""
        clip = self.optimizer.config.clip_grad
        if grad_scale < 1.0:
            max_norm = min(clip, norm * grad_scale) if clip > 0 else norm * grad_scale
        else:  # exactly the optimizer's own step
            max_norm = clip
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            params = [] if getattr(opt, "is_stub_optimizer", False) else opt.get_parameters()
            if params and (clip > 0 or grad_scale < 1.0):
                decoupled = opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                clip_grad_by_total_norm_fp32(params, max_norm=max_norm, total_norm=norm, use_decoupled_grad=decoupled)
        return self.optimizer.step_with_ready_grads()

    def counters(self) -> dict:
        """What a checkpoint keeps of the engine beside the optimizer and scheduler: its step counters and the
        step guard's history (`load_counters` restores them)."""
        out = {"steps_done": self.steps_done, "nonfinite_total": self.nonfinite_total,
               "nonfinite_in_a_row": self.nonfinite_in_a_row}
        if self.guard is not None:
            out["step_guard"] = self.guard.state_dict()
        return out

    def load_counters(self, state: dict) -> None:
        """Restore `counters`; a checkpoint from before the guard existed leaves the guard's history empty."""
        self.steps_done, self.nonfinite_total = state["steps_done"], state["nonfinite_total"]
        self.nonfinite_in_a_row = state["nonfinite_in_a_row"]
        if self.guard is not None and "step_guard" in state:
            self.guard.load_state_dict(state["step_guard"])

    def _grads_finite(self) -> bool:
        """True when every gradient of every rank of the executor is finite. Checked as the buffer's sum, which is
        non-finite when any value is (or when the gradients are so large, about 1e30, that the sum overflows: a
        step worth skipping too); one read of the buffer, where `isfinite(...).all()` costs four passes and two
        temporaries."""
        buffers = self.model.buffers + self.model.expert_parallel_buffers
        return self._everywhere(all_finite(b.grad_data for b in buffers))

    def _everywhere(self, ok: bool) -> bool:
        """True when `ok` holds on every rank of the executor (one all-reduce of a flag)."""
        bad = torch.tensor([0.0 if ok else 1.0], device=current_device())
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.pgs.intra_dist_opt)
        return bad.item() == 0

    def _broken_update(self, loss: float, lr: float, what: str) -> str:
        return (f"update {self.steps_done + 1} {what} (its loss {loss:.4g} and gradients were finite; learning rate "
                f"{lr:.4g}); stopping without keeping or saving it: lower the learning rate and resume from the last "
                f"checkpoint")

    def _main_params(self) -> list[torch.Tensor]:
        """The parameters the optimizer updates on this rank: the distributed optimizer's fp32 main shards (or the
        model's parameters themselves without one)."""
        return [p for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer])
                for group in opt.optimizer.param_groups for p in group["params"]]

    def _main_params_finite(self) -> bool:
        """True when every rank's main parameters are finite after an update: one sum per tensor (the same test
        as `_grads_finite`, on a 1/DP shard of the weights) and one all-reduce of a flag. It only reads, so a
        healthy run's numbers do not change (cost: docs/benchmarks.md, "Checkpoint checksums")."""
        return self._everywhere(all_finite(self._main_params()))

    def state_finite(self) -> bool:
        """True when this rank's model weights, main parameters and optimizer state (Adam moments) are all finite:
        what a checkpoint would hold. Local; the checkpointer reduces it over the world."""
        optimizer_state = [v for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer])
                           for state in opt.optimizer.state.values() for v in state.values()
                           if isinstance(v, torch.Tensor) and v.is_floating_point()]
        # Without the distributed optimizer the buffers hold only gradients: the weights are the parameters.
        weights = [b.param_data for b in self.model.buffers + self.model.expert_parallel_buffers
                   if b.param_data is not None] or [p.data for p in self.model.parameters()]
        return all_finite(weights + self._main_params() + optimizer_state)

    def _reduce_loss(self, outputs: Iterable) -> float:
        """Token-mean loss over the whole step (all micro-batches and DP ranks), known on every rank."""
        total = torch.zeros(2, dtype=torch.float64, device=current_device())
        if self.is_last_stage:
            for out in outputs:
                loss = out.get("loss") if isinstance(out, dict) else None
                if loss is not None:
                    total += loss.detach().double().to(total.device)
        dist.all_reduce(total, group=self.pgs.dp_cp)
        # The last stage knows the loss; share it with the executor's other stages.
        dist.all_reduce(total, group=self.pgs.pp)
        total = total.cpu()
        return float(total[0] / total[1]) if total[1] > 0 else math.nan

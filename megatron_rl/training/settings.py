"""What the trainer executor is told: the `trainer` section (its layout, batch, optimizer, warm start, precision),
and the learning-rate schedule the engine runs, which the job derives from it (`executors.lr_schedule`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.settings import Section, ranged


@dataclass
class TrainerSettings(Section):
    """The `trainer` section. The optimizer's fields (Adam's, weight decay, clipping, the distributed optimizer,
    the non-finite step limit) are read by `training.engine.TrainEngine` from this object as it is."""

    SECTION: ClassVar[str] = "trainer"
    tp: int = 2
    pp: int = 1
    dp: int = 1
    # Expert parallelism (mixture-of-experts models): each layer's experts split over `ep` of the DP ranks, as
    # Megatron-Core does (`ParallelLayout.ep`; each expert's weights over TP, as a dense MLP's); `ep` must divide
    # `dp` and the number of experts. It adds no ranks.
    ep: int = ranged(1, ">= 1", "(each layer's experts split over ep of the DP ranks)")
    micro_batch_size: int = ranged(64, ">= 1")
    # Packed micro-batches (`training.packing`): whole sequences concatenated up to max_tokens_per_micro_batch
    # tokens (0: micro_batch_size x the step's longest sequence, the tokens of a padded micro-batch), so a step pays
    # for its tokens, not for padding; false pads every sequence to the step's longest.
    packing: bool = True
    max_tokens_per_micro_batch: int = ranged(0, ">= 0", "(0: micro_batch_size x the step's longest sequence)")
    lr: float = ranged(2e-4, "> 0")  # the RL learning rate (constant after `lr_warmup_steps` of linear warm-up)
    lr_warmup_steps: int = ranged(0, ">= 0")
    # Supervised warm start inside the job, before RL (0 to skip): steps and peak learning rate.
    sft_warmup_steps: int = ranged(1500, ">= 0", "(0 skips the warm start)")
    sft_lr: float = ranged(3e-3, "> 0")
    weight_decay: float = ranged(0.0, ">= 0")
    clip_grad: float = ranged(1.0, ">= 0", "(0 disables clipping)")
    adam_beta1: float = ranged(0.9, "in [0, 1)")
    adam_beta2: float = ranged(0.999, "in [0, 1)")
    adam_eps: float = ranged(1e-8, "> 0")
    use_distributed_optimizer: bool = True
    attention: Literal["auto", "sdpa", "local", "te"] = "auto"
    # "auto": bf16 where the hardware multiplies bf16 natively, else fp32 (megatron_rl.models.precision).
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    max_nonfinite_steps: int = ranged(3, ">= 1")
    # The collapse guard's step guard (`training/guard.py`): an RL step whose gradient norm, log-prob gap or KL is
    # more than spike_factor x its median over the last 20 steps is skipped (0: never) and halves the step size of
    # the next steps (10 steps taken restore it); a step size halved max_guarded_steps times net (that many skipped
    # steps in a row, or in short succession) stops the run, naming the last checkpoint.
    spike_factor: float = ranged(5.0, ">= 0", "(0: no step guard)")
    max_guarded_steps: int = ranged(5, ">= 1")
    # Routing replay (R3) for a mixture-of-experts model: the log-prob pass and the training forward/backward route
    # every token to the experts the generator chose for it (recorded with the rollouts, `models/moe.py`), so the
    # trainer's and the generator's log-probs differ by the arithmetic only, not by flipped routes. false: the
    # trainer routes by itself (to compare). Ignored for a dense model (no routes).
    routing_replay: bool = True
    # The load-balancing loss of a mixture-of-experts model (`models/moe.py`): the training loss adds this times
    # the sum over MoE layers of each layer's switch-transformer loss (1 per layer when balanced; Megatron-Core's
    # convention and default, 0). RL fine-tunes a pretrained router that is balanced already: a balancing term would
    # pull the router by something other than the rewards and, under routing replay, away from the generator's
    # routes. The step reports the loss (`moe_aux_loss`, the mean over layers) whatever the coefficient.
    # (transformers' `router_aux_loss_coef` multiplies k x the loss pooled over layers: c x k / layers here.)
    moe_aux_loss_coeff: float = ranged(0.0, ">= 0")

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(self.tp, self.pp, self.dp, ep=self.ep)

    def rules(self, path: str) -> list[str]:
        out = []
        if self.packing and self.attention == "local":
            out.append(f"{path}.packing=true needs SDPA's or transformer-engine's attention: {path}.attention='local' "
                       f"masks one sequence a row (set {path}.packing=false)")
        if self.max_tokens_per_micro_batch and not self.packing:
            out.append(f"{path}.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} is the budget of packed "
                       f"micro-batches and {path}.packing=false")
        return out


@dataclass(frozen=True)
class LRSchedule:
    """Megatron-Core's learning-rate schedule: a linear warm-up from 0 over `warmup_steps` to `lr`, then
    `decay_style` ("constant" or "cosine") down to `min_lr` at `total_steps`."""

    lr: float = 1e-5
    min_lr: float = 0.0
    warmup_steps: int = 0
    total_steps: int = 1000
    decay_style: Literal["constant", "cosine"] = "constant"

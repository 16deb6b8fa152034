"""The trainer executor's RL step: AIPO on rollouts, inside Megatron-Core's training loop.

Variable lengths: by default whole sequences are packed into micro-batches of a token budget
(`training.packing`, `trainer.max_tokens_per_micro_batch`), attending within themselves only, so a step pays for
its tokens and not for padding. With `trainer.packing=false` (needed by the 'local' attention, which masks one
sequence a row), every micro-batch is right-padded to the step's longest sequence (rounded up to a multiple of 8):
padding carries no loss and, with causal attention, does not influence real positions. Either way the micro-batches
of a step share one shape, because Megatron-Core's pipeline schedule exchanges fixed-shape activations between
stages, and every per-token and per-sequence quantity is the same. The model computes logits only where the loss
reads them (the positions before response tokens, `engine.logits_only_at`): a prompt position's logits would cost
the output layer and a pass over the vocabulary for nothing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields, replace
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.algorithms.aipo import AIPOSettings, aipo_token_loss, normalize
from megatron_rl.models.moe import take_balance_stats
from megatron_rl.models.presets import ModelConfig
from megatron_rl.parallel.topology import ExecutorGroups
from megatron_rl.rollout import RolloutBatch
from megatron_rl.training.engine import TrainEngine, current_device, run_schedule
from megatron_rl.training.logprobs import logit_positions, target_logprobs, target_logprobs_and_entropy
from megatron_rl.training.packing import packed_micro_batches, placeholder_routes
from megatron_rl.training.reference import freeze
from megatron_rl.training.settings import LRSchedule, TrainerSettings

def _stat(reduce: str, token: Optional[str] = None, report: str = "always"):
    return field(default=None, metadata={"reduce": reduce, "token": token, "report": report})


@dataclass
class TokenStats:
    """Statistics of the response tokens of a step; each field is the metric of the same name.

    One instance per micro-batch (`of_micro_batch`), combined over micro-batches and DP ranks by `reduce`. A
    field's `token` names the per-token statistic of `aipo_token_loss` it summarises, and its rule says how:
    "sum": summed over the step (the response-token count); "mean": summed over response tokens, reported divided
    by the step's response tokens; "max": the maximum over response tokens. A "mean" whose per-token statistic the
    loss did not compute (entropy when not logged) is 0. `report` says when a metrics row shows it ("always",
    "never", or "with_reference": only in a run with a KL reference); the row shows them in this order
    (`step_metrics`). Adding a statistic is one line here. `logp_diff_*` is |logp_pi - logp_mu|: the
    trainer-generator numeric gap when the batch was generated with the trainer's current weights (staleness 0),
    plus the policy's drift when it is older.
    """

    is_weight_mean: torch.Tensor = _stat("mean", "ratio")
    is_weight_max: torch.Tensor = _stat("max", "ratio")
    is_truncated_frac: torch.Tensor = _stat("mean", "truncated")
    band_masked_frac: torch.Tensor = _stat("mean", "out_of_band")
    kl_mu_pi: torch.Tensor = _stat("mean", "kl_mu_pi")
    logp_diff_mean: torch.Tensor = _stat("mean", "abs_log_ratio")
    logp_diff_max: torch.Tensor = _stat("max", "abs_log_ratio")
    entropy: torch.Tensor = _stat("mean", "entropy")
    kl_ref: torch.Tensor = _stat("mean", "kl_ref", report="with_reference")
    response_tokens: torch.Tensor = _stat("sum", report="never")

    @classmethod
    def reported(cls, with_reference: bool) -> tuple[str, ...]:
        """The fields a metrics row shows, in order."""
        shown = ("always", "with_reference") if with_reference else ("always",)
        return tuple(f.name for f in fields(cls) if f.metadata["report"] in shown)

    @classmethod
    def of_micro_batch(cls, token_stats: dict, mask: torch.Tensor) -> "TokenStats":
        """One micro-batch's values (float32 scalars) from per-token statistics [b, s] and the response mask."""
        fmask = mask.to(torch.float32)
        values = {}
        for f in fields(cls):
            rule, v = f.metadata["reduce"], token_stats.get(f.metadata["token"])
            if f.metadata["token"] is None:
                values[f.name] = fmask.sum()
            elif v is None:
                values[f.name] = fmask.new_zeros(())
            elif rule == "max":
                values[f.name] = (v * fmask).max().float() if fmask.any() else fmask.new_zeros(())
            else:
                values[f.name] = (v.float() * fmask).sum()
        return cls(**values)

    def to_tensor(self) -> torch.Tensor:
        return torch.stack([getattr(self, f.name) for f in fields(self)])

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "TokenStats":
        return cls(*t.unbind())

    @classmethod
    def reduce(cls, parts: list["TokenStats"], groups: list, device=None) -> dict[str, float]:
        """The step's metrics from every micro-batch of this rank (in float64) and, through collectives over each of
        `groups` in turn, of the other ranks; ranks without micro-batches (not the last pipeline stage) add
        nothing to a sum, and 0 to a maximum (every "max" statistic is >= 0)."""
        names = [f.name for f in fields(cls)]
        rules = [f.metadata["reduce"] for f in fields(cls)]
        at_sum = [i for i, r in enumerate(rules) if r != "max"]
        at_max = [i for i, r in enumerate(rules) if r == "max"]
        sums = torch.zeros(len(at_sum), dtype=torch.float64, device=device)
        maxima = torch.zeros(len(at_max), dtype=torch.float64, device=device)
        for part in parts:
            t = part.to_tensor().double().to(sums.device)
            sums += t[at_sum]
            maxima = torch.maximum(maxima, t[at_max])
        for group in groups:
            dist.all_reduce(sums, group=group)
        for group in groups:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        values = dict(zip([names[i] for i in at_sum], sums.cpu().tolist()))
        values.update(zip([names[i] for i in at_max], maxima.cpu().tolist()))
        tokens = max(values["response_tokens"], 1.0)
        return {name: values[name] / tokens if rule == "mean" else values[name] for name, rule in zip(names, rules)}


def step_metrics(with_reference: bool, moe: bool = False) -> tuple[str, ...]:
    """What `RLTrainer.step` reports, in the order of a metrics row: the engine's step, the statistics of the
    response tokens (`TokenStats`), for a mixture of experts (`moe`) the load-balancing loss (`moe_aux_loss`,
    `RLTrainer.moe_aux_loss`), the batch's response length and the step's speed, whether the step was skipped (a
    non-finite gradient, or the step guard: then `guarded` is 1, `training/guard.py`) and the guard's scale of the
    learning rate."""
    return ("loss", "grad_norm", "lr", *TokenStats.reported(with_reference), *(("moe_aux_loss",) if moe else ()),
            "response_length", "tokens_per_s", "skipped", "guarded", "guard_lr_scale")


@dataclass
class RLTrainerSettings:
    """What `RLTrainer` is told: the job's `trainer` and `algorithm` sections as they are, the learning-rate
    schedule it starts with, and the rollouts' sampling temperature (the behaviour log-probs are those of the
    tempered distribution, so the trainer's must be too)."""

    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    aipo: AIPOSettings = field(default_factory=AIPOSettings)
    schedule: LRSchedule = field(default_factory=LRSchedule)
    temperature: float = 1.0
    log_entropy: bool = True


def shard_for_dp(batch: RolloutBatch, dp: int, dp_rank: int) -> RolloutBatch:
    """This DP rank's responses: a contiguous, near-equal share (array_split)."""
    parts = torch.arange(batch.size).tensor_split(dp)
    return batch.select(parts[dp_rank])


def padded_seq_len(longest: int) -> int:
    """The sequence length of every micro-batch of a step whose longest sequence has `longest` tokens: rounded up
    to a multiple of 8 (module docstring). `megatron-rl plan` sizes the trainer's activations with it."""
    return -(-longest // 8) * 8


def micro_batch_rows(n: int, micro_batch_size: int) -> int:
    """Rows per micro-batch for n sequences: as few micro-batches as `micro_batch_size` allows, evenly filled
    (65 sequences at most 64 per micro-batch -> 2 of 33, not 2 of 64), so padding rows cost at most one per
    micro-batch instead of up to a whole micro-batch."""
    count = max(-(-n // micro_batch_size), 1)
    return max(-(-n // count), 1)


def make_micro_batches(batch: RolloutBatch, micro_batch_size: int, seq_len: int, pad_id: int = 0) -> list[dict]:
    """Micro-batches of equal shape [rows, seq_len], rows = `micro_batch_rows` (at most micro_batch_size);
    missing rows are padding with no loss. `real_tokens` marks each sequence's own tokens (not the padding)."""
    n = batch.size
    micro_batch_size = micro_batch_rows(n, micro_batch_size)
    rows = max(-(-n // micro_batch_size), 1) * micro_batch_size
    s = batch.tokens.shape[1]
    if seq_len < s:
        raise ValueError(f"seq_len {seq_len} is shorter than the batch's {s}")
    tokens = torch.full((rows, seq_len), pad_id, dtype=torch.long)
    tokens[:n, :s] = batch.tokens
    lengths = torch.zeros(rows, dtype=torch.long)
    lengths[:n] = batch.prompt_lengths + batch.response_lengths
    real = torch.arange(seq_len) < lengths[:, None]  # each sequence's own tokens
    mask = torch.zeros(rows, seq_len, dtype=torch.bool)
    mask[:n, :s] = batch.response_mask()
    mask[:, 0] = False  # position 0 is never a target
    positions = logit_positions(mask)  # the only logits the loss reads (engine.logits_only_at)
    logp_mu = torch.zeros(rows, seq_len)
    logp_mu[:n, :s] = batch.behaviour_logprobs
    adv = torch.zeros(rows)
    if batch.advantages is None:
        raise ValueError("the batch has no advantages; compute them before training")
    adv[:n] = batch.advantages
    named = [("tokens", tokens), ("loss_mask", mask), ("logit_positions", positions), ("logp_mu", logp_mu),
             ("adv", adv), ("real_tokens", real)]
    if batch.routes is not None:  # routing replay: the generator's experts (placeholders on padding)
        routes = placeholder_routes(rows, seq_len, batch.routes)
        routes[:n, :s] = batch.routes
        named.append(("routes", routes))
    device = current_device()
    out = []
    for i in range(0, rows, micro_batch_size):
        sl = slice(i, i + micro_batch_size)
        out.append({k: v[sl].to(device) if device is not None else v[sl] for k, v in named})
    return out


def aipo_microbatch_loss(logits: torch.Tensor, mb: dict, tp_group, vocab_size: int, settings: RLTrainerSettings):
    """AIPO on one micro-batch of vocab-parallel logits: (loss sum, count, TokenStats).

    `mb` holds tokens, loss_mask (response positions), logp_mu (behaviour log-probs aligned with tokens),
    adv (per sequence) and optionally logp_ref. Positions outside loss_mask contribute neither loss nor gradient.
    """
    s = settings
    # One pass over the vocabulary gives both; the entropy only carries gradient when it is in the loss.
    logp_pi, entropy = target_logprobs_and_entropy(logits, mb["tokens"], tp_group, vocab_size, s.temperature,
                                                   mask=mb["loss_mask"], logits_at_mask="logit_positions" in mb)
    if not s.aipo.entropy_coef:
        entropy = entropy.detach() if s.log_entropy else None
    mask, segments = mb["loss_mask"], mb.get("segments")
    # Per sequence in padded rows, per token in packed ones (`training.packing`).
    adv = mb["adv"].unsqueeze(1).expand_as(logp_pi) if mb["adv"].dim() == 1 else mb["adv"]
    # Outside the mask, keep the arithmetic finite (those positions are zeroed below anyway).
    logp_mu = torch.where(mask, mb["logp_mu"], logp_pi.detach())
    loss_tok, stats = aipo_token_loss(logp_pi, logp_mu, adv, s.aipo, mb.get("logp_ref"), entropy, mask=mask,
                                      segments=segments)
    loss_tok = torch.where(mask, loss_tok, torch.zeros_like(loss_tok))
    loss_sum, count = normalize(loss_tok, mask, s.aipo.normalization, segments)
    return loss_sum, count.to(torch.int64), TokenStats.of_micro_batch(stats, mask)


class RLTrainer:
    """AIPO training of one trainer executor rank (every rank of the executor calls `step` with the same batch).

    With `algorithm.kl_coef > 0`, a frozen reference model (`training.reference.make_reference`) must be set, at
    construction or with `set_reference` (e.g. after a supervised warm start), before the first `step`.
    """

    def __init__(self, model: torch.nn.Module, model_cfg: ModelConfig, groups: ExecutorGroups,
                 settings: RLTrainerSettings, reference_model: Optional[torch.nn.Module] = None):
        self.cfg = model_cfg
        self.groups = groups
        self.pgs = groups.pgs
        self.settings = settings
        if model_cfg.is_moe:  # the MoE layers read their load-balancing loss's coefficient from the config
            model.config.moe_aux_loss_coeff = settings.trainer.moe_aux_loss_coeff
        self.engine = TrainEngine.create(model, self.pgs, settings.trainer, settings.schedule)
        self.reference: Optional[torch.nn.Module] = None
        if reference_model is not None:
            self.set_reference(reference_model)

    def set_reference(self, model: torch.nn.Module) -> None:
        """Use `model` (same architecture and layout as the policy) as the KL reference; it is frozen here."""
        self.reference = freeze(model)

    @property
    def model(self):
        return self.engine.model

    def _reference_logprobs(self, micro_batches: list[dict]) -> None:
        def loss_fn(logits, mb):
            mb["logp_ref"] = target_logprobs(logits, mb["tokens"], self.pgs.tp, self.cfg.vocab_size,
                                             self.settings.temperature, mask=mb["loss_mask"],
                                             logits_at_mask="logit_positions" in mb).detach()
            zero = logits.new_zeros(())
            return zero, torch.ones((), dtype=torch.int64, device=zero.device), {}

        with torch.no_grad():
            run_schedule(self.reference, self.pgs, micro_batches, loss_fn, forward_only=True,
                         needs_mask=self.engine.needs_mask)

    def micro_batches(self, batch: RolloutBatch) -> list[dict]:
        """This rank's micro-batches of `batch`: packed (`trainer.packing`) or padded, as the module says."""
        t, layout = self.settings.trainer, self.groups.layout
        if not t.routing_replay and batch.routes is not None:  # the trainer's own routing
            batch = replace(batch, routes=None)
        seq_len = padded_seq_len(batch.tokens.shape[1])
        if t.packing:
            budget = t.max_tokens_per_micro_batch or t.micro_batch_size * seq_len
            out = packed_micro_batches(batch, layout.dp, self.groups.dp_rank, budget, current_device())
        else:
            mine = shard_for_dp(batch, layout.dp, self.groups.dp_rank)
            out = make_micro_batches(mine, t.micro_batch_size, seq_len)
        if self.cfg.is_moe:
            for mb in out:
                self._load_balancing_inputs(mb)
        return out

    def _load_balancing_inputs(self, mb: dict) -> None:
        """A mixture of experts' micro-batch gets what its load-balancing loss needs (`models.moe.balancing`): its
        real tokens (those of a sequence, not padding) and its weight, its loss count (the `count` of
        `aipo_microbatch_loss`: response tokens or sequences, as `algorithm.normalization` says). The engine
        divides the gradients by the step's loss count, so the layers' losses enter the step averaged over
        micro-batches with the policy loss's own weights."""
        if "segments" in mb:
            mb["real_tokens"] = mb["segments"] >= 0
        mask = mb["loss_mask"]
        _, count = normalize(torch.zeros(mask.shape, device=mask.device), mask, self.settings.aipo.normalization,
                             mb.get("segments"))
        mb["moe_aux_weight"] = count.float()

    def moe_aux_loss(self) -> float:
        """The load-balancing loss of the step just taken (a mixture of experts): each MoE layer's switch loss
        (`models.moe.switch_balancing_loss`) averaged over the step's micro-batches of every DP rank with the
        policy loss's weights (their loss counts), then over layers; 1 when every layer is perfectly balanced, up
        to experts / k. Every rank of the executor learns it: TP ranks' shares summed, DP ranks' and stages'
        sums added."""
        stats = take_balance_stats(self.model, self.cfg.num_layers).to(current_device() or "cpu")
        share = stats[0].clone()
        dist.all_reduce(share, group=self.pgs.tp)
        both = torch.stack([share, stats[1]])
        for group in (self.pgs.dp_cp, self.pgs.pp):
            dist.all_reduce(both, group=group)
        both = both.cpu()
        if not bool((both[1] > 0).all()):
            return math.nan
        return float((both[0] / both[1]).mean())

    def step(self, batch: RolloutBatch) -> dict:
        """One AIPO update from a global batch (every rank passes the same batch; each takes its DP share)."""
        t0 = time.perf_counter()
        micro = self.micro_batches(batch)
        if self.settings.aipo.kl_coef:
            if self.reference is None:
                raise ValueError("algorithm.kl_coef > 0 needs a reference model (RLTrainer.set_reference)")
            self._reference_logprobs(micro)
        outputs = []

        def loss_fn(logits, mb):
            loss_sum, count, stats = aipo_microbatch_loss(logits, mb, self.pgs.tp, self.cfg.vocab_size,
                                                          self.settings)
            outputs.append(stats)
            return loss_sum, count, {"loss": torch.stack([loss_sum.detach().float(), count.float()])}

        reduced: dict[str, float] = {}

        def token_stats() -> dict[str, float]:
            """The step's token statistics, reduced once (a collective every rank reaches at the same point): the
            last stage holds the numbers, summed over DP, then shared over the pipeline. The step guard reads them
            before the update."""
            if not reduced:
                reduced.update(TokenStats.reduce(outputs, [self.pgs.dp_cp, self.pgs.pp], device=current_device()))
            return reduced

        metrics = self.engine.step(micro, loss_fn, guard_stats=token_stats)
        metrics.update(token_stats())
        if self.cfg.is_moe:
            metrics["moe_aux_loss"] = self.moe_aux_loss()
        elapsed = time.perf_counter() - t0
        metrics["step_time_s"] = elapsed
        metrics["tokens_per_s"] = float(batch.response_lengths.sum() + batch.prompt_lengths.sum()) / elapsed
        metrics["response_length"] = float(batch.response_lengths.float().mean())
        return metrics

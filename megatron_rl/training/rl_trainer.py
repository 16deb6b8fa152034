"""The trainer executor's RL step: AIPO on rollouts, inside Megatron-Core's training loop.

Variable lengths are handled by padding, not packing: every micro-batch of a step is right-padded to the
step's longest sequence (rounded up to a multiple of 8), because Megatron-Core's pipeline schedule exchanges
fixed-shape activations between stages, and packed sequences (THD) need transformer-engine's attention.
Padding positions carry no loss and, with causal attention, do not influence real positions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.algorithms.aipo import AIPOSettings, aipo_token_loss, normalize
from megatron_rl.models.presets import ModelConfig
from megatron_rl.parallel.topology import ExecutorGroups
from megatron_rl.rollout import RolloutBatch
from megatron_rl.training.engine import OptimSettings, TrainEngine, _device, run_schedule
from megatron_rl.training.logprobs import target_logprobs, target_logprobs_and_entropy

# Statistics summed over response tokens and reported as means, and statistics reported as their maximum; each
# micro-batch's report is [loss sum, count, tokens, *token sums, *maxima] (`aipo_microbatch_loss`).
_TOKEN_STATS = ("ratio", "truncated", "kl_mu_pi", "entropy", "kl_ref", "abs_log_ratio")
_MAX_STATS = ("ratio", "abs_log_ratio")
_REPORTED = {"ratio": "is_weight", "truncated": "is_truncated_frac", "kl_mu_pi": "kl_mu_pi", "entropy": "entropy",
             "kl_ref": "kl_ref", "abs_log_ratio": "logp_diff"}


@dataclass
class RLTrainerSettings:
    micro_batch_size: int = 8
    temperature: float = 1.0
    aipo: AIPOSettings = field(default_factory=AIPOSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    log_entropy: bool = True


def shard_for_dp(batch: RolloutBatch, dp: int, dp_rank: int) -> RolloutBatch:
    """This DP rank's responses: a contiguous, near-equal share (array_split)."""
    parts = torch.arange(batch.size).tensor_split(dp)
    return batch.select(parts[dp_rank])


def micro_batch_rows(n: int, micro_batch_size: int) -> int:
    """Rows per micro-batch for n sequences: as few micro-batches as `micro_batch_size` allows, evenly filled
    (65 sequences at most 64 per micro-batch -> 2 of 33, not 2 of 64), so padding rows cost at most one per
    micro-batch instead of up to a whole micro-batch."""
    count = max(-(-n // micro_batch_size), 1)
    return max(-(-n // count), 1)


def make_micro_batches(batch: RolloutBatch, micro_batch_size: int, seq_len: int, pad_id: int = 0) -> list[dict]:
    """Micro-batches of equal shape [rows, seq_len], rows = `micro_batch_rows` (at most micro_batch_size);
    missing rows are padding with no loss."""
    n = batch.size
    micro_batch_size = micro_batch_rows(n, micro_batch_size)
    rows = max(-(-n // micro_batch_size), 1) * micro_batch_size
    s = batch.tokens.shape[1]
    if seq_len < s:
        raise ValueError(f"seq_len {seq_len} is shorter than the batch's {s}")
    tokens = torch.full((rows, seq_len), pad_id, dtype=torch.long)
    tokens[:n, :s] = batch.tokens
    mask = torch.zeros(rows, seq_len, dtype=torch.bool)
    mask[:n, :s] = batch.response_mask()
    mask[:, 0] = False  # position 0 is never a target
    logp_mu = torch.zeros(rows, seq_len)
    logp_mu[:n, :s] = batch.behaviour_logprobs
    adv = torch.zeros(rows)
    if batch.advantages is None:
        raise ValueError("the batch has no advantages; compute them before training")
    adv[:n] = batch.advantages
    device = _device()
    out = []
    for i in range(0, rows, micro_batch_size):
        sl = slice(i, i + micro_batch_size)
        out.append({k: v[sl].to(device) if device is not None else v[sl]
                    for k, v in (("tokens", tokens), ("loss_mask", mask), ("logp_mu", logp_mu), ("adv", adv))})
    return out


def aipo_microbatch_loss(logits: torch.Tensor, mb: dict, tp_group, vocab_size: int, settings: RLTrainerSettings):
    """AIPO on one micro-batch of vocab-parallel logits: (loss sum, count, statistics vector).

    `mb` holds tokens, loss_mask (response positions), logp_mu (behaviour log-probs aligned with tokens),
    adv (per sequence) and optionally logp_ref. Positions outside loss_mask contribute neither loss nor gradient.
    """
    s = settings
    # One pass over the vocabulary gives both; the entropy only carries gradient when it is in the loss.
    logp_pi, entropy = target_logprobs_and_entropy(logits, mb["tokens"], tp_group, vocab_size, s.temperature,
                                                   mask=mb["loss_mask"])
    if not s.aipo.entropy_coef:
        entropy = entropy.detach() if s.log_entropy else None
    mask = mb["loss_mask"]
    adv = mb["adv"].unsqueeze(1).expand_as(logp_pi)
    # Outside the mask, keep the arithmetic finite (those positions are zeroed below anyway).
    logp_mu = torch.where(mask, mb["logp_mu"], logp_pi.detach())
    loss_tok, stats = aipo_token_loss(logp_pi, logp_mu, adv, s.aipo, mb.get("logp_ref"), entropy)
    loss_tok = torch.where(mask, loss_tok, torch.zeros_like(loss_tok))
    loss_sum, count = normalize(loss_tok, mask, s.aipo.normalization)
    fmask = mask.to(torch.float32)
    report = [loss_sum.detach().float(), count.float(), fmask.sum()]
    for name in _TOKEN_STATS:
        v = stats.get(name)
        report.append((v.float() * fmask).sum() if v is not None else fmask.new_zeros(()))
    for name in _MAX_STATS:
        report.append((stats[name] * fmask).max().float() if fmask.any() else fmask.new_zeros(()))
    return loss_sum, count.to(torch.int64), torch.stack(report)


class RLTrainer:
    """AIPO training of one trainer executor rank (every rank of the executor calls `step` with the same batch)."""

    def __init__(self, model: torch.nn.Module, model_cfg: ModelConfig, groups: ExecutorGroups,
                 settings: RLTrainerSettings, reference_model: Optional[torch.nn.Module] = None):
        if settings.aipo.kl_coef and reference_model is None:
            raise ValueError("algorithm.kl_coef > 0 needs a reference model")
        self.cfg = model_cfg
        self.groups = groups
        self.pgs = groups.pgs
        self.settings = settings
        self.engine = TrainEngine.create(model, self.pgs, settings.optim)
        self.reference = reference_model
        if reference_model is not None:
            for p in reference_model.parameters():
                p.requires_grad_(False)
            reference_model.eval()

    @property
    def model(self):
        return self.engine.model

    def _reference_logprobs(self, micro_batches: list[dict]) -> None:
        def loss_fn(logits, mb):
            mb["logp_ref"] = target_logprobs(logits, mb["tokens"], self.pgs.tp, self.cfg.vocab_size,
                                             self.settings.temperature, mask=mb["loss_mask"]).detach()
            zero = logits.new_zeros(())
            return zero, torch.ones((), dtype=torch.int64, device=zero.device), {}

        with torch.no_grad():
            run_schedule(self.reference, self.pgs, micro_batches, loss_fn, forward_only=True,
                         needs_mask=self.engine.needs_mask)

    def step(self, batch: RolloutBatch) -> dict:
        """One AIPO update from a global batch (every rank passes the same batch; each takes its DP share)."""
        t0 = time.perf_counter()
        layout = self.groups.layout
        mine = shard_for_dp(batch, layout.dp, self.groups.dp_rank)
        seq_len = -(-batch.tokens.shape[1] // 8) * 8
        micro = make_micro_batches(mine, self.settings.micro_batch_size, seq_len)
        if self.reference is not None and self.settings.aipo.kl_coef:
            self._reference_logprobs(micro)
        outputs = []

        def loss_fn(logits, mb):
            loss_sum, count, stats = aipo_microbatch_loss(logits, mb, self.pgs.tp, self.cfg.vocab_size,
                                                          self.settings)
            outputs.append(stats)
            return loss_sum, count, {"loss": torch.stack([loss_sum.detach().float(), count.float()])}

        metrics = self.engine.step(micro, loss_fn)
        metrics.update(self._reduce_stats(outputs))
        elapsed = time.perf_counter() - t0
        metrics["step_time_s"] = elapsed
        metrics["tokens_per_s"] = float(batch.response_lengths.sum() + batch.prompt_lengths.sum()) / elapsed
        metrics["response_length"] = float(batch.response_lengths.float().mean())
        return metrics

    def _reduce_stats(self, outputs: list[torch.Tensor]) -> dict:
        """Token means and maxima over the step (all micro-batches and DP ranks). `logp_diff_mean` / `_max` are
        |logp_pi - logp_mu| over response tokens: the trainer-generator numeric gap when the batch was generated
        with the trainer's current weights (staleness 0), plus the policy's drift when it is older."""
        n = 3 + len(_TOKEN_STATS)
        total = torch.zeros(n, dtype=torch.float64, device=_device())
        maxima = torch.zeros(len(_MAX_STATS), dtype=torch.float64, device=_device())
        for o in outputs:
            total += o[:n].double().to(total.device)
            maxima = torch.maximum(maxima, o[n:].double().to(total.device))
        # Last stage holds the numbers: sum over DP, then share over the pipeline.
        dist.all_reduce(total, group=self.pgs.dp_cp)
        dist.all_reduce(total, group=self.pgs.pp)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.pgs.dp_cp)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.pgs.pp)
        total, maxima = total.cpu(), maxima.cpu()
        tokens = max(float(total[2]), 1.0)
        out = {"response_tokens": float(total[2])}
        for i, name in enumerate(_TOKEN_STATS):
            key = _REPORTED[name]
            out[key + "_mean" if name in _MAX_STATS else key] = float(total[3 + i]) / tokens
        for i, name in enumerate(_MAX_STATS):
            out[_REPORTED[name] + "_max"] = float(maxima[i])
        return out

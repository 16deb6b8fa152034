"""The step guard: an RL update whose statistics spike far outside their recent history is skipped, and the steps
after it taken smaller, or has its gradient scaled down, as large pretraining runs skip or clip loss spikes; a run of
skipped steps stops the job before the policy collapses for good.

What an RL run drifts into before it collapses (docs/benchmarks.md, "The collapse guard"): one update far larger than
its neighbours (its gradient norm 10-15x theirs), after which the trainer-generator log-prob gap of the next batches
(the policy's move in one step, at staleness 1) jumps from its usual 0.001-0.02 nats per token to 0.05-0.6, the
entropy falls and the reward with it, and it does not come back. The guard watches the statistics the step already
measures before the optimizer applies it:

    grad_norm        the gradient's norm (before clipping)
    logp_diff_mean   the mean |logp_pi - logp_mu| over the batch's response tokens
    kl_mu_pi         the mean of logp_mu - logp_pi (the KL of the behaviour policy from the trainer's)

Two kinds of spike, two answers. A gap or KL more than `factor` times its median over the last `WINDOW` steps taken
(a median of at least `FLOORS`; from the second RL step on: SmolLM2's calculator recipe at twice its learning rate
had moved 0.13 nats a token after one update, and collapsed within 8) says the last update moved the policy too far: the step is skipped (no update, no scheduler step), and the step size
of the steps after it is halved (`lr_scale`, applied to the scheduler's learning rate), which each step taken
restores by a factor of 2^(1/`RECOVERY_STEPS`). Skipping alone is not enough: at 1e-3 the guessing game's updates,
once they had grown too large, alternated with skipped steps (each taken step moved the policy too far, each next
one was skipped) and the policy collapsed between them; a smaller step keeps the next gap in its band. A gradient
norm more than `factor` times its median says only that this batch pulls harder: the step is taken with its gradient
scaled down to `factor` times the median (an adaptive clip), and that norm joins the history. Skipping such steps
was measured to stop a healthy run: once the policy had moved, its batches kept a norm 6-8x the old median while the
gap and the reward stayed where they were, and five skips in a row ended it. The gradient norm has no scale of its
own: it is judged only after `MIN_HISTORY` steps taken. When the step size has been halved `max_halvings` times more than the steps taken have restored (that
many skipped steps in a row, or in short succession), the guard raises `CollapseError`: at 1/2^max_halvings of its
learning rate the run is not learning, and going on would train a policy that is no longer the one the run learned.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Optional

WINDOW = 20  # accepted steps whose median is the reference
MIN_HISTORY = 10  # accepted steps before any step is guarded
RECOVERY_STEPS = 10  # steps taken that undo one halving of the step size
# The smallest median the factor multiplies: a healthy run's gap and KL sit near the numeric noise (0.001-0.01
# nats), where a factor alone would flag noise; 0.01 x 5 = 0.05 nats is the least gap a step is skipped for.
FLOORS = {"grad_norm": 0.0, "logp_diff_mean": 0.01, "kl_mu_pi": 0.01}
NAMES = {"grad_norm": "the gradient norm", "logp_diff_mean": "the trainer-generator log-prob gap",
         "kl_mu_pi": "the KL of the behaviour policy"}


class CollapseError(RuntimeError):
    """The step guard halved the step size too often: the run's statistics left their history and stayed out."""


@dataclass
class Verdict:
    """What the guard makes of a step: take it (with its gradient scaled by `grad_scale`, 1 or less) or skip it;
    `reason` is the one line saying why it acted (None when it did not)."""

    skip: bool = False
    grad_scale: float = 1.0
    reason: Optional[str] = None


@dataclass
class StepGuard:
    """Decides, from a step's statistics, whether and how to take it (`check`) and at what fraction of the learning
    rate (`lr_scale`); its state (the history, the scale, the counters) is part of a checkpoint (`state_dict`), so a
    resumed run guards as the uninterrupted one would."""

    factor: float
    max_halvings: int
    history: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in FLOORS})
    lr_scale: float = 1.0
    in_a_row: int = 0
    total: int = 0

    def check(self, values: dict[str, float]) -> Verdict:
        """The step's verdict (module docstring); a step taken adds its values to the history. Raises CollapseError
        when the step size has been halved `max_halvings` times net."""
        drift = self._spike(values, ("logp_diff_mean", "kl_mu_pi"))
        if drift is not None:
            return self._skip(drift)
        self.in_a_row = 0
        self.lr_scale = min(1.0, self.lr_scale * 2 ** (1 / RECOVERY_STEPS))
        verdict = Verdict()
        pull = self._spike(values, ("grad_norm",))
        if pull is not None:
            target = self.factor * statistics.median(self.history["grad_norm"])
            verdict = Verdict(grad_scale=target / values["grad_norm"],
                              reason=f"{pull}; its gradient scaled to {target:.4g} (taken)")
            values = {**values, "grad_norm": target}
        for name in FLOORS:
            v = values[name]
            if name != "grad_norm" or v > 0:  # a step without signal (zero advantages) has no gradient
                self.history[name] = (self.history[name] + [v])[-WINDOW:]
        return verdict

    def _skip(self, reason: str) -> Verdict:
        self.in_a_row += 1
        self.total += 1
        self.lr_scale /= 2
        if self.lr_scale <= 2 ** -self.max_halvings * 1.0001:  # (the restoring factor's roundings)
            raise CollapseError(f"the collapse guard skipped {self.total} RL steps ({self.in_a_row} in a row) and "
                                f"halved the step size to 1/{round(1 / self.lr_scale)} of the learning rate (limit "
                                f"trainer.max_guarded_steps={self.max_halvings} halvings); the last: {reason}. The "
                                f"policy is collapsing")
        return Verdict(skip=True, reason=f"{reason}; skipped, the next steps at {self.lr_scale:.3g}x the learning "
                                         f"rate")

    def _spike(self, values: dict[str, float], names: tuple[str, ...]) -> Optional[str]:
        for name in names:
            past = self.history[name]
            if not past or (name == "grad_norm" and len(past) < MIN_HISTORY):
                continue
            median = statistics.median(past)
            v = values[name]
            ref = max(median, FLOORS[name])
            if v > self.factor * ref:
                what = "its median" if median >= FLOORS[name] else f"{ref:g}, the least median it is compared with"
                return (f"{NAMES[name]} ({name} {v:.4g}) is {v / ref:.1f}x {what} (median over the last {len(past)} "
                        f"steps {median:.4g}; trainer.spike_factor={self.factor:g})")
        return None

    def state_dict(self) -> dict:
        return {"history": {k: list(v) for k, v in self.history.items()}, "lr_scale": self.lr_scale,
                "in_a_row": self.in_a_row, "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.history = {k: list(state["history"].get(k, [])) for k in FLOORS}
        self.lr_scale = float(state["lr_scale"])
        self.in_a_row, self.total = int(state["in_a_row"]), int(state["total"])

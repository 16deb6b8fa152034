"""The step guard: an RL update whose statistics spike far outside their recent history is skipped, as large
pretraining runs skip loss spikes, and the steps after it are taken smaller; a run of such steps stops the job before
the policy collapses for good.

What an RL run drifts into before it collapses (docs/benchmarks.md, "The collapse guard"): one update far larger than
its neighbours (its gradient norm 10-15x theirs), after which the trainer-generator log-prob gap of the next batches
(the policy's move in one step, at staleness 1) jumps from its usual 0.001-0.02 nats per token to 0.05-0.6, the
entropy falls and the reward with it, and it does not come back. The guard watches the statistics the step already
measures before the optimizer applies it:

    grad_norm        the gradient's norm (before clipping)
    logp_diff_mean   the mean |logp_pi - logp_mu| over the batch's response tokens
    kl_mu_pi         the mean of logp_mu - logp_pi (the KL of the behaviour policy from the trainer's)

A step is guarded when one of them is more than `factor` times its median over the last `WINDOW` accepted steps, and
above its floor (`FLOORS`: the gap and KL of a healthy run sit near the numeric noise, where a factor alone would
flag noise); no step is guarded before `MIN_HISTORY` accepted ones. A guarded step changes nothing (no update, no
scheduler step) and leaves the history as it was, so a spike cannot become the new normal; and it halves the step
size of the steps after it (`lr_scale`, applied to the scheduler's learning rate), which each step taken restores by
a factor of 2^(1/`RECOVERY_STEPS`). Skipping alone is not enough: at 1e-3 the guessing game's updates, once they had
grown too large, alternated with guarded steps (each taken step moved the policy too far, each next one was skipped)
and the policy collapsed between them; a smaller step is what keeps the next gap in its band. When the guard has
halved the step size `max_halvings` times more than the steps taken have restored (that many guarded steps in a row,
or in short succession), it raises `CollapseError`: at 1/2^max_halvings of its learning rate the run is not
learning, and going on would train a policy that is no longer the one the run learned.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Optional

WINDOW = 20  # accepted steps whose median is the reference
MIN_HISTORY = 10  # accepted steps before any step is guarded
RECOVERY_STEPS = 10  # steps taken that undo one halving of the step size
FLOORS = {"grad_norm": 0.0, "logp_diff_mean": 0.02, "kl_mu_pi": 0.02}  # below these a step is never guarded
NAMES = {"grad_norm": "the gradient norm", "logp_diff_mean": "the trainer-generator log-prob gap",
         "kl_mu_pi": "the KL of the behaviour policy"}


class CollapseError(RuntimeError):
    """The step guard halved the step size too often: the run's statistics left their history and stayed out."""


@dataclass
class StepGuard:
    """Decides, from a step's statistics, whether to take it (`check`) and at what fraction of the learning rate
    (`lr_scale`); its state (the history, the scale, the counters) is part of a checkpoint (`state_dict`), so a
    resumed run guards as the uninterrupted one would."""

    factor: float
    max_halvings: int
    history: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in FLOORS})
    lr_scale: float = 1.0
    in_a_row: int = 0
    total: int = 0

    def check(self, values: dict[str, float]) -> Optional[str]:
        """None to take the step (its values join the history), or why it is skipped (one line). Raises
        CollapseError when the step size has been halved `max_halvings` times net."""
        reason = self._spike(values)
        if reason is None:
            self.in_a_row = 0
            self.lr_scale = min(1.0, self.lr_scale * 2 ** (1 / RECOVERY_STEPS))
            for name in FLOORS:
                v = values[name]
                if name != "grad_norm" or v > 0:  # a step without signal (zero advantages) has no gradient
                    self.history[name] = (self.history[name] + [v])[-WINDOW:]
            return None
        self.in_a_row += 1
        self.total += 1
        self.lr_scale /= 2
        if self.lr_scale <= 2 ** -self.max_halvings * 1.0001:  # (the restoring factor's roundings)
            raise CollapseError(f"the collapse guard skipped {self.total} RL steps ({self.in_a_row} in a row) and "
                                f"halved the step size to 1/{round(1 / self.lr_scale)} of the learning rate (limit "
                                f"trainer.max_guarded_steps={self.max_halvings} halvings); the last: {reason}. The "
                                f"policy is collapsing")
        return f"{reason}; the next steps at {self.lr_scale:.3g}x the learning rate"

    def _spike(self, values: dict[str, float]) -> Optional[str]:
        for name, floor in FLOORS.items():
            past = self.history[name]
            if len(past) < MIN_HISTORY:
                continue
            median = statistics.median(past)
            v = values[name]
            if v > floor and v > self.factor * max(median, 0.0):
                times = f"{v / median:.1f}x" if median > 0 else "far above"
                return (f"{NAMES[name]} ({name} {v:.4g}) is {times} its median over the last {len(past)} steps "
                        f"({median:.4g}; trainer.spike_factor={self.factor:g})")
        return None

    def state_dict(self) -> dict:
        return {"history": {k: list(v) for k, v in self.history.items()}, "lr_scale": self.lr_scale,
                "in_a_row": self.in_a_row, "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.history = {k: list(state["history"].get(k, [])) for k in FLOORS}
        self.lr_scale = float(state["lr_scale"])
        self.in_a_row, self.total = int(state["in_a_row"]), int(state["total"])

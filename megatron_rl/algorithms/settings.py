"""The `algorithm` section: AIPO's loss (`algorithms/aipo.py`) and the advantage estimator (`advantages.py`).
Imports nothing heavy, so that a configuration is checked without torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

from megatron_rl.settings import Section, ranged


@dataclass
class AIPOSettings(Section):
    """How the trainer learns from rollouts a stale generator sampled (`aipo.py` has the formulas). `correction`:
    how the behaviour policy mu enters the loss when `importance_weights` is true: "truncate" (AIPO: the weight
    pi/mu, truncated at rho), "mask" (the weight pi/mu, tokens with it outside [1/rho, rho] dropped), "decoupled"
    (AReaL: the weight pi_prox/mu, tokens with it above rho dropped, and PPO's clip of pi/pi_prox), "sequence" (one
    weight per response, the geometric mean of pi/mu over its tokens, truncated at rho). `ppo_clip` switches
    "truncate" to PPO's clipped surrogate of pi/mu, and is the clip of "decoupled" (0.2 when unset). `kl_coef` and
    `entropy_coef` add a KL penalty to a frozen reference and an entropy bonus."""

    SECTION: ClassVar[str] = "algorithm"
    name: Literal["aipo"] = "aipo"
    rho: float = ranged(4.0, ">= 1", "(importance weights are truncated at rho)")
    advantage: Literal["group_mean", "rloo", "grpo"] = "group_mean"
    normalization: Literal["token", "sequence"] = "token"
    ppo_clip: Optional[float] = ranged(None, "> 0")
    kl_coef: float = ranged(0.0, ">= 0")
    entropy_coef: float = 0.0  # either sign
    # false: ignore the behaviour policy (weights of 1, as if every sample were on-policy): the uncorrected
    # baseline of the staleness study, not a setting to train with.
    importance_weights: bool = True
    correction: Literal["truncate", "mask", "decoupled", "sequence"] = "truncate"
    # The collapse guard's token band: a token whose |logp_pi - logp_mu| exceeds token_band nats (a ratio beyond
    # e^3 = 20 either way) carries no policy gradient, whatever the correction, and is counted (`band_masked_frac`);
    # null: no band. A healthy run's largest gap sits at 0.03-2 nats; a collapsing one's at 4-12.
    token_band: Optional[float] = ranged(3.0, "> 0", "(nats, or null for no band)")
    # Dynamic sampling (DAPO, `controller/dynamic_sampling.py`): a group whose raw rewards are all equal is dropped and
    # its place filled from further prompts, at most dynamic_sampling_rounds refill rounds a batch.
    dynamic_sampling: bool = False
    dynamic_sampling_rounds: int = ranged(4, "in [1, 64]", "(refill rounds a batch)")
    # Overlong shaping (DAPO's soft penalty, `collector.overlong_penalty`): a response within overlong_buffer tokens of
    # its limit loses up to overlong_penalty of its reward, linearly, in the advantages only (0: off).
    overlong_buffer: int = ranged(0, ">= 0", "(tokens, or 0 for no shaping)")
    overlong_penalty: float = ranged(1.0, ">= 0")

    def rules(self, path: str) -> list[str]:
        out = []
        if self.ppo_clip is not None and not self.importance_weights:
            out.append(f"{path}.ppo_clip needs {path}.importance_weights=true (its ratio is pi / mu)")
        if self.correction != "truncate" and not self.importance_weights:
            out.append(f"{path}.correction={self.correction!r} needs {path}.importance_weights=true (false ignores "
                       f"the behaviour policy)")
        elif self.ppo_clip is not None and self.correction in ("mask", "sequence"):
            out.append(f"{path}.ppo_clip applies to {path}.correction 'truncate' (PPO's clip of pi/mu) or "
                       f"'decoupled' (its clip of pi/pi_prox), not {self.correction!r}")
        return out

    def job_problems(self, path: str, reward_model: bool, agent: bool, longest: int) -> list[str]:
        """What the rest of the job (a reward-model executor, `env.agent`, the longest response
        `longest`) rules out here."""
        out = []
        if self.dynamic_sampling and (reward_model or agent):
            out.append(f"{path}.dynamic_sampling=true filters on the rewards a replica computes as it samples: not "
                       f"with a reward-model executor or env.agent")
        if self.overlong_buffer >= longest:
            out.append(f"{path}.overlong_buffer={self.overlong_buffer} must be less than the longest response "
                       f"({longest} tokens)")
        return out

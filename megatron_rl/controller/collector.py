"""The controller's bookkeeping on rank 0: scored rollouts in, training batches with advantages and metric rows out.

Generator replicas send one `ScoredRollouts` per batch, in batch order (`controller/scoring.py`). The collector
waits for every replica's part of batch k (and, with a reward-model executor, adds its scores to each part),
hands the parts over once (`take`); `batch_with_advantages` packs them into one `RolloutBatch` and computes the
advantages over the whole batch, and after the trainer's step `metrics_row` turns the step's statistics into the row
written to metrics.jsonl. Batches generated before a checkpoint but trained after it are stored with the checkpoint
(`pending`) and handed back on resume (`restore`): they cannot be regenerated, since the weights that produced them
are gone.

It talks to the world only through the `receive(rank)` function it is given, so it runs in one process in tests.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from megatron_rl.algorithms import compute_advantages
from megatron_rl.controller.scoring import ScoredRollouts, with_model_scores
from megatron_rl.rollout import RolloutBatch
from megatron_rl.training.rl_trainer import step_metrics


def pack(rollouts: list[ScoredRollouts], pad_id: int) -> RolloutBatch:
    """One right-padded batch of every replica's responses; behaviour log-probs at the response positions. Each
    tensor is built from padded lists in one call (a copy per row would cost a tensor operation per sequence)."""
    prompts = [p for r in rollouts for p in r.prompt_ids]
    tokens = [t for r in rollouts for t in r.token_ids]
    lps = [lp for r in rollouts for lp in r.logprobs]
    s = max(len(p) + len(t) for p, t in zip(prompts, tokens))
    toks = torch.tensor([p + t + [pad_id] * (s - len(p) - len(t)) for p, t in zip(prompts, tokens)],
                        dtype=torch.long)
    logp = torch.tensor([[0.0] * len(p) + list(lp) + [0.0] * (s - len(p) - len(t))
                         for p, t, lp in zip(prompts, tokens, lps)], dtype=torch.float32)
    rewards = torch.tensor([x for r in rollouts for x in r.rewards])
    groups = torch.tensor([x for r in rollouts for x in r.group_ids])
    versions = torch.tensor([min(v, default=r.version) for r in rollouts  # a sample's oldest token's version
                             for v in (r.token_versions or [[]] * len(r.rewards))])
    policy = None
    if any(r.policy_masks is not None for r in rollouts):  # episodes: observations inside the responses
        masks = [m if m is not None else [True] * len(t)  # (a request the generator refused has none)
                 for r in rollouts for m, t in zip(r.policy_masks or [None] * len(r.token_ids), r.token_ids)]
        policy = torch.tensor([[False] * len(p) + list(m) + [False] * (s - len(p) - len(m))
                               for p, m in zip(prompts, masks)], dtype=torch.bool)
    return RolloutBatch(toks, torch.tensor([len(p) for p in prompts]), torch.tensor([len(t) for t in tokens]),
                        logp, rewards, groups, versions, policy_mask=policy, routes=pack_routes(rollouts, s))


def pack_routes(rollouts: list[ScoredRollouts], s: int) -> Optional[torch.Tensor]:
    """Every sample's recorded routes right-padded to [n, s, layers, k] (padding, and a sample without routes, hold
    placeholders: experts 0..k-1), or None when none was recorded (routing replay off, or a dense model). A batch
    without routes beside others with them is one whose every request the generator refused (`_routes`)."""
    per_sample = [x for r in rollouts for x in (r.routes or [None] * len(r.token_ids))]
    have = [x for x in per_sample if x is not None]
    if not have:
        return None
    _, layers, k = have[0].shape
    out = torch.arange(k, dtype=have[0].dtype).expand(len(per_sample), s, layers, k).clone()
    for i, x in enumerate(per_sample):
        if x is not None:
            out[i, : x.shape[0]] = x
    return out


def overlong_penalty(lengths: torch.Tensor, limit: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong penalty of each response of `lengths` tokens, at most `limit`: 0 up to limit - buffer
    tokens, then falling linearly to -penalty at the limit (`algorithm.overlong_buffer`, `overlong_penalty`)."""
    over = (lengths.float() - (limit - buffer)).clamp(min=0) / buffer
    return -penalty * over.clamp(max=1.0)


def batch_with_advantages(parts: list[ScoredRollouts], pad_id: int, advantage: str,
                          overlong: Optional[tuple[int, int, float]] = None) -> RolloutBatch:
    """Every replica's scored part of one batch, packed (`pack`), with each sample's advantage computed from the
    rewards of its prompt's group (`algorithm.advantage`, `algorithms.compute_advantages`): what the trainer learns
    from. An episode split into several samples (`ScoredRollouts.episode_of`) counts once in its group's statistics,
    and each of its samples takes its advantage. `overlong`: (the longest response, overlong_buffer,
    overlong_penalty): the rewards the advantages are computed from are shaped by `overlong_penalty`; the batch's
    rewards (reported, and what dynamic sampling filtered on) stay the task's."""
    batch = pack(parts, pad_id)
    rewards = batch.rewards
    if overlong is not None and overlong[1] > 0:
        rewards = rewards + overlong_penalty(batch.response_lengths, *overlong)
    if not any(p.episode_of for p in parts):
        batch.advantages = compute_advantages(rewards, batch.group_ids, advantage)
        return batch
    episode_of, at = [], 0
    for p in parts:
        episode_of += [at + j for j in (p.episode_of or range(len(p.rewards)))]
        at += len(p.rewards)
    of = torch.tensor(episode_of)
    own = torch.nonzero(of == torch.arange(len(episode_of))).squeeze(1)
    per_episode = torch.zeros(len(episode_of))
    per_episode[own] = compute_advantages(rewards[own], batch.group_ids[own], advantage)
    batch.advantages = per_episode[of]
    return batch


class Collector:
    """leaders: the ranks of the generator replicas' leaders, in replica order (rank 0 among them when it also
    generates: its parts arrive through `put`, the others' through `receive(rank)`). scorers: with a reward-model
    executor, the rank of the reward-model leader that scores each replica's batches; its `ModelScores`, times
    `model_coef`, are added to the replica's rewards."""

    def __init__(self, leaders: list[int], receive: Callable[[int], object], *,
                 scorers: Optional[list[int]] = None, model_coef: float = 1.0):
        self.leaders = list(leaders)
        self.receive = receive
        self.scorers, self.model_coef = scorers, model_coef
        self._inbox: dict[int, dict[int, ScoredRollouts]] = {}
        self._restored: dict[int, list[ScoredRollouts]] = {}

    def put(self, rollouts: ScoredRollouts) -> None:
        """Rank 0's own replica's part."""
        self._inbox.setdefault(rollouts.batch, {})[0] = rollouts

    def collect(self, k: int) -> list[ScoredRollouts]:
        """Every replica's part of batch k (received now unless already here), with the reward-model executor's
        scores added where the job has one. Each replica sends its batches in order, so the next message from a
        leader is its oldest unread batch."""
        if k in self._restored:
            return self._restored[k]
        have = self._inbox.setdefault(k, {})
        for replica, leader in enumerate(self.leaders):
            part = have.get(leader)
            if part is None:
                if leader == 0:
                    raise RuntimeError(f"batch {k} was never produced on rank 0")
                part = self.receive(leader)
                if part.batch != k:
                    raise RuntimeError(f"expected rollouts of batch {k} from rank {leader}, got batch {part.batch}")
            if self.scorers is not None and part.reward_model_s is None:
                scores = self.receive(self.scorers[replica])
                if (scores.batch, scores.replica) != (k, replica):
                    raise RuntimeError(f"expected reward-model scores of batch {k}, replica {replica} from rank "
                                       f"{self.scorers[replica]}, got batch {scores.batch}, replica {scores.replica}")
                part = with_model_scores(part, scores, self.model_coef)
            have[leader] = part
        return [have[leader] for leader in self.leaders]

    def take(self, k: int) -> list[ScoredRollouts]:
        """Every replica's scored part of batch k (`collect`), then forgotten here: the trainer consumes each batch
        once."""
        parts = self.collect(k)
        self._inbox.pop(k, None)
        self._restored.pop(k, None)
        return parts

    def pending(self, version: int, staleness: int, num_steps: int) -> dict[int, list[dict]]:
        """For a checkpoint after `version` trainer steps: the batches already generated for later steps (version ..
        version + s - 1), received now if need be. Version 0 is saved before any batch exists."""
        last = min(version + staleness, num_steps) if version > 0 else 0
        return {b: [dataclasses.asdict(r) for r in self.collect(b)] for b in range(version, last)}

    def restore(self, pending: dict) -> None:
        """The batches a checkpoint's `pending` holds. Stored whole: they stay valid when the generator's layout
        (its number of replicas) changed."""
        self._restored = {int(b): [ScoredRollouts(**p) for p in parts] for b, parts in pending.items()}


def metrics_row(k: int, parts: list[ScoredRollouts], batch: RolloutBatch, stats: dict, *, train_s: float,
                recv_s: float, kl_ref: bool = False) -> dict:
    """The metrics.jsonl row of trainer step k (the caller adds the step's total time). `kl_ref`: the run has a
    KL reference, so the row reports the policy's KL to it."""
    version = min(p.version for p in parts)
    row = {"step": k, "version_trained": k, "generated_with_version": version, "staleness": k - version,
           "reward": float(batch.rewards.mean()),
           "time/generation_s": max(p.gen_s for p in parts), "time/reward_s": max(p.reward_s for p in parts),
           "time/train_s": train_s, "time/trainer_wait_s": recv_s,
           "time/generator_wait_s": max(p.wait_s for p in parts),
           **({"time/reward_model_s": max(p.reward_model_s for p in parts)}
              if all(p.reward_model_s is not None for p in parts) else {}),
           "reward_failures": sum(p.reward_failures for p in parts),
           **in_flight_metrics(k, parts),
           **sampling_metrics(parts),
           **episode_metrics(parts),
           "samples": [t for p in parts for t in p.texts][:4]}
    evals = [p.eval_reward for p in parts if p.eval_reward is not None]
    if evals:
        row["eval/reward"] = sum(evals) / len(evals)
        row["eval/version"] = version
    for key in step_metrics(with_reference=kl_ref, moe="moe_aux_loss" in stats):
        v = stats.get(key)
        row[key] = float(v) if isinstance(v, (int, float, bool)) else v
    return row


def sampling_metrics(parts: list[ScoredRollouts]) -> dict:
    """With algorithm.dynamic_sampling: the prompts drawn for the batch over every replica (its own and refills) per
    prompt of the batch, and the share of its groups whose raw rewards differ (`controller/dynamic_sampling.py`)."""
    reports = [p.sampling for p in parts if p.sampling is not None]
    if not reports:
        return {}
    groups = sum(r["groups"] for r in reports)
    return {"sampling/prompts_drawn": sum(r["prompts_drawn"] for r in reports) / max(groups, 1),
            "sampling/groups_with_signal": sum(r["with_signal"] for r in reports) / max(groups, 1)}


def in_flight_metrics(k: int, parts: list[ScoredRollouts]) -> dict:
    """The generator's slot occupancy (the lowest replica's; none where every sample had been generated while the
    batch before ran, `LiveGeneration.run`), and with rollout.in_flight the staleness
    of the step's sampled tokens: their mean, and the share older than the newest version any token has."""
    out = {}
    occupancy = [p.occupancy for p in parts if p.occupancy is not None]
    if occupancy:
        out["generator/occupancy"] = min(occupancy)
    versions = [v for p in parts for vs in (p.token_versions or []) for v in vs]
    if versions:
        newest = max(versions)
        out["staleness/token_mean"] = k - sum(versions) / len(versions)
        out["staleness/older_tokens"] = sum(v < newest for v in versions) / len(versions)
    return out


def episode_metrics(parts: list[ScoredRollouts]) -> dict:
    """A step's episode statistics (multi-turn rollouts; none for single responses): model turns per episode, the
    model's and the environments' tokens per episode, the environments' time (the slowest replica's) and their
    failed calls; with agents, the requests that rewrote their conversation (each split its episode)."""
    stats = [p.episodes for p in parts if p.episodes is not None]
    if not stats:
        return {}
    n = max(sum(s["episodes"] for s in stats), 1)
    return {"episode/turns": sum(s["turns"] for s in stats) / n,
            "episode/policy_tokens": sum(s["policy_tokens"] for s in stats) / n,
            "episode/env_tokens": sum(s["env_tokens"] for s in stats) / n,
            "time/env_s": max(s["env_s"] for s in stats),
            "env_failures": sum(s["failures"] for s in stats),
            # agents (env.agent): the requests that rewrote their episode's conversation (each split it)
            **({"episode/rewritten": sum(s["rewritten"] for s in stats)} if any("rewritten" in s for s in stats)
               else {})}

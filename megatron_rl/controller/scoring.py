"""Scoring: every reward a sample gets, and the messages that carry samples and rewards between ranks.

    generator replica's leader   `score`: the task's verifier (or reward function) scores each sample and the
                                 held-out responses -> `ScoredRollouts`, sent to the controller (rank 0);
                                 with a reward-model executor (`reward.executor`), also `score_request` ->
                                 `ScoreRequest`, sent to the leader of the reward-model replica that serves it
    reward-model ranks           `model_scores`: the model's scores of a request, its TP ranks together ->
                                 `ModelScores`, sent to the controller
    controller                   `with_model_scores`: the reward model's scores, times `reward.model_coef`, added
                                 to the verifier's rewards of the replica's `ScoredRollouts`

A sample's reward is therefore the verifier's (an episode's: its return, the sum of its environment's rewards) plus
`model_coef` times the reward model's (either part is 0 where the job has none); the reward model reads an episode
as its first message, rendered, followed by everything after it, the environment's turns included. Advantages come after scoring, over the whole batch, on the controller
(`collector.batch_with_advantages`). An agent's episode whose conversation was rewritten is scored as one sample per
part, each with the episode's return (`split_parts`, on the replica's leader before `score`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Optional

from megatron_rl.controller.tasks import Task


@dataclass
class UnscoredRollouts:
    """A replica's samples of one batch, on its leader, before they are scored (`score` makes them the
    `ScoredRollouts` the controller receives)."""

    batch: int
    version: int
    problems: list  # the task's records, one per sample
    groups: list[int]  # the index of each sample's prompt in the batch
    outputs: list  # SampledResponse per sample
    texts: list[str]  # the decoded responses
    gen_s: float
    returns: Optional[list[float]] = None  # episodes: each one's return (the sum of its turns' rewards)
    episodes: Optional[dict] = None  # episodes: their statistics (`ScoredRollouts.episodes`)
    prompts: Optional[list[str]] = None  # episodes: each one's first message as rendered (the reward model's prompt)
    occupancy: Optional[float] = None  # the generator's occupied slot-steps over all its slot-steps for the batch
    episode_of: Optional[list[int]] = None  # agents' episodes split into parts (`split_parts`)
    # With algorithm.dynamic_sampling the leader scored the samples as it drew them (`controller/dynamic_sampling.py`):
    # their raw rewards, the responses its reward function could not score, and what it drew (`ScoredRollouts.sampling`)
    rewards: Optional[list[float]] = None
    reward_failures: int = 0
    sampling: Optional[dict] = None


@dataclass
class Evaluated:
    """A replica's responses to the held-out problems, on its leader."""

    problems: list
    texts: list[str]
    returns: Optional[list[float]] = None  # episodes: each one's return
    prompts: Optional[list[str]] = None  # episodes: each one's first message as rendered


@dataclass
class ScoredRollouts:
    """What a generator replica sends the controller for one batch: its `UnscoredRollouts` (each an
    `inference.SampledResponse`) with their rewards, as lists. The collector packs every replica's into the step's
    `RolloutBatch` (tensors, with advantages). A checkpoint stores the batches it keeps pending as these fields
    (`dataclasses.asdict`), so their names are part of the checkpoint format."""

    batch: int
    version: int
    prompt_ids: list[list[int]]
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    rewards: list[float]
    group_ids: list[int]
    texts: list[str]
    gen_s: float
    reward_s: float
    # The leader's time at the weight push before this batch: the stop check (an all-reduce over the world, which
    # waits for every rank to reach the push) and the DDMA push itself; 0 for a batch generated without a push.
    wait_s: float
    eval_reward: Optional[float] = None
    reward_failures: int = 0  # responses the reward function could not score (raised, timed out): scored 0.0
    reward_model_s: Optional[float] = None  # the reward-model executor's time on it, once its scores are added
    # Episodes (multi-turn): each sample's policy mask over its token_ids (False at observations), and the batch's
    # episode statistics (`collector.episode_metrics`); None for single responses.
    policy_masks: Optional[list[list[bool]]] = None
    episodes: Optional[dict] = None
    # Routing replay (a mixture-of-experts generator that records): each sample's routes, a uint8/int16 tensor
    # [prompt + response tokens, layers, k] (`inference.SampledResponse.routes`; None for a refused request); None
    # when not recorded. Kept in checkpoints with the pending batches: the trainer replays them.
    routes: Optional[list] = None
    # With rollout.in_flight: the weight version of each sample's every token (`SampledResponse.versions`; `version`
    # is then the oldest of them); None otherwise.
    token_versions: Optional[list[list[int]]] = None
    occupancy: Optional[float] = None  # `UnscoredRollouts.occupancy`
    # Agents' episodes split by a rewritten conversation: for each sample, the index (in this part) of the sample
    # that stands for its episode, whose advantage it takes; None when no episode was split.
    episode_of: Optional[list[int]] = None
    # With algorithm.dynamic_sampling: the prompts the replica drew for the batch, its groups and those with signal
    # (`dynamic_sampling.fill`); None otherwise.
    sampling: Optional[dict] = None


@dataclass
class ScoreRequest:
    """What a generator replica's leader sends the reward-model executor for one batch: (prompt, response) texts of
    its samples and, when the batch is evaluated, of its held-out responses."""

    batch: int
    replica: int
    items: list[tuple[str, str]]
    eval_items: list[tuple[str, str]]


@dataclass
class ModelScores:
    """The reward-model executor's answer to a `ScoreRequest`, sent to the controller."""

    batch: int
    replica: int
    scores: list[float]
    eval_scores: list[float]
    seconds: float


def score(task: Task, gen: UnscoredRollouts, evaluated: Optional[Evaluated], *, wait_s: float) -> ScoredRollouts:
    """The reward of each sample (the task's verifier or reward function) and the mean held-out reward, in the
    message for the controller. `wait_s`: the leader's time at the weight push before the batch
    (`ScoredRollouts.wait_s`)."""
    t0 = time.perf_counter()
    episodes = gen.returns is not None  # episodes come with their returns: the environments scored them
    if gen.rewards is not None:  # scored as they were drawn (dynamic sampling)
        rewards, failures = gen.rewards, gen.reward_failures
    else:
        rewards = gen.returns if episodes else task.score(gen.problems, gen.texts)
        failures = 0 if episodes else task.score_failures  # read before the held-out responses are scored
    eval_reward = None
    if evaluated is not None:
        eval_scores = evaluated.returns if evaluated.returns is not None else \
            task.score(evaluated.problems, evaluated.texts)
        eval_reward = sum(eval_scores) / len(eval_scores)
    reward_s = time.perf_counter() - t0
    return ScoredRollouts(gen.batch, gen.version, [o.prompt_ids for o in gen.outputs],
                          [o.token_ids for o in gen.outputs], [o.logprobs for o in gen.outputs], rewards, gen.groups,
                          gen.texts[:4], gen.gen_s, reward_s, wait_s, eval_reward, reward_failures=failures,
                          policy_masks=[o.policy_mask for o in gen.outputs] if episodes else None,
                          episodes=gen.episodes, routes=_routes(gen.outputs),
                          token_versions=[o.versions or [] for o in gen.outputs]
                          if any(getattr(o, "versions", None) for o in gen.outputs) else None,
                          occupancy=gen.occupancy, episode_of=gen.episode_of, sampling=gen.sampling)


def _routes(outputs: list) -> Optional[list]:
    """The samples' recorded routes (`ScoredRollouts.routes`), or None when none was recorded."""
    routes = [getattr(o, "routes", None) for o in outputs]
    return routes if any(r is not None for r in routes) else None


def score_request(task: Task, replica: int, gen: UnscoredRollouts, evaluated: Optional[Evaluated]) -> ScoreRequest:
    """What replica `replica`'s leader sends the reward-model executor: each sample's prompt and response text (an
    episode's: its first message as rendered, and everything after it, the environment's turns included)."""
    def items(part):
        prompts = part.prompts if part.prompts is not None else [task.prompt_text(p) for p in part.problems]
        return list(zip(prompts, part.texts))

    return ScoreRequest(gen.batch, replica, items(gen), items(evaluated) if evaluated is not None else [])


def model_scores(model, req: Optional[ScoreRequest]) -> Optional[ModelScores]:
    """The reward model's scores of a request's samples and held-out responses. Every TP rank of the reward-model
    replica calls it (`model.score` is their collective); only the leader holds the request (None elsewhere) and
    gets the message back."""
    t0 = time.perf_counter()
    items = [(p, r, None) for p, r in req.items + req.eval_items] if req is not None else None
    scores = model.score(items)
    if req is None:
        return None
    n = len(req.items)
    return ModelScores(req.batch, req.replica, scores[:n], scores[n:], time.perf_counter() - t0)


def with_model_scores(part: ScoredRollouts, scores: ModelScores, coef: float) -> ScoredRollouts:
    """A replica's rollouts with the reward model's scores added to the verifier's rewards (times `coef`)."""
    if len(scores.scores) != len(part.rewards):
        raise RuntimeError(f"batch {part.batch}: {len(scores.scores)} reward-model scores for {len(part.rewards)} "
                           f"samples")
    eval_reward = part.eval_reward
    if eval_reward is not None:
        eval_reward += coef * sum(scores.eval_scores) / len(scores.eval_scores)
    return dataclasses.replace(part, rewards=[r + coef * s for r, s in zip(part.rewards, scores.scores)],
                               eval_reward=eval_reward, reward_model_s=scores.seconds)


def split_parts(outs: list, groups: list[int], returns: list[float]) -> tuple:
    """Episodes split by a rewritten conversation (`SampledResponse.parts`, agents) as one sample per part, each with
    its episode's group and return: (samples, groups, returns, episode_of), `episode_of[i]` the index of the sample
    that stands for sample i's episode (its last part), or None when no episode was split."""
    if not any(o.parts for o in outs):
        return outs, groups, returns, None
    flat, flat_groups, flat_returns, episode_of = [], [], [], []
    for o, g, ret in zip(outs, groups, returns):
        last = len(flat) + len(o.parts or [])
        for part in [*(o.parts or []), o]:
            flat.append(part)
            flat_groups.append(g)
            flat_returns.append(ret)
            episode_of.append(last)
    return flat, flat_groups, flat_returns, episode_of

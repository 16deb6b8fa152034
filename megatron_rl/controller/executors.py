"""The executors of one rank, built from the resolved config: trainer, generator (and its reward), weight push.

Each rank builds the executors its place in the world gives it (`ExecutorGroups.is_member`); a colocated rank
builds both. Each class owns its state from its constructor on; the loop (`controller/loop.py`) only calls them.

    TrainerExecutor    the policy under Megatron-Core DDP + optimizer, its supervised warm start, the AIPO step
    GeneratorExecutor  the sampling copy of the policy: a batch's rollouts, the held-out responses
    RewardModelExecutor  a reward model on ranks of its own: scores every replica's responses, for the controller
    WeightPush         DDMA from trainer shards to generator shards, version by version, checked every few pushes

What the generator's samples become, and how they are scored, is `controller/scoring.py`.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_rl.config import JobConfig
from megatron_rl.controller.dynamic_sampling import SampledGroup, fill, occupancy_over, refill_index
from megatron_rl.controller.live_batches import LiveBatches, oldest_version
from megatron_rl.controller.rundir import worker_log
from megatron_rl.controller.scoring import (Evaluated, ModelScores, ScoreRequest, UnscoredRollouts, model_scores,
                                            split_parts)
from megatron_rl.controller.tasks import Task
from megatron_rl.ddma.fingerprint import PushCheck
from megatron_rl.ddma.sync import WeightSync, parameters_of
from megatron_rl.ddma.transport import TransportSettings
from megatron_rl.failpoints import failpoint
from megatron_rl.inference import GenerationRequest, Generator, SamplingParams
from megatron_rl.inference.sampling import stream_seed
from megatron_rl.models import ModelConfig, build_gpt_model
from megatron_rl.models.precision import resolve_dtype
from megatron_rl.parallel.topology import ExecutorGroups, new_group
from megatron_rl.training.guard import CollapseError
from megatron_rl.training.lm_loss import make_lm_loss
from megatron_rl.training.reference import make_reference
from megatron_rl.training.rl_trainer import RLTrainer, RLTrainerSettings
from megatron_rl.training.settings import LRSchedule

# The warm start: batch size per DP rank and its learning-rate schedule (linear warm-up over the first
# SFT_LR_WARMUP_STEPS steps, then cosine decay to a tenth of trainer.sft_lr over at least SFT_MIN_DECAY_STEPS).
SFT_BATCH_SIZE = 32
SFT_LR_WARMUP_STEPS = 10
SFT_MIN_DECAY_STEPS = 11
# Held-out evaluation samples prompt i with seed eval_seed(i), whatever the run seed: the same draws at every
# evaluation, so the curve moves only with the weights.
EVAL_SEED = 424242


def rollout_seed(run_seed: int, batch: int, prompt: int) -> int:
    """The sampling seed of prompt `prompt` (its index in the batch) of training batch `batch`: a pure function of
    the run's seed and the position, so a resumed run redraws exactly the samples it would have drawn; `stream_seed`
    keeps it apart from every other (run seed, batch, prompt)'s."""
    return stream_seed(run_seed, batch, prompt)


def eval_seed(prompt: int) -> int:
    """The sampling seed of held-out prompt `prompt`: fixed for the run and across runs."""
    return stream_seed(EVAL_SEED, prompt)


def build_policy(cfg: JobConfig, model_cfg: ModelConfig, t: ExecutorGroups, initialize: bool = True) -> torch.nn.Module:
    """The trainer's shard of the policy: random weights from run.seed, or (`initialize=False`) weights left
    uninitialized for a checkpoint or a copy to fill next."""
    return build_gpt_model(model_cfg, t.layout, t.pgs, attention=cfg.trainer.attention, seed=cfg.run.seed,
                           params_dtype=resolve_dtype(cfg.trainer.dtype), initialize=initialize)


def lr_schedule(cfg: JobConfig) -> LRSchedule:
    """The learning-rate schedule the trainer starts with: the warm start's (linear warm-up, cosine decay to a tenth
    of trainer.sft_lr) when there is one, else RL's (trainer.lr after trainer.lr_warmup_steps of linear warm-up).
    The warm start ends by starting RL's schedule afresh."""
    tr = cfg.trainer
    if tr.sft_warmup_steps > 0:
        return LRSchedule(lr=tr.sft_lr, min_lr=tr.sft_lr / 10, warmup_steps=SFT_LR_WARMUP_STEPS,
                          total_steps=max(tr.sft_warmup_steps, SFT_MIN_DECAY_STEPS), decay_style="cosine")
    return LRSchedule(lr=tr.lr, warmup_steps=tr.lr_warmup_steps, total_steps=cfg.run.steps)


class TrainerExecutor:
    """One rank of the trainer executor: the policy, its optimizer, the supervised warm start and the AIPO step."""

    def __init__(self, cfg: JobConfig, model_cfg: ModelConfig, groups: ExecutorGroups, model: torch.nn.Module,
                 task: Task, encode: Callable[[str], list[int]], tokenizer,
                 echo: Callable[[str], None] = lambda text: None,
                 last_checkpoint: Callable[[], Optional[str]] = lambda: None):
        """`echo` prints a line (the controller's rank; a no-op elsewhere); `last_checkpoint()` names the run's
        newest saved state (None before the first), for the line that stops a collapsing run."""
        self.cfg, self.model_cfg, self.groups = cfg, model_cfg, groups
        self.task, self.encode, self.tok = task, encode, tokenizer
        self.echo, self.last_checkpoint = echo, last_checkpoint
        settings = RLTrainerSettings(cfg.trainer, cfg.algorithm, lr_schedule(cfg), cfg.rollout.temperature)
        self.rl = RLTrainer(model, model_cfg, groups, settings)

    @property
    def model(self) -> torch.nn.Module:
        return self.rl.model

    @property
    def engine(self):
        return self.rl.engine

    def start(self, progress: Callable[[str, int, int, str], None]) -> None:
        """A fresh run, before RL: the supervised warm start (if any); then, with algorithm.kl_coef > 0, the KL
        reference becomes a frozen copy of the policy as RL starts."""
        if self.cfg.trainer.sft_warmup_steps > 0:
            self._warm_start(progress)
        if self.cfg.algorithm.kl_coef > 0:
            self._set_reference()

    def prepare_resume(self) -> None:
        """Before a checkpoint is loaded: a module for the KL reference's saved weights, when the run has one."""
        if self.cfg.algorithm.kl_coef > 0:
            self._set_reference()

    def _set_reference(self) -> None:
        """The KL reference: a frozen copy of the policy as it is now (`training/reference.py`)."""
        self.rl.set_reference(make_reference(self.model, lambda: build_policy(self.cfg, self.model_cfg, self.groups,
                                                                              initialize=False)))

    @property
    def reference(self) -> Optional[torch.nn.Module]:
        return self.rl.reference

    def _warm_start(self, progress: Callable[[str, int, int, str], None]) -> None:
        """Supervised next-token training on the task's answers, so RL starts from a policy that solves some
        problems: a random tiny model never sees a reward. Then RL's schedule starts: trainer.lr after
        trainer.lr_warmup_steps of linear warm-up."""
        steps = self.cfg.trainer.sft_warmup_steps
        loss_fn = make_lm_loss(self.groups.pgs.tp, self.model_cfg.vocab_size)
        for step in range(steps):
            metrics = self.engine.step([self._demonstration_batch(step)], loss_fn)
            failpoint("warm_start_step", str(step))
            progress("warm-start", step + 1, steps, f"warm-start loss {metrics['loss']:.3f}")
        self.engine.start_constant_schedule(self.cfg.trainer.lr, self.cfg.trainer.lr_warmup_steps)

    def _demonstration_batch(self, step: int) -> dict:
        """This DP rank's share of warm-start step `step`: the demonstrations' prompt and answer tokens, right-padded,
        with the loss on the answer (and its end-of-sequence token). Each tensor is built from padded lists in one
        call: per-row copies cost a tensor operation per row, a share of the step to notice on a CPU."""
        bs, dp, rank = SFT_BATCH_SIZE, self.groups.layout.dp, self.groups.dp_rank
        drawn = self.task.demonstrations(step, bs * dp)
        # Experts split over DP ranks (trainer.ep > 1): the MoE layers' dispatcher all-gathers tokens over those ranks,
        # which needs the same shape on each, so every rank pads to the longest row of the whole step.
        together = self.groups.layout.ep > 1
        # (a multi-turn task's prompt is a transcript, as token ids)
        enc = [(prompt if isinstance(prompt, list) else self.encode(prompt),
                self.tok.encode(answer) + [self.tok.eos_id])
               for prompt, answer in (drawn if together else drawn[rank * bs:(rank + 1) * bs])]
        width = max(len(a) + len(b) for a, b in enc)
        if together:
            enc = enc[rank * bs:(rank + 1) * bs]
        toks = torch.tensor([a + b + [self.tok.pad_id] * (width - len(a) - len(b)) for a, b in enc], dtype=torch.long)
        mask = torch.tensor([[0.0] * len(a) + [1.0] * len(b) + [0.0] * (width - len(a) - len(b)) for a, b in enc])
        if torch.cuda.is_available():
            toks, mask = toks.cuda(non_blocking=True), mask.cuda(non_blocking=True)
        return {"tokens": toks, "loss_mask": mask}

    def step(self, batch, step: int) -> dict:
        """RL step `step` on `batch`; a step the collapse guard skips or scales is one line, and a run of skipped
        steps stops the job naming the checkpoint to resume from (`training/guard.py`)."""
        try:
            metrics = self.rl.step(batch)
        except CollapseError as e:
            saved = self.last_checkpoint()
            where = (f"the last checkpoint, {saved}, holds the weights before it: resume from it with a lower "
                     f"trainer.lr" if saved else "no checkpoint was saved before it")
            raise CollapseError(f"{e}; {where}") from None
        reason = metrics.pop("guard_reason", None)
        if reason is not None:
            self.echo(f"megatron-rl: warning: step {step}, collapse guard: {reason}")
        return metrics


class GeneratorExecutor:
    """One rank of the generator executor. Replica d (of generator.dp) samples prompts d, d + dp, ... of each
    batch; its TP ranks (and pipeline stages) sample together and its leader (tp rank 0 of the first stage) gets
    the outputs."""

    def __init__(self, cfg: JobConfig, model_cfg: ModelConfig, groups: ExecutorGroups, task: Task, tokenizer,
                 encode: Callable[[str], list[int]]):
        self.cfg, self.groups, self.task, self.tok, self.encode = cfg, groups, task, tokenizer, encode
        self.stop_ids = tuple(sorted(tokenizer.stop_ids))
        quantized = cfg.generator.quantization != "none"
        build = dict(attention=cfg.generator.model_attention, seed=cfg.run.seed + 1,
                     params_dtype=resolve_dtype(cfg.generator.dtype))
        self.quantized: dict = {}  # local name -> quant.QuantizedWeight (int8 or fp8)
        if quantized:
            from megatron_rl.inference.quantized import build_quantized_generator

            # Never holds the full-precision matrices; DDMA writes every weight before the first sample.
            self.model, self.quantized = build_quantized_generator(cfg.generator.quantization, model_cfg,
                                                                   groups.layout, groups.pgs, **build)
        else:  # uninitialized: DDMA writes every weight before the first sample (`schedule.job_plan`)
            self.model = build_gpt_model(model_cfg, groups.layout, groups.pgs, initialize=False, **build)
        self.generator = Generator(self.model, model_cfg.vocab_size, groups.pgs.tp,
                                   max_batch_size=cfg.generator.max_batch_size,
                                   max_len=cfg.episode_length,
                                   tokenizer=tokenizer, pp_group=groups.pgs.pp,
                                   kv_cache_tokens=cfg.generator.kv_cache_tokens or None,
                                   record_routes=model_cfg.is_moe and cfg.trainer.routing_replay)
        self.episodes = None  # with env.cls: the replica's environments (`environments/play.py`); env.agent: agents
        self.version = 0  # of the weights the generator holds
        if cfg.env.episodic:
            if cfg.env.agent is not None:  # the user's agents, through the replica leader's OpenAI endpoint
                from megatron_rl.agents.play import Agents as Play
            else:
                from megatron_rl.environments.play import Episodes as Play

            chat = tokenizer.has_chat_template if cfg.data.chat is None else cfg.data.chat
            self.episodes = Play(cfg.env, tokenizer, chat, groups.pgs.mp, self.is_leader, self._sampling(0, 1),
                                     log_path=str(worker_log(cfg)))
        # With rollout.in_flight: the batches in the live engine (`controller/live_batches.py`).
        self.live: Optional[LiveBatches] = None
        if cfg.rollout.in_flight:
            r = cfg.rollout
            self.live = LiveBatches(self.generator, cfg.episode_length, r.top_p < 1 or r.top_k > 0, cfg.run.steps,
                                    self._batch_requests, self.episodes.restored if self.episodes else None)

    @property
    def is_leader(self) -> bool:
        return self.groups.tp_rank == 0 and self.groups.pp_rank == 0  # Job.leaders: local rank (0, 0, d)

    def weights(self) -> dict:
        """What DDMA writes into: the parameters, with the 8-bit buffers (written in place) where quantized."""
        if not self.quantized:
            return self.model
        return {**dict(self.model.named_parameters()), **self.quantized}

    def _sampling(self, seed: int, n: int) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, stop_token_ids=self.stop_ids, n=n, seed=seed)

    def close(self) -> None:
        """Not collective: end the environments' worker processes, if any."""
        if self.episodes is not None:
            self.episodes.close()

    def generate(self, batch: int, version: int) -> Optional[UnscoredRollouts]:
        """This replica's samples of training batch `batch` (episodes with env.cls); None on ranks other than the
        leader. With `rollout.in_flight`, from the live engine (`controller/live_batches.py`); the batch's version
        is then its oldest token's. With `algorithm.dynamic_sampling`, groups without signal are refilled
        (`_dynamic_sampling`)."""
        r = self.cfg.rollout
        problems = self.task.train_batch(batch, r.prompts_per_step)
        mine = r.replica_prompts(self.groups.dp_rank, self.groups.layout.dp)
        t0 = time.perf_counter()
        if self.cfg.algorithm.dynamic_sampling:
            return self._dynamic_sampling(batch, version, problems, mine, t0)
        turns = None
        if self.live is not None:
            outs, turns = self._live_batch(batch)
            version = oldest_version(outs, version)
        elif self.episodes is not None:
            outs, turns = self._sample([problems[i] for i in mine], [rollout_seed(self.cfg.run.seed, batch, i)
                                                                    for i in mine])
        else:
            outs = self.generator.generate(self._requests(batch, problems))
        gen_s = time.perf_counter() - t0
        if not self.is_leader:
            return None
        n = r.samples_per_prompt
        groups = [mine[j // n] for j in range(len(outs))]
        episodes = {}
        if turns is not None:
            episodes = dict(returns=turns.returns(), episodes=turns.statistics(outs))
            outs, groups, episodes["returns"], episodes["episode_of"] = split_parts(outs, groups, episodes["returns"])
            episodes["prompts"] = self._prompt_texts(outs)
        return UnscoredRollouts(batch, version, [problems[i] for i in groups], groups, outs,
                                [self.tok.decode(o.token_ids) for o in outs], gen_s, **episodes,
                                occupancy=self.generator.stats.get("occupancy"))

    def _live_batch(self, batch: int) -> tuple[list, Optional[object]]:
        """Training batch `batch` from the live engine: (outputs, the episodes' turns or None), the environments'
        failure rule applied by the leader."""
        outs, turns = self.live.generate(batch, self.version)
        if turns is not None and self.is_leader:
            self.episodes.end_batch(turns)
        return outs, turns

    def _sample(self, records: list, seeds: list[int]) -> tuple[list, Optional[object]]:
        """`rollout.samples_per_prompt` samples (episodes with env.cls) of each record, seeded by `seeds` (the
        replica's ranks together): (outputs, the episodes' turns or None), from the live engine where there is one
        (a refill, ahead of the next batch). The leader applies the environments' failure rule to the episodes
        (`Episodes.end_batch`)."""
        n = self.cfg.rollout.samples_per_prompt
        turns = None
        if self.episodes is None:
            reqs = [GenerationRequest(self.encode(self.task.prompt_text(p)), self._sampling(s, n))
                    for p, s in zip(records, seeds)]
        else:
            reqs, turns = self.episodes.requests(records, seeds, n)
        if self.live is not None:  # a refill of the batch being drawn: ahead of the next batch's waiting sequences
            outs = self.live.run(reqs, turns, self.version, ahead=True)
        else:
            outs = self.generator.generate(reqs, turns=turns)
        if self.is_leader and turns is not None:
            self.episodes.end_batch(turns)
        return outs, turns

    def _scored_groups(self, records: list, drawn_from: int, positions: list[int], outs: list, turns,
                       tally: dict) -> list:
        """The leader's `SampledGroup`s of sampled records (raw rewards: the verifier's, or the episodes' returns);
        the round's episode statistics and reward failures added to the batch's `tally`."""
        n = self.cfg.rollout.samples_per_prompt
        if turns is not None:
            rewards = turns.returns()
            tally["episodes"].append(turns.statistics(outs))
        else:
            rewards = self.task.score([records[j // n] for j in range(len(outs))],
                                      [self.tok.decode(o.token_ids) for o in outs])
            tally["reward_failures"] += self.task.score_failures
        return [SampledGroup(rec, pos, outs[k * n:(k + 1) * n], rewards[k * n:(k + 1) * n], drawn_from)
                for k, (rec, pos) in enumerate(zip(records, positions))]

    def _dynamic_sampling(self, batch: int, version: int, problems: list, mine: list[int],
                          t0: float) -> Optional[UnscoredRollouts]:
        """`generate` with groups without signal refilled from further prompts (`controller/dynamic_sampling.py`):
        the leader scores each round here, and the batch goes on with its raw rewards. In the live engine the
        refills are queued ahead of the next batch's waiting sequences, whose running ones go on beside them."""
        r, seed = self.cfg.rollout, self.cfg.run.seed
        tally = {"episodes": [], "reward_failures": 0}  # over the batch's rounds, on the leader
        records = [problems[i] for i in mine]
        if self.live is not None:  # round 0 is the batch the live engine queued (beside the batch before it)
            outs, turns = self._live_batch(batch)
        else:
            outs, turns = self._sample(records, [rollout_seed(seed, batch, i) for i in mine])
        first = self._scored_groups(records, batch, mine, outs, turns, tally) if self.is_leader else None
        rounds = [self.generator.stats]  # each round's engine statistics: the batch's occupancy is over all of them

        def draw(round_: int, count: int) -> Optional[list]:
            index = refill_index(batch, round_)
            pool = self.task.train_batch(index, r.prompts_per_step)
            positions = mine[:count]
            outs, turns = self._sample([pool[i] for i in positions], [rollout_seed(seed, index, i) for i in positions])
            rounds.append(self.generator.stats)
            return self._scored_groups([pool[i] for i in positions], index, positions, outs, turns, tally) \
                if self.is_leader else None

        share = self.episodes.share if self.episodes is not None else self._share
        groups, report = fill(first, draw, share, self.cfg.algorithm.dynamic_sampling_rounds)
        gen_s = time.perf_counter() - t0
        if not self.is_leader:
            return None
        outs = [o for g in groups for o in g.outputs]
        rewards = [x for g in groups for x in g.rewards]
        ids = [g.group for g in groups for _ in g.outputs]
        if self.live is not None:  # the batch's version is its oldest token's, over the groups it kept
            version = oldest_version(outs, version)
        episodes = {}
        if turns is not None:
            totals = {k: sum(st[k] for st in tally["episodes"]) for k in tally["episodes"][0]}
            episodes = dict(returns=rewards, episodes=totals, prompts=self._prompt_texts(outs))
        return UnscoredRollouts(batch, version, [g.record for g in groups for _ in g.outputs], ids, outs,
                                [self.tok.decode(o.token_ids) for o in outs], gen_s, **episodes,
                                occupancy=occupancy_over(rounds), rewards=rewards,
                                reward_failures=tally["reward_failures"], sampling=report)

    def _share(self, obj):
        """The leader's `obj` on every rank of the replica (a broadcast over its model-parallel group)."""
        group = self.groups.pgs.mp
        if group is None or group.size() == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return box[0]

    def _requests(self, batch: int, problems: Optional[list] = None) -> list[GenerationRequest]:
        """This replica's requests of training batch `batch` (single responses); `problems`: the batch's records,
        where the caller has drawn them already."""
        r = self.cfg.rollout
        problems = problems if problems is not None else self.task.train_batch(batch, r.prompts_per_step)
        return [GenerationRequest(self.encode(self.task.prompt_text(problems[i])),
                                  self._sampling(rollout_seed(self.cfg.run.seed, batch, i), r.samples_per_prompt))
                for i in r.replica_prompts(self.groups.dp_rank, self.groups.layout.dp)]

    def _batch_requests(self, batch: int) -> tuple[list, Optional[object]]:
        """This replica's requests of training batch `batch` and, with episodes, their turns (else None)."""
        if self.episodes is None:
            return self._requests(batch), None
        r = self.cfg.rollout
        problems = self.task.train_batch(batch, r.prompts_per_step)
        mine = r.replica_prompts(self.groups.dp_rank, self.groups.layout.dp)
        return self.episodes.requests([problems[i] for i in mine],
                                      [rollout_seed(self.cfg.run.seed, batch, i) for i in mine], r.samples_per_prompt)

    def weights_changed(self, version: int, recompute: bool) -> None:
        """A push wrote weights `version`: the live engine's running sequences go on under them, their caches kept
        or recomputed (`Engine.switch`)."""
        self.version = version
        if self.live is not None:
            self.live.switch(version, recompute)

    def live_state(self) -> Optional[dict]:
        """With `rollout.in_flight`: the live engine's sequences (the batches queued, partly sampled) and their
        episodes as plain containers, for the checkpoint; None before the first batch."""
        return self.live.state() if self.live is not None else None

    def restore_live(self, state: Optional[dict]) -> None:
        """Go on from `live_state` (a resume; its caches are recomputed at the first weight push)."""
        if state is not None:
            self.version = state["engine"]["version"]
            self.live.restore(state)

    def evaluate(self) -> Optional[Evaluated]:
        """Responses to the held-out problems, sampled as in training (every replica sees the same set and holds
        the same weights); None on ranks other than the leader."""
        n = self.cfg.data.eval_samples
        problems = self.task.eval_records()
        turns = None
        if self.episodes is not None:
            reqs, turns = self.episodes.requests(problems, [eval_seed(i) for i in range(len(problems))], n)
        else:
            reqs = [GenerationRequest(self.encode(self.task.prompt_text(p)), self._sampling(eval_seed(i), n))
                    for i, p in enumerate(problems)]
        if self.live is not None:
            outs = self.live.run(reqs, turns, self.version)
        else:
            outs = self.generator.generate(reqs, turns=turns)
        if not self.is_leader:
            return None
        return Evaluated([problems[j // n] for j in range(len(outs))], [self.tok.decode(o.token_ids) for o in outs],
                         returns=turns.returns() if turns is not None else None,
                         prompts=self._prompt_texts(outs) if turns is not None else None)

    def _prompt_texts(self, outs: list) -> list[str]:
        """An episode's first message as the model read it (its environment's `reset`, rendered), for the reward
        model, which scores it with the episode."""
        return [self.tok.decode(o.prompt_ids) for o in outs]


class RewardModelExecutor:
    """One rank of the reward-model executor (`reward.executor`): a Llama-family sequence classifier under TP.
    Replica r of dp scores the batches of generator replicas r, r + dp, ...: its leader receives each replica's
    `ScoreRequest`, its TP ranks score it together, and the leader sends the `ModelScores` to the controller,
    which adds them to the verifier's rewards."""

    def __init__(self, cfg: JobConfig, r: ExecutorGroups, generator_leaders: list[int],
                 receive: Callable[[int], ScoreRequest], send: Callable[[ModelScores], None]):
        from megatron_rl.rewards.sequence_classifier import (SCORING_BATCH_SIZE, SCORING_MAX_LENGTH,
                                                             ParallelRewardModel)

        self.model = ParallelRewardModel(cfg.reward.model, r.layout, r.pgs,
                                         params_dtype=resolve_dtype(cfg.generator.dtype),
                                         batch_size=SCORING_BATCH_SIZE, max_length=SCORING_MAX_LENGTH)
        self.is_leader = r.tp_rank == 0
        dp = r.layout.dp
        self.replicas = list(range(len(generator_leaders)))[r.dp_rank::dp]
        self.sources = generator_leaders[r.dp_rank::dp]
        self.receive, self.send = receive, send

    def serve(self, batch: int) -> None:
        """Score batch `batch` of each generator replica this one serves (and its held-out responses, if any)."""
        for replica, src in zip(self.replicas, self.sources):
            req = self.receive(src) if self.is_leader else None
            if req is not None and (req.batch, req.replica) != (batch, replica):
                raise RuntimeError(f"expected batch {batch} of generator replica {replica} from rank {src}, got "
                                   f"batch {req.batch} of replica {req.replica}")
            scores = model_scores(self.model, req)  # every TP rank; the leader's answer
            failpoint("reward_model_batch", str(batch))
            if scores is not None:
                self.send(scores)


class WeightPush:
    """DDMA from the trainer's shards to the generator's (a collective of both executors' ranks)."""

    def __init__(self, cfg: JobConfig, model_cfg: ModelConfig, t: ExecutorGroups, g: ExecutorGroups):
        """Collective over the world (it makes the push's check group)."""
        quantize = None if cfg.generator.quantization == "none" else cfg.generator.quantization
        self.sync = WeightSync(model_cfg, t, g, settings=TransportSettings(quantize=quantize))
        group = new_group(sorted(set(t.placement.ranks) | set(g.placement.ranks)), backend="gloo")
        self.check = PushCheck(self.sync.plan, self.sync.rank, group, cfg.generator.push_check_interval)

    def __call__(self, version: int, trainer: Optional[TrainerExecutor],
                 generator: Optional[GeneratorExecutor]) -> float:
        """Move version `version`; returns the seconds it took on this rank."""
        t0 = time.perf_counter()
        src_model = trainer.model if trainer is not None else None
        dst_model = generator.weights() if generator is not None else None
        src, dst = parameters_of(src_model), parameters_of(dst_model)  # the same tensors, by name (for the check)
        self.transfer(version, src_model, dst_model)
        self.check.after_push(src, dst, version, time.perf_counter() - t0)  # every few pushes: a collective
        return time.perf_counter() - t0

    def transfer(self, version: int, src_model: Optional[torch.nn.Module], dst_model) -> None:
        """The DDMA copies of version `version` from this rank's trainer shard (`src_model`, None on a rank
        without one) into its generator shard (`dst_model`: the model, or `GeneratorExecutor.weights()`; None
        likewise). Collective over both executors' ranks."""
        self.sync.sync(trainer_model=src_model, generator_model=dst_model,
                       step=version if src_model is not None else None)

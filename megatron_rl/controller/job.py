"""One rank of the RL job: its place in the world, its executors, and the collectives that span executors.

One torch.distributed world: trainer ranks [0, T), generator ranks [T, T + G) (or the same ranks when colocated),
then the reward-model executor's ranks, if the job has one. Rank 0 is also the controller (`Collector`): it receives
scored rollouts, computes advantages, hands batches to the trainer ranks and writes the metrics. Control messages are
small pickled objects over gloo groups (`controller/scoring.py` defines those of scoring); weights move with DDMA.
The order in which all this happens is the loop's (`controller/loop.py`); this class only builds and provides the
pieces.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_rl.checkpointing import initial
from megatron_rl.checkpointing.layout import CheckpointError, step_dir_name, verify
from megatron_rl.checkpointing.megatron_state import saved_with_reference
from megatron_rl.checkpointing.training import TrainCheckpointer
from megatron_rl.config import JobConfig
from megatron_rl.controller.channels import Outbox, recv_object
from megatron_rl.launch import signals
from megatron_rl.controller.collector import Collector, batch_with_advantages
from megatron_rl.controller.executors import (GeneratorExecutor, RewardModelExecutor, TrainerExecutor, WeightPush,
                                               build_policy)
from megatron_rl.controller import scoring
from megatron_rl.controller.scoring import Evaluated, ScoredRollouts, UnscoredRollouts
from megatron_rl.controller.tasks import build_task
from megatron_rl.failpoints import failpoint
from megatron_rl.models import ModelConfig
from megatron_rl.models.precision import resolve_dtype
from megatron_rl.parallel import ExecutorPlacement, build_topology
from megatron_rl.parallel.topology import new_group
from megatron_rl.planning.resume_check import TrainerSpec, check_resume
from megatron_rl.rollout import RolloutBatch


def placements(cfg: JobConfig) -> list[ExecutorPlacement]:
    t = cfg.trainer.layout
    g = cfg.generator.layout
    first = 0 if cfg.generator.colocated else t.size
    out = [ExecutorPlacement("trainer", t, 0), ExecutorPlacement("generator", g, first)]
    if cfg.reward.model_executor:
        out.append(ExecutorPlacement("reward", cfg.reward.executor.layout, cfg.reward_first_rank))
    return out


def checkpoint_bytes(cfg: JobConfig, model_cfg: ModelConfig) -> int:
    """A training checkpoint's estimated size (`checkpointing/storage.py`) for this job's model, trainer dtype and
    KL reference."""
    from megatron_rl.checkpointing import storage
    from megatron_rl.models.precision import resolve_dtype_name

    param_bytes = {"fp32": 4}.get(resolve_dtype_name(cfg.trainer.dtype), 2)
    return storage.estimate_checkpoint_bytes(model_cfg.num_parameters(cfg.trainer.tp), param_bytes,
                                             with_reference=cfg.algorithm.kl_coef > 0)


class Job:
    """Everything one rank of the job holds. `echo(text)` prints a log line (rank 0's progress bar)."""

    def __init__(self, cfg: JobConfig, model_cfg: ModelConfig, run_dir: Path,
                 echo: Optional[Callable[[str], None]] = None):
        self.cfg, self.model_cfg, self.run_dir = cfg, model_cfg, run_dir
        self.echo = echo or (lambda text: None)
        self.rank = dist.get_rank()
        self.staleness = cfg.rollout.schedule_staleness  # the schedule's: one less with rollout.in_flight
        topo = build_topology(placements(cfg))
        self.trainer_groups, self.generator_groups = topo["trainer"], topo["generator"]
        self.reward_groups = topo.get("reward")
        # Generator replica leaders (tp rank 0) talk to the controller (rank 0), and replica d's to the leader of
        # reward-model replica d % dp (`scorers`), if the job has that executor.
        g, r = self.generator_groups, self.reward_groups
        self.leaders = [g.placement.first_rank + g.layout.local_rank(0, 0, d) for d in range(g.layout.dp)]
        self.scorers = None
        if r is not None:
            self.scorers = [r.placement.first_rank + r.layout.local_rank(0, 0, d % r.layout.dp)
                            for d in range(g.layout.dp)]
        self.trainer_group = new_group(list(self.trainer_groups.placement.ranks), backend="gloo")
        self.control_group = new_group(sorted({0, *self.leaders, *(self.scorers or [])}), backend="gloo")
        self.world_group = new_group(backend="gloo")  # small control collectives over every rank
        # Non-blocking sends: replica leaders' and reward-model ranks' messages to the controller (`outbox`), and a
        # replica leader's requests to its reward-model leader (`scorer_outbox`).
        sends_to_controller = self.rank != 0 and (self.rank in self.leaders or (r is not None and r.is_member))
        self.outbox = Outbox(0, self.control_group) if sends_to_controller else None
        self.scorer_outbox = None
        if self.scorers is not None and self.rank in self.leaders:
            self.scorer_outbox = Outbox(self.scorers[self.leaders.index(self.rank)], self.control_group)
        self.stop_signal = 0  # the signal that stopped the run (`stop_requested`), 0 while it runs
        self.saved_version: Optional[int] = None  # the newest state saved or resumed from
        self.space_checked = False  # the checkpoint directory's free space, checked before the first save

        self.initial = initial.megatron_checkpoint(cfg.model.checkpoint)
        self.tok = initial.job_tokenizer(cfg)
        if model_cfg.vocab_size < self.tok.vocab_size:
            raise ValueError(f"the tokenizer has {self.tok.vocab_size} tokens but the model's vocabulary only "
                             f"{model_cfg.vocab_size}")
        # Generator replica leaders score responses (and run reward workers); other ranks only need the prompts.
        self.task = build_task(cfg, self.tok, with_reward=self.rank in self.leaders)
        self.ckpt = TrainCheckpointer(run_dir, keep_last=cfg.checkpoint.keep_last,
                                      log=self.echo if self.rank == 0 else None, async_save=cfg.checkpoint.async_save)
        self.resume_from = self.ckpt.find(cfg.checkpoint.fallback) if cfg.checkpoint.resume else None
        self._build_executors()
        self.collector = None
        if self.rank == 0:
            self.collector = Collector(self.leaders, lambda src: recv_object(src, self.control_group),
                                       scorers=self.scorers, model_coef=cfg.reward.model_coef)

    def _build_executors(self) -> None:
        cfg, m = self.cfg, self.model_cfg
        t, g, r = self.trainer_groups, self.generator_groups, self.reward_groups
        # Random weights only where no checkpoint fills them (a starting checkpoint now, or the run's own at resume).
        random_init = self.initial is None and self.resume_from is None
        policy = build_policy(cfg, m, t, initialize=random_init) if t.is_member else None
        if self.initial is not None and self.resume_from is None:
            # Before the optimizer exists: its main parameters start as copies of these weights. (A run that
            # resumes restores its own weights instead.) Every rank takes part; generators get the weights by DDMA.
            initial.load_weights(policy, self.initial, t.pgs.dp_cp if policy is not None else None)
        self.trainer = self.generator = self.reward_model = None
        if t.is_member:
            echo = self.echo if self.rank == 0 else (lambda _: None)
            self.trainer = TrainerExecutor(
                cfg, m, t, policy, self.task, self.encode, self.tok, echo=echo,
                last_checkpoint=lambda: None if self.saved_version is None else step_dir_name(self.saved_version))
        if g.is_member:
            self.generator = GeneratorExecutor(cfg, m, g, self.task, self.tok, self.encode)
        if r is not None and r.is_member:
            self.reward_model = RewardModelExecutor(cfg, r, self.leaders,
                                                    lambda src: recv_object(src, self.control_group),
                                                    self.outbox.send)
        self.push = WeightPush(cfg, m, t, g)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_bos=self.tok.bos_id is not None)

    # ---- collectives across executors ------------------------------------------------------------------------
    def push_weights(self, version: int) -> float:
        """DDMA of version `version` (trainer and generator ranks); the seconds it took here."""
        if self.trainer is None and self.generator is None:
            return 0.0
        seconds = self.push(version, self.trainer, self.generator)
        if self.generator is not None:  # the live engine's running sequences go on under the new weights
            t0 = time.perf_counter()
            # Their caches are recomputed at the push right after a checkpoint, which holds no cache: a run resumed
            # from it recomputes them there too, and goes on exactly as this one (`inference/engine.py`).
            self.generator.weights_changed(version, self.cfg.rollout.recompute_cache or self.saved_version == version)
            seconds += time.perf_counter() - t0
        return seconds

    # ---- scoring and advantages (`controller/scoring.py`, `controller/collector.py`) -----------------------------
    def score(self, generated: UnscoredRollouts, evaluated: Optional[Evaluated], *, push_s: float) -> ScoredRollouts:
        """A replica leader's samples scored: the task's verifier here (`scoring.score`) and, with a reward-model
        executor, their texts sent to it (non-blocking; its scores reach the controller on their own, which adds
        them in `Collector.collect`). `push_s`: this rank's time at the weight push before the batch."""
        scored = scoring.score(self.task, generated, evaluated, wait_s=push_s)
        if self.scorer_outbox is not None:
            replica = self.leaders.index(self.rank)
            self.scorer_outbox.send(scoring.score_request(self.task, replica, generated, evaluated))
        return scored

    def send_rollouts(self, rollouts: ScoredRollouts) -> None:
        """A replica leader's scored batch to the controller (non-blocking: the generator runs ahead)."""
        if self.collector is not None:
            self.collector.put(rollouts)
        else:
            self.outbox.send(rollouts)

    def scored_rollouts(self, k: int) -> Optional[list[ScoredRollouts]]:
        """The controller (rank 0): every replica's scored rollouts of batch k, received now if need be, with the
        reward model's scores added (`Collector.take`). None on other ranks."""
        return self.collector.take(k) if self.collector is not None else None

    def batch_with_advantages(self, k: int, parts: Optional[list[ScoredRollouts]]) -> RolloutBatch:
        """Trainer ranks: batch k, packed from `parts` with its advantages computed on rank 0
        (`collector.batch_with_advantages`, `algorithm.advantage`) and broadcast to every trainer rank."""
        a = self.cfg.algorithm
        overlong = (self.cfg.response_budget, a.overlong_buffer, a.overlong_penalty)
        msg = [batch_with_advantages(parts, self.tok.pad_id, a.advantage, overlong) if parts is not None else None]
        dist.broadcast_object_list(msg, src=0, group=self.trainer_group)
        failpoint("train_step", str(k))
        return msg[0]

    def stop_requested(self) -> bool:
        """Collective over the world: has any rank received SIGTERM or SIGINT (`launch/signals.py`)? Sets
        `stop_signal` (SIGTERM wins over SIGINT)."""
        flag = torch.tensor([signals.requested()], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.world_group)
        self.stop_signal = int(flag.item())
        return self.stop_signal != 0

    def finish(self) -> None:
        """Collective over the world, at the end of the run (or a stop): the last checkpoint completes."""
        for box in (self.outbox, self.scorer_outbox):
            if box is not None:
                box.flush()
        self._checkpoint_done()

    def close(self) -> None:
        """Not collective: end this rank's reward workers (the task's), however the run ended. They block SIGTERM
        as the rank does (`launch/signals.py`), so the terminate that multiprocessing sends its children at exit
        does not end them: a rank left with them running waited, finished, until its launcher killed it (5 s)."""
        self.task.close()
        if self.generator is not None:
            self.generator.close()

    def raise_if_checkpoint_failed(self) -> None:
        """Not collective, cheap: CheckpointError now if this rank's part of the save in the background failed."""
        self.ckpt.raise_if_failed()

    def _checkpoint_done(self) -> None:
        """Collective: wait for the save in the background, and say it is complete (rank 0)."""
        pending = self.ckpt.pending_name
        self.ckpt.wait()
        if pending is not None and self.rank == 0:
            self.echo(f"checkpoint {pending} saved ({self.ckpt.last_save_s:.1f} s, training waited "
                      f"{self.ckpt.last_blocking_s:.1f} s)")

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def checkpoint(self, version: int) -> None:
        """Collective over the world: the state after `version` trainer steps. The rollouts of batches that were
        generated with older weights (batches version .. version + s - 1) cannot be regenerated after a restart,
        so the controller collects them first and they go into the checkpoint. A no-op when that state is the
        one last saved or resumed from."""
        if version == self.saved_version:
            return
        if self.rank == 0 and not self.space_checked:
            self.space_checked = True
            self._check_space()
        rl_state = None
        engine = self.trainer.engine if self.trainer is not None else None
        if self.collector is not None:
            rl_state = {"step": version, "weight_version": version,
                        "pending": self.collector.pending(version, self.staleness, self.cfg.run.steps),
                        "nonfinite_total": engine.nonfinite_total if engine is not None else 0}
        live = self._live_states()
        if rl_state is not None and live is not None:
            rl_state["in_flight"] = live
        reference = self.trainer.reference if self.trainer is not None else None
        self._checkpoint_done()  # the previous save first
        self.ckpt.save(version, engine, reference=reference, layout=self.trainer_groups.layout,
                       model_cfg=self.model_cfg, rl_state=rl_state,
                       tokenizer=initial.tokenizer_entry(self.cfg, self.tok, self.initial),
                       extra={"run": self.cfg.run.name, "mode": self.cfg.rollout.mode,
                              "staleness": self.cfg.rollout.effective_staleness,
                              "in_flight": self.cfg.rollout.in_flight})
        self.saved_version = version
        if self.rank == 0 and not self.cfg.checkpoint.async_save:
            self.echo(f"checkpoint {step_dir_name(version)} saved ({self.ckpt.last_save_s:.1f} s)")

    def _live_states(self) -> Optional[dict]:
        """With rollout.in_flight, on the controller: each generator replica's live engine (`live_state`: the
        batches queued and partly sampled, which no other copy holds), sent by its leader after the rollouts it sent
        before (the order of the leader's messages); None elsewhere and without in-flight updates."""
        if not self.cfg.rollout.in_flight:
            return None
        mine = self.generator.live_state() if self.generator is not None and self.generator.is_leader else None
        if self.rank != 0:
            if self.rank in self.leaders:
                self.outbox.send(mine)
            return None
        return {d: mine if leader == 0 else recv_object(leader, self.control_group)
                for d, leader in enumerate(self.leaders)}

    def _check_space(self) -> None:
        """Warn once, before the first save, when the checkpoint directory cannot hold the checkpoints it must."""
        from megatron_rl.checkpointing import storage
        from megatron_rl.checkpointing.layout import list_checkpoints

        warning = storage.space_warning(self.ckpt.root, checkpoint_bytes(self.cfg, self.model_cfg),
                                        self.cfg.checkpoint.keep_last, len(list_checkpoints(self.ckpt.root)))
        if warning is not None:
            self.echo(f"megatron-rl: warning: {warning}")

    def _restore_live(self, path: Path, saved: Optional[dict]) -> None:
        """Every generator rank: its replica's live engine as the checkpoint holds it (rollout.in_flight)."""
        if (saved is not None) != self.cfg.rollout.in_flight or (
                saved is not None and len(saved) != self.generator_groups.layout.dp):
            had = f"rollout.in_flight={'true' if saved is not None else 'false'}" + (
                f" and generator.dp={len(saved)}" if saved is not None else "")
            raise CheckpointError(f"{path}: written with {had}: its batches in flight resume only so (set them, or "
                                  f"start a new run)")
        if saved is not None and self.generator is not None:
            self.generator.restore_live(saved[self.generator_groups.dp_rank])

    def resume(self) -> Optional[tuple[int, set[int]]]:
        """Restore the newest checkpoint, if the run has one: (trainer steps already done, batches restored with
        it). None when the run starts from scratch. Unfinished writes of an earlier run are removed first."""
        if self.rank == 0:
            self.ckpt.remove_unfinished()
        path = self.resume_from
        if path is None:
            return None
        meta = verify(path)
        saved = meta.model_config() if meta.model is not None else None
        if saved is not None and saved != self.model_cfg:
            diff = sorted(f.name for f in dataclasses.fields(saved)
                          if getattr(saved, f.name) != getattr(self.model_cfg, f.name))
            raise CheckpointError(f"{path}: written for another model shape (differs in {', '.join(diff)}); use "
                                  f"another checkpoint.dir or run.name, or checkpoint.resume=false")
        if self.cfg.algorithm.kl_coef > 0 and not saved_with_reference(path):  # every rank, before the collective
            raise CheckpointError(f"{path}: algorithm.kl_coef > 0 but the checkpoint holds no KL reference model "
                                  f"(it was written by a run without one); resume with algorithm.kl_coef=0, or "
                                  f"start a new run")
        # Every element each trainer rank loads, at this layout and at the one it was written with, is in the
        # checkpoint exactly once: proven from its index before anything loads, the stages shared over the ranks.
        note = check_resume(path, TrainerSpec.of_job(self.cfg, self.model_cfg, resolve_dtype(self.cfg.trainer.dtype)),
                            self.world_group)
        if note is not None and self.rank == 0:
            self.echo(f"megatron-rl: warning: {note}")
        reference = None
        if self.trainer is not None:
            self.trainer.prepare_resume()
            reference = self.trainer.reference
        rl = self.ckpt.load(path, self.trainer.engine if self.trainer is not None else None, reference=reference)
        pending = rl.get("pending", {})
        self._restore_live(path, rl.get("in_flight"))
        if self.collector is not None:
            self.collector.restore(pending)
            self.echo(f"resumed from {path} (step {rl['step']}, {len(pending)} rollout batches restored)")
        if self.trainer is not None:
            self.trainer.engine.set_peak_lr(self.cfg.trainer.lr)  # the restored schedule, at this run's trainer.lr
        self.saved_version = int(rl["step"])
        return int(rl["step"]), {int(b) for b in pending}

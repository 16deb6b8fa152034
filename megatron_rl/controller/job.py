"""The RL job on every rank: executors, warm start, the (a)synchronous loop, metrics.

One torch.distributed world: trainer ranks [0, T), generator ranks [T, T + G) (or the same ranks when colocated).
Rank 0 is also the controller: it receives rollouts, computes advantages, hands batches to the trainer ranks and
writes the metrics. Control messages are small pickled objects over gloo groups; weights move with DDMA.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.algorithms import AIPOSettings, compute_advantages
from megatron_rl.failpoints import failpoint
from megatron_rl.config import JobConfig, validate
from megatron_rl.controller.channels import Outbox, recv_object
from megatron_rl.controller.schedule import generation_version, push_after_step
from megatron_rl.controller.tasks import build_task
from megatron_rl.models.precision import resolve_dtype
from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
from megatron_rl.rollout import RolloutBatch




@dataclass
class Rollouts:
    """What a generator replica sends the controller for one batch."""

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
    wait_s: float
    eval_reward: Optional[float] = None


def _placements(cfg: JobConfig) -> list[ExecutorPlacement]:
    t = ParallelLayout(cfg.trainer.tp, cfg.trainer.pp, cfg.trainer.dp)
    g = ParallelLayout(cfg.generator.tp, cfg.generator.pp, cfg.generator.dp)
    first = 0 if cfg.generator.colocated else t.size
    return [ExecutorPlacement("trainer", t, 0), ExecutorPlacement("generator", g, first)]


def _pack(rollouts: list[Rollouts], pad_id: int) -> RolloutBatch:
    prompts = [p for r in rollouts for p in r.prompt_ids]
    tokens = [t for r in rollouts for t in r.token_ids]
    lps = [lp for r in rollouts for lp in r.logprobs]
    n = len(prompts)
    s = max(len(p) + len(t) for p, t in zip(prompts, tokens))
    toks = torch.full((n, s), pad_id, dtype=torch.long)
    logp = torch.zeros(n, s)
    for i, (p, t, lp) in enumerate(zip(prompts, tokens, lps)):
        toks[i, : len(p) + len(t)] = torch.tensor(p + t)
        logp[i, len(p): len(p) + len(t)] = torch.tensor(lp)
    rewards = torch.tensor([x for r in rollouts for x in r.rewards])
    groups = torch.tensor([x for r in rollouts for x in r.group_ids])
    versions = torch.tensor([r.version for r in rollouts for _ in r.rewards])
    return RolloutBatch(toks, torch.tensor([len(p) for p in prompts]), torch.tensor([len(t) for t in tokens]),
                        logp, rewards, groups, versions)


class Job:
    def __init__(self, cfg: JobConfig, run_dir: Path):
        self.cfg = cfg
        self.run_dir = run_dir
        self.rank = dist.get_rank()
        self.model_cfg = validate(cfg, dist.get_world_size())
        self.topo = build_topology(_placements(cfg))
        self.t, self.g = self.topo["trainer"], self.topo["generator"]
        trainer_ranks = list(self.t.placement.ranks)
        # Generator replica leaders (tp_rank 0) talk to the controller (rank 0).
        gl = self.g.layout
        self.leaders = [self.g.placement.first_rank + gl.local_rank(0, 0, d) for d in range(gl.dp)]
        self.trainer_ctl = dist.new_group(trainer_ranks, backend="gloo")
        self.ctl = dist.new_group(sorted({0, *self.leaders}), backend="gloo")
        from megatron_rl.checkpointing import initial

        self.initial = initial.megatron_checkpoint(cfg.model.checkpoint)
        self.tok = initial.job_tokenizer(cfg)
        if self.model_cfg.vocab_size < self.tok.vocab_size:
            raise ValueError(f"the tokenizer has {self.tok.vocab_size} tokens but the model's vocabulary only "
                             f"{self.model_cfg.vocab_size}")
        self.stop_ids = tuple(sorted(self.tok.stop_ids))
        # Generator replica leaders score responses (and run reward workers); other ranks only need the prompts.
        self.task = build_task(cfg, self.tok, with_reward=self.rank in self.leaders)
        from megatron_rl.checkpointing.training import TrainCheckpointer

        self.ckpt = TrainCheckpointer(run_dir, keep_last=cfg.checkpoint.keep_last)
        self.start_step = 0
        self._build_models()

    # ---- executors ---------------------------------------------------------------------------------------------
    def _build_models(self) -> None:
        from megatron_rl.ddma.sync import WeightSync
        from megatron_rl.ddma.transport import TransportSettings
        from megatron_rl.inference import Generator
        from megatron_rl.models import build_gpt_model
        from megatron_rl.training.engine import OptimSettings
        from megatron_rl.training.rl_trainer import RLTrainer, RLTrainerSettings

        cfg, m = self.cfg, self.model_cfg
        self.trainer = self.generator = None
        self.gen_int8 = {}
        model = None
        if self.t.is_member:
            model = build_gpt_model(m, self.t.layout, self.t.pgs, attention=cfg.trainer.attention, seed=cfg.run.seed,
                                    params_dtype=resolve_dtype(cfg.trainer.dtype))
        if self.initial is not None and not (cfg.checkpoint.resume and self.ckpt.find(cfg.checkpoint.fallback)):
            # Before the optimizer exists: its main parameters start as copies of these weights. (A run that
            # resumes restores its own weights instead.) Every rank takes part; generators get the weights by DDMA.
            from megatron_rl.checkpointing.initial import load_weights

            load_weights(model, self.initial, self.t.pgs.dp_cp if model is not None else None)
        if self.t.is_member:
            a, tr = cfg.algorithm, cfg.trainer
            warm = tr.warmup_steps_sft > 0
            settings = RLTrainerSettings(
                micro_batch_size=tr.micro_batch_size, temperature=cfg.rollout.temperature,
                aipo=AIPOSettings(rho=a.rho, normalization=a.normalization, ppo_clip=a.ppo_clip,
                                  kl_coef=a.kl_coef, entropy_coef=a.entropy_coef,
                                  importance_weights=a.importance_weights),
                # The warm start (if any) runs its own warm-up and cosine decay; RL then runs at trainer.lr.
                optim=OptimSettings(lr=tr.warmup_lr if warm else tr.lr,
                                    min_lr=tr.warmup_lr / 10 if warm else tr.min_lr,
                                    warmup_steps=10 if warm else tr.warmup_steps,
                                    total_steps=max(tr.warmup_steps_sft, 11) if warm else cfg.run.steps,
                                    lr_decay_style="cosine" if warm else "constant", clip_grad=tr.clip_grad,
                                    weight_decay=tr.weight_decay, adam_beta1=tr.adam_beta1, adam_beta2=tr.adam_beta2,
                                    adam_eps=tr.adam_eps,
                                    use_distributed_optimizer=tr.use_distributed_optimizer,
                                    max_nonfinite_steps=tr.max_nonfinite_steps))
            self.trainer = RLTrainer(model, m, self.t, settings)
        if self.g.is_member:
            attention = cfg.generator.attention
            if cfg.generator.quantization == "int8" and attention == "auto":
                attention = "sdpa"  # int8 layers are Megatron-Core's own linears, not transformer-engine's
            build = dict(attention=attention, seed=cfg.run.seed + 1, params_dtype=resolve_dtype(cfg.generator.dtype))
            if cfg.generator.quantization == "int8":
                from megatron_rl.inference.quantized import build_int8_generator

                # Never holds the full-precision matrices; DDMA writes every weight before the first sample.
                gmodel, self.gen_int8 = build_int8_generator(m, self.g.layout, self.g.pgs, **build)
            else:
                gmodel = build_gpt_model(m, self.g.layout, self.g.pgs, **build)
            self.gen_model = gmodel
            self.generator = Generator(gmodel, m.vocab_size, self.g.pgs.tp,
                                       max_batch_size=cfg.generator.max_batch_size,
                                       max_len=cfg.rollout.max_prompt_length + cfg.rollout.max_new_tokens,
                                       tokenizer=self.tok)
        quantize = None if cfg.generator.quantization == "none" else cfg.generator.quantization
        self.sync = WeightSync(m, self.t, self.g, settings=TransportSettings(quantize=quantize))

    def _push_weights(self, version: int) -> float:
        t0 = time.perf_counter()
        trainer_model = self.trainer.model if self.trainer is not None else None
        gen_model = self.gen_model if self.generator is not None else None
        if gen_model is not None and self.gen_int8:  # int8 weights are written in place, the rest as usual
            gen_model = {**dict(gen_model.named_parameters()), **self.gen_int8}
        self.sync.sync(trainer_model=trainer_model, generator_model=gen_model,
                       step=version if self.trainer is not None else None)
        if self.generator is not None:
            self.generator.weight_version = version
        return time.perf_counter() - t0

    # ---- warm start ----------------------------------------------------------------------------------------------
    def _warm_start(self, log) -> None:
        """Supervised next-token training on the task's answers (trainer ranks), so RL starts from a policy that
        solves some problems: a random tiny model never sees a reward."""
        from megatron_rl.training.lm_loss import make_lm_loss

        steps = self.cfg.trainer.warmup_steps_sft
        if not steps or self.trainer is None:
            return
        engine = self.trainer.engine
        loss_fn = make_lm_loss(self.t.pgs.tp, self.model_cfg.vocab_size)
        bs = 32
        for step in range(steps):
            demos = self.task.demonstrations(step, bs * self.t.layout.dp)
            mine = demos[self.t.dp_rank * bs:(self.t.dp_rank + 1) * bs]
            enc = [(self._encode(prompt), self.tok.encode(answer) + [self.tok.eos_id]) for prompt, answer in mine]
            width = max(len(a) + len(b) for a, b in enc)
            toks = torch.full((bs, width), self.tok.pad_id, dtype=torch.long)
            mask = torch.zeros(bs, width)
            for i, (a, b) in enumerate(enc):
                toks[i, : len(a) + len(b)] = torch.tensor(a + b)
                mask[i, len(a): len(a) + len(b)] = 1
            if torch.cuda.is_available():
                toks, mask = toks.cuda(non_blocking=True), mask.cuda(non_blocking=True)
            metrics = engine.step([{"tokens": toks, "loss_mask": mask}], loss_fn)
            log(step, steps, f"warm-start loss {metrics['loss']:.3f}")
        engine.set_constant_lr(self.cfg.trainer.lr)

    # ---- generator side ------------------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_bos=self.tok.bos_id is not None)

    def _sampling(self, seed: int, n: int):
        from megatron_rl.inference import SamplingParams

        r = self.cfg.rollout
        return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, stop_token_ids=self.stop_ids, n=n, seed=seed)

    def _generate(self, batch: int, version: int, wait_s: float, evaluate: bool) -> Optional[Rollouts]:
        from megatron_rl.inference import GenerationRequest

        r = self.cfg.rollout
        per, n = r.prompts_per_step, r.samples_per_prompt
        problems = self.task.train_batch(batch, per)
        dp, d = self.g.layout.dp, self.g.dp_rank
        mine = list(range(per))[d::dp]
        t0 = time.perf_counter()
        reqs = [GenerationRequest(self._encode(self.task.prompt_text(problems[i])),
                                  self._sampling(self.cfg.run.seed * 7919 + batch * 1000 + i, n))
                for i in mine]
        outs = self.generator.generate(reqs)
        gen_s = time.perf_counter() - t0
        eval_reward = self._evaluate() if evaluate else None
        if self.g.tp_rank != 0:
            return None
        t0 = time.perf_counter()
        texts = [self.tok.decode(o.token_ids) for o in outs]
        rewards = self.task.score([problems[mine[j // n]] for j in range(len(outs))], texts)
        groups = [mine[j // n] for j in range(len(outs))]
        reward_s = time.perf_counter() - t0
        return Rollouts(batch, version, [o.prompt_ids for o in outs], [o.token_ids for o in outs],
                        [o.logprobs for o in outs], rewards, groups, texts[:4], gen_s, reward_s, wait_s, eval_reward)

    def _evaluate(self) -> float:
        """Mean reward on the held-out problems, sampled as in training (this replica's share, all replicas
        see the same set; replicas hold the same weights)."""
        from megatron_rl.inference import GenerationRequest

        n = self.cfg.data.eval_samples
        problems = self.task.eval_records()
        reqs = [GenerationRequest(self._encode(self.task.prompt_text(p)), self._sampling(424242 + i, n))
                for i, p in enumerate(problems)]
        outs = self.generator.generate(reqs)
        if self.g.tp_rank != 0:
            return None
        scores = self.task.score([problems[j // n] for j in range(len(outs))],
                                 [self.tok.decode(o.token_ids) for o in outs])
        return sum(scores) / len(scores)

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def _save_after(self, k: int) -> bool:
        """Is a checkpoint written after trainer step k? Every `save_interval` steps and after the last one."""
        iv = self.cfg.checkpoint.save_interval
        return iv > 0 and ((k + 1) % iv == 0 or k == self.cfg.run.steps - 1)

    def _checkpoint(self, version: int) -> None:
        """Collective over the world: the state after `version` trainer steps. The rollouts of batches that were
        generated with older weights (batches version .. version + s - 1) cannot be regenerated after a restart,
        so the controller collects them first and they go into the checkpoint."""
        from megatron_rl.checkpointing.training import step_dir_name

        n, s = self.cfg.run.steps, self._staleness
        rl_state = None
        if self.rank == 0:
            pending = {}
            for b in range(version, min(version + s, n) if version > 0 else 0):
                pending[b] = [dataclasses.asdict(r) for r in self._collect(b)]
            rl_state = {"step": version, "weight_version": version, "pending": pending,
                        "nonfinite_total": self.trainer.engine.nonfinite_total if self.trainer else 0}
        engine = self.trainer.engine if self.trainer is not None else None
        from megatron_rl.checkpointing.initial import tokenizer_entry

        self.ckpt.save(version, engine, layout=self.t.layout, model_cfg=self.model_cfg, rl_state=rl_state,
                       tokenizer=tokenizer_entry(self.cfg, self.tok, self.initial),
                       extra={"run": self.cfg.run.name, "mode": self.cfg.rollout.mode, "staleness": s})
        if self.rank == 0:
            self._log_line(f"checkpoint {step_dir_name(version)} saved ({self.ckpt.last_save_s:.1f} s)")

    def _resume(self) -> int:
        """Restore the newest checkpoint if there is one; returns the number of trainer steps already done."""
        from megatron_rl.checkpointing.training import CheckpointError

        if not self.cfg.checkpoint.resume:
            return -1
        path = self.ckpt.find(fallback=self.cfg.checkpoint.fallback)
        if path is None:
            return -1
        from megatron_rl.checkpointing.training import verify

        saved_model = verify(path).get("model")
        if saved_model is not None and saved_model != dataclasses.asdict(self.model_cfg):
            diff = sorted(k for k in saved_model if saved_model[k] != dataclasses.asdict(self.model_cfg).get(k))
            raise CheckpointError(f"{path}: written for another model shape (differs in {', '.join(diff)}); use "
                                  f"another checkpoint.dir or run.name, or checkpoint.resume=false")
        meta = self.ckpt.load(path, self.trainer.engine if self.trainer is not None else None)
        rl = meta["rl_state"]
        self.start_step = int(rl["step"])
        self._restored_batches = {int(b) for b in rl.get("pending", {})}
        if self.rank == 0:
            # Stored as whole batches: they stay valid when the generator's layout (its replicas) changed.
            self._restored = {int(b): [Rollouts(**p) for p in parts] for b, parts in rl.get("pending", {}).items()}
            self._log_line(f"resumed from {path} (step {rl['step']}, {len(rl.get('pending', {}))} rollout "
                           f"batches restored)")
        if self.trainer is not None:
            self.trainer.engine.set_constant_lr(self.cfg.trainer.lr)
        return int(rl["step"])

    def _log_line(self, text: str) -> None:
        if self._echo is not None:
            self._echo(text)

    # ---- the loop ------------------------------------------------------------------------------------------------
    def run(self, progress=None, on_row=None, echo=None) -> list[dict]:
        """Run (or resume) the job. `progress(step, total, text)` after every warm-start and RL step,
        `on_row(row)` with each step's metrics as soon as they exist (rank 0), `echo(text)` for log lines."""
        cfg = self.cfg
        n = cfg.run.steps
        s = self._staleness = cfg.rollout.staleness if cfg.rollout.mode == "async" else 0
        log = progress or (lambda *a: None)
        self._on_row, self._echo = on_row, echo
        self._inbox: dict[int, dict[int, Rollouts]] = {}
        self._restored: dict[int, list[Rollouts]] = {}
        self._restored_batches: set[int] = set()
        self._outbox = None
        t_start = time.perf_counter()
        done = self._resume()
        self.start_step = start = max(done, 0)
        if done < 0:
            self._warm_start(log)
            if cfg.checkpoint.save_interval > 0:
                self._checkpoint(0)
        self.warm_s = time.perf_counter() - t_start
        self._push_weights(start)
        # Batches start .. start + s - 1 were generated before the checkpoint and restored with it, except when
        # the earlier run ended before generating them (it had fewer steps): those come from the newest weights.
        gen_start = start
        while gen_start in self._restored_batches:
            gen_start += 1
        saves = [k for k in range(start, n) if self._save_after(k)]
        joins: dict[int, list[int]] = {}  # generator side: after producing batch b, join these saves
        for k in saves:
            joins.setdefault(min(k + s, n - 1), []).append(k + 1)
        rows: list[dict] = []
        colocated = self.trainer is not None and self.generator is not None
        if colocated:
            # Same ranks: no overlap is possible, but the versions follow the same schedule. Before trainer step
            # k the generator holds version k and produces batch k + s (batches 0..s-1 come from version 0).
            for j in range(gen_start, min(start + s, n)):
                self._produce(j, 0.0)
            for k in range(start, n):
                if k > start:
                    self._push_weights(k)
                if k + s < n:
                    self._produce(k + s, 0.0)
                self._consume(k, n, rows, log)
                if self._save_after(k):
                    self._checkpoint(k + 1)
        elif self.generator is not None:
            version = start
            for b in sorted(b for b in joins if b < gen_start):  # saves whose batches were all restored
                for v in joins.pop(b):
                    self._checkpoint(v)
            for j in range(gen_start, n):
                wait = 0.0
                gv = self._version_for(j)
                if gv != version:
                    t0 = time.perf_counter()
                    self._push_weights(gv)
                    wait = time.perf_counter() - t0
                    version = gv
                self._produce(j, wait)
                for v in joins.get(j, []):
                    self._checkpoint(v)
        else:
            for k in range(start, n):
                self._consume(k, n, rows, log)
                if self._save_after(k):
                    self._checkpoint(k + 1)
                if push_after_step(k, n, s):
                    self._push_weights(k + 1)
        if self._outbox is not None:
            self._outbox.flush()
        return rows

    def _version_for(self, k: int) -> int:
        """The weight version batch k is generated with: k - staleness by the schedule, never older than the
        weights the run (re)started from."""
        return max(generation_version(k, self._staleness), self.start_step)

    def _produce(self, k: int, wait: float) -> None:
        n = self.cfg.run.steps
        evaluate = k % max(self.cfg.run.eval_interval, 1) == 0 or k == n - 1
        out = self._generate(k, self._version_for(k), wait, evaluate)
        if out is None:
            return
        if self.rank == 0:
            self._inbox.setdefault(k, {})[0] = out
        else:
            if self._outbox is None:
                self._outbox = Outbox(0, self.ctl)
            self._outbox.send(out)

    def _collect(self, k: int) -> list[Rollouts]:
        """Rank 0: the rollouts of batch k from every generator replica (received now unless already here).
        Each replica sends its batches in order, so the next message from a leader is its oldest unread batch."""
        if k in self._restored:
            return self._restored[k]
        have = self._inbox.setdefault(k, {})
        for leader in self.leaders:
            if leader not in have:
                if leader == 0:
                    raise RuntimeError(f"batch {k} was never produced on rank 0")
                got = recv_object(leader, self.ctl)
                if got.batch != k:
                    raise RuntimeError(f"expected rollouts of batch {k} from rank {leader}, got batch {got.batch}")
                have[leader] = got
        return [have[leader] for leader in self.leaders]

    def _consume(self, k: int, n: int, rows: list, log) -> None:
        row = self._train_step(k)
        log(k + 1, n, "" if row is None else
            f"reward {row['reward']:.2f}" + (f" eval {row['eval/reward']:.2f}" if "eval/reward" in row else ""))
        if row is not None:
            row["warm_start_s"] = self.warm_s
            rows.append(row)
            if self._on_row is not None:
                self._on_row(row)

    def _train_step(self, k: int) -> Optional[dict]:
        t0 = time.perf_counter()
        msg = None
        if self.rank == 0:
            parts = self._collect(k)
            self._inbox.pop(k, None)
            self._restored.pop(k, None)
            batch = _pack(parts, self.tok.pad_id)
            batch.advantages = compute_advantages(batch.rewards, batch.group_ids, self.cfg.algorithm.advantage)
            msg = [batch, parts]
        else:
            msg = [None, None]
        recv_s = time.perf_counter() - t0
        dist.broadcast_object_list(msg, src=0, group=self.trainer_ctl)
        batch, parts = msg
        failpoint("train_step", str(k))
        t1 = time.perf_counter()
        metrics = self.trainer.step(batch)
        train_s = time.perf_counter() - t1
        if self.rank != 0:
            return None
        row = {"step": k, "version_trained": k, "generated_with_version": parts[0].version,
               "staleness": k - parts[0].version, "reward": float(batch.rewards.mean()),
               "time/generation_s": max(p.gen_s for p in parts), "time/reward_s": max(p.reward_s for p in parts),
               "time/train_s": train_s, "time/trainer_wait_s": recv_s,
               "time/generator_wait_s": max(p.wait_s for p in parts), "samples": texts_of(parts)}
        evals = [p.eval_reward for p in parts if p.eval_reward is not None]
        if evals:
            row["eval/reward"] = sum(evals) / len(evals)
            row["eval/version"] = parts[0].version
        for key in ("loss", "grad_norm", "lr", "is_weight_mean", "is_weight_max", "is_truncated_frac", "kl_mu_pi",
                    "logp_diff_mean", "logp_diff_max",
                    "entropy", "response_length", "tokens_per_s", "skipped"):
            v = metrics.get(key)
            row[key] = float(v) if isinstance(v, (int, float, bool)) and not isinstance(v, str) else v
        row["time/total_s"] = time.perf_counter() - t0
        return row


def texts_of(parts) -> list[str]:
    return [t for p in parts for t in p.texts][:4]


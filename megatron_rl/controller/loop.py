"""The RL loop. Start reading here.

One RL step, as LlamaRL draws it:

    prompts -> generate (weights v) -> reward -> advantages -> AIPO step -> DDMA push (v + 1) -> metrics -> checkpoint

`schedule.job_plan` writes the whole run down as one ordered list of actions (which batch is generated with which
weight version, when weights move, when a checkpoint is taken). Every rank walks that same list and does the part
its roles give it: generator ranks generate and score, trainer ranks train on the scored batch with its advantages,
both take part in weight pushes, all in checkpoints; a reward-model executor's ranks score each batch as its replicas
send it (`controller/scoring.py`). A colocated rank does everything, one action after the other; with separate
executors the generator runs up to `rollout.staleness` batches ahead of the trainer, held back only by the weight
pushes it needs, and AIPO corrects for the lag.

With `rollout.in_flight` a Generate also queues the next batch, which takes the slots this one frees, and a push
lands under its running sequences (`inference/live.py`); the list is the same, at `schedule_staleness`.

A SIGTERM or SIGINT ends the run at the next weight push, where every rank is: all save the state there (the
trainer has taken `version` steps; the generator has produced exactly the batches the checkpoint keeps as pending)
and leave the loop (`launch/signals.py`). `heartbeat.doing(label)` names each action, so that a rank that hangs is
reported in it (`parallel/liveness.py`).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from megatron_rl.controller.collector import metrics_row
from megatron_rl.controller.job import Job
from megatron_rl.controller.schedule import Checkpoint, Generate, PushWeights, Train, job_plan
from megatron_rl.failpoints import failpoint
from megatron_rl.parallel.liveness import Heartbeat

Progress = Callable[[str, int, int, str], None]  # (phase, steps done, steps in the phase, text)


def run(job: Job, progress: Optional[Progress] = None, on_row: Optional[Callable[[dict], None]] = None,
        heartbeat: Optional[Heartbeat] = None) -> list[dict]:
    """Run (or resume) the job on this rank. `progress(phase, done, total, text)` after every warm-start and RL
    step (phase "warm-start" or "rl"); `on_row(row)` with each step's metrics as soon as they exist (rank 0);
    `heartbeat`: this rank's, where the launcher watches it. Returns rank 0's rows."""
    cfg = job.cfg
    n = cfg.run.steps
    progress = progress or (lambda *a: None)
    doing = heartbeat.doing if heartbeat is not None else (lambda label: None)
    t_start = time.perf_counter()
    doing("checkpoint load")
    resumed = job.resume()
    start, restored = resumed or (0, set())
    doing("warm start")
    if resumed is None and job.trainer is not None:
        job.trainer.start(progress)  # supervised warm start; the KL reference
    warm_s = time.perf_counter() - t_start
    plan = job_plan(n, job.staleness, start=start, restored=restored, save_interval=cfg.checkpoint.save_interval,
                    save_final=cfg.checkpoint.save_final, eval_interval=cfg.run.eval_interval, fresh=resumed is None)

    rows: list[dict] = []
    push_s = 0.0  # this rank's time at the last weight push: the stop check (which waits for every rank) and the push
    for action in plan:
        doing(str(action))  # what the line names if this rank hangs here (parallel/liveness.py)
        job.raise_if_checkpoint_failed()  # a save that failed in the background ends the job now, in one line
        if isinstance(action, PushWeights):
            t0 = time.perf_counter()
            if job.stop_requested():  # SIGTERM / SIGINT on any rank: every rank takes part here, so all stop here
                job.checkpoint(action.version)
                break
            push_s = time.perf_counter() - t0 + job.push_weights(action.version)

        elif isinstance(action, Generate) and job.generator is not None:
            failpoint("generate", str(action.batch))
            generated = job.generator.generate(action.batch, action.version)
            evaluated = job.generator.evaluate() if action.evaluate else None
            if generated is not None:  # the replica's leader scores its samples and sends them to the controller
                job.send_rollouts(job.score(generated, evaluated, push_s=push_s))
            push_s = 0.0

        elif isinstance(action, Generate) and job.reward_model is not None:
            job.reward_model.serve(action.batch)

        elif isinstance(action, Train) and job.trainer is not None:
            k = action.step
            t0 = time.perf_counter()
            parts = job.scored_rollouts(k)  # the controller's: every replica's scored rollouts (None elsewhere)
            batch = job.batch_with_advantages(k, parts)  # packed, advantages computed, on every trainer rank
            recv_s = time.perf_counter() - t0
            stats = job.trainer.step(batch, k)
            train_s = time.perf_counter() - t0 - recv_s
            row = None
            if job.collector is not None:
                row = metrics_row(k, parts, batch, stats, train_s=train_s, recv_s=recv_s,
                                  kl_ref=cfg.algorithm.kl_coef > 0)
                row["time/total_s"] = time.perf_counter() - t0
                row["warm_start_s"] = warm_s
                rows.append(row)
                if on_row is not None:
                    on_row(row)
            progress("rl", k + 1, n, "" if row is None else f"reward {row['reward']:.2f}"
                     + (f" eval {row['eval/reward']:.2f}" if "eval/reward" in row else ""))

        elif isinstance(action, Checkpoint):
            job.checkpoint(action.version)
    job.finish()
    return rows

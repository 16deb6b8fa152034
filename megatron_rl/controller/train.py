r"""`megatron-rl train`: from a resolved config to `loop.run` on every rank, one path for both kinds of world.

    cli.cmd_train -> train -> ranks started here (launch/spawn.py: run_local) -> rank_main -> loop.run
                           \-> this process as one rank of a torchrun/srun world -> rank_main -> loop.run

The world comes from `--launcher` (`world_from`, `launch/world.py`):

    local  this process starts `world_size_needed` ranks on this machine (gloo on CPUs; NCCL and one
           GPU per rank where CUDA is present).
    env    this process *is* one rank of a world that torchrun or srun started: read the rank and world from the
           environment, check the world against the config, initialise the default process group, run the job.
    auto   env when WORLD_SIZE is set in the environment (torchrun sets it), else local.

`train` validates the config once against the world, prints the one banner, and then takes the same steps for
both worlds, written once:

    before anything is written  the local world: its backend on this machine's GPUs; a rank of a launched world: its
                                stop signals, backend, GPU and rendezvous, and a run directory it must not resume
    lock                        the run directory's (`launch/runlock.py`): the local launcher, or rank 0 of a
                                launched world, holds it while the job runs
    run directory               created and its config.yaml written (`controller/rundir.py: prepare_run_dir`)
    ranks                       `rank_main` (`controller/rank.py`) on the ranks started here, or on this rank
    summary                     from rank 0's result (`controller/summary.py`)

Every rank checks the configuration against the launched world before any collective, so a world of the wrong
size ends at once, with one line (printed by rank 0), on every rank.

How a run ends, in both worlds: a SIGTERM, SIGINT or SIGHUP stops it at the next weight push with a checkpoint
(`launch/signals.py`), exit code 128 + the signal; a rank that fails is named in one line (`JobFailed`), its
traceback, and every other rank's, in `failure.log` in the run directory, exit code 1 (`launch/failures.py`); a
rank whose launcher is gone (killed, or torchrun's agent dead) ends at once, with all it started
(`launch/lifeline.py`).

The launch scripts' helpers are subcommands of `megatron-rl` (cli.py): `world-size`, `check-world`, `failure-line`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from functools import partial
from pathlib import Path
from typing import Optional, Union

from megatron_rl.config import ConfigError, JobConfig, validate
from megatron_rl.controller.metrics import import_plotting_in_background
from megatron_rl.controller.rank import RANK_MODULES, rank_main, rank_role
from megatron_rl.controller.rundir import check_run_dir, prepare_run_dir, run_dir_of
from megatron_rl.controller.summary import write_summary
from megatron_rl.launch import lifeline, signals
from megatron_rl.launch.console import below_bar
from megatron_rl.launch.failures import (JobFailed, RankFailure, RanksFailed, cause_of, rank_failed, ranks_failed,
                                         write_failure_log)
from megatron_rl.launch.runlock import RunLock
from megatron_rl.launch.spawn import (bind_device, init_process_group, job_backend, local_gpus, run_local,
                                      start_fork_server, start_method)
from megatron_rl.launch.world import EnvWorld, LaunchError, LocalWorld, env_world, resolve_launcher, set_rendezvous_env
from megatron_rl.models.presets import ModelConfig
from megatron_rl.parallel import liveness

World = Union[LocalWorld, EnvWorld]


def world_from(launcher: str) -> World:
    """The world of `--launcher`: a launched world's rank and size, read from the environment, or this machine's
    (its size is set once the config is known). ConfigError where the environment names no world it can run."""
    try:
        return env_world() if resolve_launcher(launcher) == "env" else LocalWorld(0)
    except LaunchError as e:
        raise ConfigError(str(e)) from None


def train(cfg: JobConfig, world: World, fit: str = "") -> Optional[dict]:
    """The one path from a resolved config to `loop.run`, for both worlds: the steps of the module docstring.

    Validates once, against the world (each rank of a launched world validates for itself, before any collective,
    so a world of the wrong size ends on every rank at once), and prints the banner where this process speaks for
    the job. Returns the summary where this process speaks for the job; on the other ranks of a launched world,
    None or the stop (`stopped_by`, `stopped_after_step`, `checkpoint`). `fit`: how the layout was fitted to the
    machine's GPUs (`config_fit.fit_to_devices`), for the banner. Raises ConfigError, RunDirLocked, or JobFailed (its
    one line)."""
    model_cfg = check_world(cfg, world.world_size)
    local = isinstance(world, LocalWorld)
    if local:
        _start_ranks_early(cfg)
    if world.rank == 0:
        print(banner(cfg, model_cfg, world, fit), flush=True)
    backend = _local_backend(cfg, world.world_size) if local else _join_world(cfg, world)
    hang_s, collective_s = timeouts()
    run_dir = run_dir_of(cfg)
    lock = RunLock(run_dir, warn=_say) if world.rank == 0 else None
    with lock if lock is not None else contextlib.nullcontext(), contextlib.ExitStack() as held:
        if world.rank == 0:
            prepare_run_dir(cfg)
        model_name = cfg.model.name  # the source's name: a converted source becomes run_dir/initial_model
        if local:
            from megatron_rl.checkpointing import initial

            cfg = held.enter_context(initial.prepared(cfg, run_dir, log=_say))
        t0 = time.perf_counter()
        if local:
            result = _run_ranks(cfg, model_cfg, run_dir, world.world_size, backend, hang_s, collective_s, lock)
        else:
            result = _run_this_rank(cfg, model_cfg, run_dir, world, backend, hang_s, collective_s)
        if world.rank != 0:
            return result.get("stopped")
        extra = {} if local else {"launcher": f"env ({world.source})", "world_size": world.world_size}
        return write_summary(cfg, result, run_dir, time.perf_counter() - t0, {**extra, "backend": backend},
                             model_name=model_name)


def check_world(cfg: JobConfig, world_size: int) -> ModelConfig:
    """The world must have exactly the ranks the executors use (fewer cannot run, more would idle); then the whole
    configuration is validated against it. Returns the resolved model."""
    need = cfg.world_size_needed
    if world_size != need:
        raise ConfigError(f"executors need {need} ranks ({_executors_text(cfg)}) but {world_size} "
                          f"{'was' if world_size == 1 else 'were'} launched")
    return validate(cfg, world_size)


def _executors_text(cfg: JobConfig) -> str:
    t, g = cfg.trainer.layout.size, cfg.generator.layout.size
    text = f"trainer {t}, generator {g} colocated" if cfg.generator.colocated else f"trainer {t} + generator {g}"
    return text + (f" + reward model {cfg.reward.executor.layout.size}" if cfg.reward.model_executor else "")


def rank_preload(cfg: JobConfig) -> tuple[str, ...]:
    """What the local launcher's fork server imports once for all the ranks: `RANK_MODULES`, and transformers'
    tokenizer modules where the job's tokenizer is a Hugging Face one (each rank would import them, about 2 s)."""
    from megatron_rl.checkpointing.initial import job_tokenizer_kind
    from megatron_rl.tokenizers import HF_TOKENIZER_MODULES

    return RANK_MODULES + (HF_TOKENIZER_MODULES if job_tokenizer_kind(cfg) == "hf" else ())


def _start_ranks_early(cfg: JobConfig) -> None:
    """The local launcher's fork server, started before this process imports torch and prepares the run: the
    ranks' imports (`rank_preload`) overlap with both. A bad start method is reported by `_local_backend`."""
    try:
        start_fork_server(rank_preload(cfg))
    except LaunchError:
        pass


def banner(cfg: JobConfig, model: ModelConfig, world: World, fit: str = "") -> str:
    """The job in one line, as it starts: the layout (and how it was fitted to the machine), the precision, and on
    GPUs the kernels the job uses, said once here instead of as the libraries' warnings (`quiet.py`)."""
    from megatron_rl import quiet
    from megatron_rl.models.precision import resolve_dtype_name

    t, g = cfg.trainer, cfg.generator
    kernels = quiet.kernels_text() if quiet.cuda_devices_present() else ""
    experts = (f", {model.num_active_parameters() / 1e6:.1f}M active: {model.moe_router_topk} of "
               f"{model.num_moe_experts} experts" if model.is_moe else "")
    return (f"megatron-rl train: model {cfg.model.name} ({model.num_parameters() / 1e6:.1f}M parameters{experts}), "
            f"trainer tp={t.tp} pp={t.pp} dp={t.dp}{f' ep={t.ep}' if t.ep != 1 else ''}, generator tp={g.tp} pp={g.pp} "
            f"dp={g.dp}{f' ep={g.ep}' if g.ep != 1 else ''}"
            f"{' (colocated)' if g.colocated else ''}, {cfg.rollout.mode} rollouts "
            f"(staleness {cfg.rollout.effective_staleness}), "
            f"trainer {resolve_dtype_name(t.dtype)}, generator {resolve_dtype_name(g.dtype)}"
            f"{f', {g.quantization} generator weights' if g.quantization != 'none' else ''}, {world.world_size} "
            f"process{'es' if world.world_size != 1 else ''}"
            f"{'' if world.source == 'local' else f' started by {world.source}'}{f' ({fit})' if fit else ''}"
            f"{f'; {kernels}' if kernels else ''}")


def timeouts() -> tuple[float, float]:
    """(hang timeout, collective timeout) in seconds (`parallel/liveness.py`); ConfigError for a bad value."""
    try:
        return liveness.hang_timeout_s(), liveness.collective_timeout_s()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def report_config_error(world: World, line: str, wait_s: float = 60.0) -> int:
    """Rank 0 (the local launcher is rank 0) prints the error and exits with 2. The other ranks found the same error
    but stay quiet: they wait for the launcher (torchrun, or srun --kill-on-bad-exit) to end them once rank 0 has
    exited, so the line is printed once and is not lost when a faster rank's exit makes the launcher kill rank 0
    first; after `wait_s` they exit with 2 on their own."""
    if world.rank == 0:
        print(line, file=sys.stderr, flush=True)
    else:
        time.sleep(wait_s)
    return 2


def _say(text: str) -> None:
    print(f"megatron-rl: {text}", file=sys.stderr, flush=True)


# ---- the local world: this process starts the ranks on this machine ------------------------------------------------

def _local_backend(cfg: JobConfig, world_size: int) -> str:
    """Before anything is written: a machine with too few GPUs (or a bad start method) fails in one line."""
    try:
        start_method(local_gpus())
        return job_backend(cfg.run.backend, world_size, local_gpus())
    except LaunchError as e:
        raise ConfigError(str(e)) from None


def _run_ranks(cfg: JobConfig, model_cfg: ModelConfig, run_dir: Path, world_size: int, backend: str, hang_s: float,
               collective_s: float, lock: RunLock) -> dict:
    """`rank_main` on `world_size` ranks started here; rank 0's result, or JobFailed once every rank has ended.
    No time limit on the whole job (a run takes as long as its steps); a dead rank ends it at once, a hung one
    when its heartbeat has been silent for the hang timeout. The ranks are named in the run directory's `lock`
    as they start."""
    def on_signal(signum: int) -> None:
        print(below_bar(f"megatron-rl: {signals.name(signum)}: stopping at the next weight push with a checkpoint "
                        f"(ranks killed after run.stop_grace_s={cfg.run.stop_grace_s:g} s"
                        f"{'; Ctrl-C again kills them now' if signum == signal.SIGINT else ''})"),
              file=sys.stderr, flush=True)

    import_plotting_in_background()  # this process only waits until the ranks end: the summary's plot needs it then
    try:
        return run_local(rank_main, world_size, cfg, model_cfg, str(run_dir), backend=backend, timeout=None,
                         dist_timeout_s=collective_s, hang_timeout_s=hang_s, preload=rank_preload(cfg),
                         stop_grace_s=cfg.run.stop_grace_s, on_signal=on_signal, on_started=lock.record)[0]
    except RanksFailed as e:
        raise failure_report(cfg, run_dir, e) from None


def failure_report(cfg: JobConfig, run_dir: Path, e: RanksFailed) -> JobFailed:
    """The local launcher's one failure report, once every rank has ended (`launch/failures.py: ranks_failed`). A
    checkpoint write the ranks left unfinished is removed first: never read, and on a full disk it holds the space
    the relaunch needs, and failure.log's."""
    from megatron_rl.checkpointing.layout import remove_unfinished

    remove_unfinished(run_dir)
    return ranks_failed(e, run_dir, partial(rank_role, cfg), cfg.run.stop_grace_s, _latest(run_dir))


def _latest(run_dir: Path) -> str:
    from megatron_rl.checkpointing.layout import read_latest

    try:
        latest = read_latest(run_dir)
    except Exception:  # noqa: BLE001 - only for the message
        latest = None
    return f"latest checkpoint {latest.name}" if latest is not None else "no checkpoint saved"


# ---- a launched world: this process is one of its ranks ------------------------------------------------------------

def _join_world(cfg: JobConfig, world: EnvWorld) -> str:
    """Before anything is written, on every rank of a launched world: stop signals noted from here on, the world
    and the model checked, this rank's backend, rendezvous and GPU; and a run directory the job may not resume
    refused on every rank (it only reads), so that a refusal does not leave the others waiting. Returns the
    backend."""
    signals.install()  # from here on a SIGTERM, SIGINT or SIGHUP stops the job at its next consistent point
    lifeline.watch_parent(partial(lifeline.end_this_rank, f"megatron-rl: rank {world.rank}: the process that started "
                                  f"it (pid {os.getppid()}: torchrun's agent or srun's step) has ended; so does the "
                                  f"rank"))
    if not 0 <= world.rank < world.world_size:
        raise ConfigError(f"rank {world.rank} is outside the world of {world.world_size}")
    from megatron_rl.checkpointing.initial import megatron_checkpoint

    try:  # every rank would convert at once: a HF or GGUF source must be converted before the launch
        megatron_checkpoint(cfg.model.checkpoint)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    from megatron_rl.compat import activate

    backend = env_backend(cfg, world, local_gpus())
    set_rendezvous_env(world.master_addr, world.master_port, world.rank, world.world_size, world.local_rank)
    bind_device(world.local_rank)
    activate()  # a no-op when CUDA is present
    check_run_dir(cfg, run_dir_of(cfg))
    return backend


def env_backend(cfg: JobConfig, world: EnvWorld, cuda_devices: int) -> str:
    """run.backend for one rank of a launched world: "auto" is NCCL where CUDA is present; NCCL gives each rank of a
    node its own GPU (LOCAL_RANK), so a node must show at least as many GPUs as it runs ranks."""
    try:
        backend = job_backend(cfg.run.backend, 1, cuda_devices)
    except LaunchError as e:
        raise ConfigError(f"run.backend={cfg.run.backend!r}: {e}") from None
    if backend == "nccl" and world.local_rank >= cuda_devices:
        raise ConfigError(f"rank {world.rank} has local rank {world.local_rank} but its node shows {cuda_devices} "
                          f"GPU{'s' if cuda_devices != 1 else ''}: start at most one rank per GPU")
    return backend


def _run_this_rank(cfg: JobConfig, model_cfg: ModelConfig, run_dir: Path, world: EnvWorld, backend: str,
                   hang_s: float, collective_s: float) -> dict:
    """`rank_main` on this rank of the launched world, in its process group and watched for hung peers; its result,
    or JobFailed (this rank's own report) when it fails."""
    import torch.distributed as dist

    init_process_group(backend, world.rank, world.world_size, collective_s)
    heartbeat = _watch_ranks(cfg, world, run_dir, hang_s)
    try:
        return rank_main(world.rank, world.world_size, cfg, model_cfg, str(run_dir), heartbeat=heartbeat)
    except Exception as e:
        import traceback

        failure = RankFailure(world.rank, cause_of(e), traceback.format_exc())
        raise rank_failed(failure, world.world_size, run_dir, partial(rank_role, cfg)) from None
    finally:
        heartbeat.stop()
        dist.destroy_process_group()


def _watch_ranks(cfg: JobConfig, world: EnvWorld, run_dir: Path, hang_s: float) -> liveness.Heartbeat:
    """This rank's heartbeat through the rendezvous store, started, and its watch over the next ranks of the ring
    (`parallel/liveness.py`): the first rank to find a hung one prints the line and writes failure.log; then every
    rank ends its process, and torchrun or srun ends the hung one."""
    import torch.distributed as dist

    def describe(rank: int, silent_s: float, label: str) -> str:
        return f"megatron-rl: rank {rank} ({rank_role(cfg, rank)}) {liveness.hung_cause(silent_s, label)}"

    def report(line: str) -> None:
        where = write_failure_log(run_dir, f"{line}\n(found by rank {world.rank}, which watches it; the hung rank "
                                           f"wrote nothing: it was stopped or frozen)\n", append=True)
        print(f"{line}; {where}", file=sys.stderr, flush=True)

    def end() -> None:
        os._exit(1)  # from the heartbeat thread: the main thread may be blocked in a collective on the hung rank

    beats = liveness.StoreBeats(dist.distributed_c10d._get_default_store(), world.rank, world.world_size, hang_s,
                                describe, report, end)
    return liveness.Heartbeat(beats.publish, liveness.beat_interval_s(hang_s)).start()

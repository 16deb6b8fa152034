r"""How `megatron-rl train` gets its ranks, and what each rank runs: one path for both kinds of world.

    cli.cmd_train -> train -> _run_local    (this process starts the ranks: launch/spawn.py) -> rank_main -> loop.run
                          \-> _run_launched (this process is one rank of a torchrun/srun world) -> rank_main -> loop.run

`train` validates the config once against the world and prints the one banner; both runners take the run directory
(its lock, its config.yaml), run `rank_main` on every rank (which builds the rank's `Job` and runs `loop.run`), and
end with the one summary writer (`write_summary`, from rank 0's result) or the one failure report (`_failed`).

    local  this process starts `world_size_needed` ranks on this machine (gloo on CPUs; NCCL and one
           GPU per rank where CUDA is present).
    env    this process *is* one rank of a world that torchrun or srun started: read the rank and world from the
           environment, check the world against the config, initialise the default process group, run the job.
    auto   env when WORLD_SIZE is set in the environment (torchrun sets it), else local.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. srun without torchrun sets SLURM_PROCID,
SLURM_NTASKS and SLURM_LOCALID; the rendezvous host is then MASTER_ADDR if set, else the first host of
SLURM_JOB_NODELIST (`scontrol show hostnames`), and the port MASTER_PORT if set, else 29500.

Every rank checks the configuration against the launched world before any collective, so a world of the wrong
size ends at once, with one line (printed by rank 0), on every rank.

How a run ends, in both launchers: the run directory is locked while the job runs (`launch/runlock.py`; the
local launcher takes the lock, or rank 0 of a launched world); a SIGTERM or SIGINT stops it at the next weight push
with a checkpoint (`launch/signals.py`), exit code 128 + the signal; a rank that fails is named in one line
(`JobFailed`), its traceback, and every other rank's, in `failure.log` in the run directory, exit code 1.

The launch scripts' helpers are subcommands of `megatron-rl` (cli.py): `world-size`, `check-world`, `failure-line`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from megatron_rl.config import ConfigError, JobConfig, validate
from megatron_rl.launch import signals
from megatron_rl.controller.rundir import check_run_dir
from megatron_rl.launch.runlock import RunLock
from megatron_rl.models.presets import ModelConfig
from megatron_rl.parallel import liveness

LAUNCHERS = ("auto", "local", "env")
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class EnvWorld:
    """This process's place in an externally started world."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" or "slurm"


def resolve_launcher(choice: str, environ: Optional[dict] = None) -> str:
    """"auto" -> "env" when WORLD_SIZE is set, else "local"; "local" and "env" are returned as they are."""
    env = os.environ if environ is None else environ
    if choice not in LAUNCHERS:
        raise ConfigError(f"--launcher={choice!r} is not allowed: expected one of {', '.join(LAUNCHERS)}")
    if choice == "auto":
        return "env" if env.get("WORLD_SIZE") else "local"
    return choice


def _int_env(env: dict, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list ("node[01-04]" -> "node01"), through scontrol."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=60, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError) as e:
        raise ConfigError(f"cannot expand SLURM_JOB_NODELIST={nodelist!r} with scontrol ({e}); set MASTER_ADDR") \
            from None
    if not out:
        raise ConfigError(f"scontrol listed no hosts for SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR")
    return out[0]


def env_world(environ: Optional[dict] = None) -> EnvWorld:
    """Rank, world size and rendezvous of this process, from torchrun's or srun's environment variables."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise ConfigError(f"--launcher env: RANK and WORLD_SIZE are set but {' and '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} not (start the ranks with torchrun)")
        return EnvWorld(_int_env(env, "RANK"), _int_env(env, "WORLD_SIZE"),
                        _int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
                        env["MASTER_ADDR"], _int_env(env, "MASTER_PORT"), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR")
        if not addr:
            if not env.get("SLURM_JOB_NODELIST"):
                raise ConfigError("--launcher env under srun: neither MASTER_ADDR nor SLURM_JOB_NODELIST is set")
            addr = _first_slurm_host(env["SLURM_JOB_NODELIST"])
        port = _int_env(env, "MASTER_PORT") if env.get("MASTER_PORT") else DEFAULT_PORT
        return EnvWorld(_int_env(env, "SLURM_PROCID"), _int_env(env, "SLURM_NTASKS"),
                        _int_env(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0, addr, port, "slurm")
    raise ConfigError("--launcher env needs a world started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) "
                      "or srun (SLURM_PROCID, SLURM_NTASKS); none is set")


class JobFailed(RuntimeError):
    """The job ended without finishing: `str(e)` is the one line the user sees, `exit_code` the command's."""

    def __init__(self, line: str, exit_code: int):
        super().__init__(line)
        self.exit_code = exit_code


def rank_role(cfg: JobConfig, rank: int) -> str:
    if rank >= cfg.reward_first_rank:
        return "reward model"
    if cfg.generator.colocated:
        return "trainer and generator"
    return "trainer" if rank < cfg.trainer.layout.size else "generator"


FAILURE_LOG = "failure.log"

# What every rank of a job imports (`rank_main`): the local launcher's fork server imports it once for all of them.
RANK_MODULES = ("megatron_rl.controller.launcher", "megatron_rl.controller.loop", "megatron_rl.controller.job")


def _say(text: str) -> None:
    print(f"megatron-rl: {text}", file=sys.stderr, flush=True)


def _say_below_bar(text: str) -> None:
    print(below_bar(f"megatron-rl: {text}"), file=sys.stderr, flush=True)


def below_bar(line: str) -> str:
    """A line printed while rank 0's progress bar may stand unfinished on the console: it replaces the bar on a
    terminal (the bar is drawn again below it) and starts a line of its own in a log."""
    return ("\r\033[K" if sys.stderr.isatty() else "\n") + line


def _executors_text(cfg: JobConfig) -> str:
    t, g = cfg.trainer.layout.size, cfg.generator.layout.size
    text = f"trainer {t}, generator {g} colocated" if cfg.generator.colocated else f"trainer {t} + generator {g}"
    return text + (f" + reward model {cfg.reward.executor.layout.size}" if cfg.reward.model_executor else "")


def freeze_startup_objects() -> None:
    """Move every object alive now (imported modules, the models, optimizers and process groups of the job) out of
    the garbage collector's reach for the rest of the process.

    They live as long as the rank, so a full collection only re-reads them: Megatron-Core's distributed optimizer
    runs one (`gc.collect()`) each time it builds its checkpoint state, which on a CPU made up about half of a small
    model's checkpoint. Objects created later are collected as before; garbage among the frozen ones (cycles left
    by startup, or that become unreachable later) is never freed, a small amount of memory for the rank's life.
    """
    gc.freeze()


def rank_main(rank: int, world_size: int, cfg: JobConfig, model_cfg, run_dir: str) -> dict:
    """One rank of the job (both launchers): build its executors, run the loop; rank 0 shows progress and writes
    metrics.jsonl as rows arrive."""
    from tqdm import tqdm

    from megatron_rl.checkpointing import storage
    from megatron_rl.checkpointing.layout import CheckpointError
    from megatron_rl.checkpointing.training import storage_fault_line
    from megatron_rl.controller import loop
    from megatron_rl.controller.job import Job
    from megatron_rl.controller.metrics import GapWatch, StuckWatch, open_metrics

    t0 = time.perf_counter()
    sft = cfg.trainer.sft_warmup_steps
    bar = tqdm(total=sft + cfg.run.steps, desc="megatron-rl", unit="step", file=sys.stderr,
               dynamic_ncols=True) if rank == 0 else None
    writer = None

    def progress(phase: str, done: int, total: int, text: str) -> None:
        if bar is not None:  # a resumed run's first step moves the bar past the steps done before
            bar.update((done if phase == "warm-start" else sft + done) - bar.n)
            if text:
                bar.set_postfix_str(text, refresh=False)

    def echo(text: str) -> None:
        if bar is not None:
            bar.write(text, file=sys.stderr)

    watches = (GapWatch(cfg.rollout.lag, echo), StuckWatch(model_cfg.vocab_size, echo))

    def on_row(row: dict) -> None:
        nonlocal writer
        if writer is None:  # the first row's step is where this run starts: a resumed run drops later rows
            writer = open_metrics(cfg, Path(run_dir), row["step"], echo)
        writer.write(row)
        for watch in watches:
            watch.see(row)

    failing = False
    try:
        job = Job(cfg, model_cfg, Path(run_dir), echo)
        freeze_startup_objects()
        rows = loop.run(job, progress, on_row=on_row)
    except OSError as e:  # the run directory refused a write (metrics, TensorBoard): a storage fault in one line
        failing = True
        problem = storage.diagnose(Path(run_dir), e)
        if problem is None:
            raise
        raise CheckpointError(storage_fault_line(Path(run_dir), "a write failed", problem)) from e
    except BaseException:
        failing = True
        raise
    finally:
        if bar is not None:
            bar.close()
        if writer is not None:
            try:
                writer.close()
            except OSError:
                if not failing:
                    raise
    stopped = job.saved_version if job.stop_signal else cfg.run.steps
    result = {"rows": rows, "start_step": rows[0]["step"] if rows else stopped, "time_s": time.perf_counter() - t0,
              "compiled_graphs": compiled_graph_report()}
    if job.stop_signal:
        from megatron_rl.checkpointing.training import step_dir_name

        result["stopped"] = {"stopped_by": signals.name(job.stop_signal), "stopped_after_step": job.saved_version,
                             "checkpoint": step_dir_name(job.saved_version)}
    return result


def compiled_graph_report() -> dict:
    """This rank's compiled graphs per kernel (only those that compiled) and the specializations that fell back to
    eager, for summary.json: a recompiling kernel shows here, not only as a slow step."""
    from megatron_rl.compat.compiled import all_kernels, compiled_graph_counts

    report = {name: n for name, n in compiled_graph_counts().items() if n}
    fallbacks = {k.name: len(k.fallbacks) for k in all_kernels() if k.fallbacks}
    return {"graphs": report, "eager_fallbacks": fallbacks} if report or fallbacks else {}


def exit_code(summary: Optional[dict]) -> int:
    """The command's exit code for a job that ended with this summary: 0, or 128 + the signal that stopped it."""
    if summary and summary.get("stopped_by"):
        return signals.exit_code(signal.Signals[summary["stopped_by"]])
    return 0


def stopped_line(summary: dict) -> str:
    return signals.stopped_line(signal.Signals[summary["stopped_by"]], summary["stopped_after_step"],
                                summary["checkpoint"])


def _latest(run_dir: Path) -> str:
    from megatron_rl.checkpointing.layout import read_latest

    try:
        latest = read_latest(run_dir)
    except Exception:  # noqa: BLE001 - only for the message
        latest = None
    return f"latest checkpoint {latest.name}" if latest is not None else "no checkpoint saved"


def _failed(cfg: JobConfig, run_dir: Path, e, one_rank: bool = False) -> JobFailed:
    """The one failure report of both launchers: failure.log holds every failed rank's cause and traceback, and the
    command prints one line naming the rank that most likely caused the failure, and where the tracebacks are.

    The local launcher reports once every rank has ended (`e`, a `RanksFailed`, holds them all, likely cause
    first); a checkpoint write they left unfinished is removed first (never read; on a full disk it holds the space
    the relaunch needs, and failure.log's). A rank of a launched world (`one_rank`) reports only itself and appends
    to the failure.log its failing peers share, its line first (the SLURM recipe prints the first such line); the
    line is empty when its error only reports a failed peer, which prints the cause itself."""
    from megatron_rl.checkpointing import storage
    from megatron_rl.launch.spawn import is_peer_error

    stamp = time.strftime('%Y-%m-%dT%H:%M:%S%z')
    blocks = "".join(f"\n--- rank {f.rank} ({rank_role(cfg, f.rank)}): {f.cause} ---\n{f.report}\n" for f in e.failures)
    line = ""
    if e.failures:
        first = e.first
        what = first.cause if first.cause.startswith(("died", "exited", "hung")) else f"failed: {first.cause}"
        line = f"megatron-rl: rank {first.rank} ({rank_role(cfg, first.rank)}) {what}"
    if one_rank:
        line = "" if is_peer_error(e.first.cause) else line
        where = write_failure_log(run_dir, (f"{line}\n" if line else "") + f"megatron-rl train, {stamp}: rank "
                                  f"{e.first.rank} of {e.world_size} ended without a result\n{blocks}", append=True)
        return JobFailed(f"{line}; {where}" if line else "", 1)
    storage.remove_unfinished(run_dir)
    where = write_failure_log(run_dir, f"megatron-rl train, {stamp}: {len(e.failures)} of {e.world_size} ranks "
                                       f"ended without a result (likely cause first)\n{blocks}")
    if e.killed:
        how = ("at a second SIGINT" if e.killed == "twice"
               else f"run.stop_grace_s={cfg.run.stop_grace_s:g} s after it")
        return JobFailed(f"megatron-rl: stopped by {signals.name(e.signal)}: ranks killed {how}; "
                         f"{_latest(run_dir)}; relaunch to resume", signals.exit_code(e.signal))
    line = f"{line}; {where}"
    if e.signal:
        line = f"megatron-rl: stopped by {signals.name(e.signal)}: {line.removeprefix('megatron-rl: ')}"
    return JobFailed(line, signals.exit_code(e.signal) if e.signal else 1)


@dataclass(frozen=True)
class LocalWorld:
    """The local launcher's world: this process starts `world_size` ranks on this machine and speaks for the job."""

    world_size: int
    rank: int = 0
    source: str = "local"


def train(cfg: JobConfig, world: Union[LocalWorld, EnvWorld], fit: str = "") -> Optional[dict]:
    """The one path from a resolved config to `loop.run`, for both worlds.

    Validates once, against the world (each rank of a launched world validates for itself, before any collective,
    so a world of the wrong size ends on every rank at once), and prints the banner where this process speaks for
    the job. Then `_run_local` starts the ranks here, or `_run_launched` runs this rank of the launched world; both
    take the run directory (its lock, its config.yaml), run `rank_main` on every rank and end with the summary
    (`write_summary`) or the failure report (`_failed`). Returns the summary where this process speaks for the job;
    on the other ranks of a launched world, None or the stop (`stopped_by`, `stopped_after_step`, `checkpoint`).
    `fit`: how the layout was fitted to the machine's GPUs (`config.fit_to_devices`), for the banner.
    Raises ConfigError, RunDirLocked, or JobFailed (its one line)."""
    model_cfg = check_world(cfg, world.world_size)
    if isinstance(world, LocalWorld):
        _start_ranks_early()
    if world.rank == 0:
        print(banner(cfg, model_cfg, world, fit), flush=True)
    if isinstance(world, EnvWorld):
        return _run_launched(cfg, model_cfg, world)
    return _run_local(cfg, model_cfg, world.world_size)


def _start_ranks_early() -> None:
    """The local launcher's fork server, started before this process imports torch and prepares the run: the
    ranks' imports (`RANK_MODULES`) overlap with both. A bad start method is reported by `_run_local`."""
    from megatron_rl.launch.spawn import LaunchError, start_fork_server

    try:
        start_fork_server(RANK_MODULES)
    except LaunchError:
        pass


def banner(cfg: JobConfig, model: ModelConfig, world: Union[LocalWorld, EnvWorld], fit: str = "") -> str:
    """The job in one line, as it starts: the layout (and how it was fitted to the machine), the precision, and on
    GPUs the kernels the job uses, said once here instead of as the libraries' warnings (`quiet.py`)."""
    from megatron_rl import quiet
    from megatron_rl.models.precision import resolve_dtype_name

    t, g = cfg.trainer, cfg.generator
    kernels = quiet.kernels_text() if quiet.cuda_devices_present() else ""
    return (f"megatron-rl train: model {cfg.model.name} ({model.num_parameters() / 1e6:.1f}M parameters), trainer "
            f"tp={t.tp} pp={t.pp} dp={t.dp}, generator tp={g.tp} pp={g.pp} dp={g.dp}"
            f"{' (colocated)' if g.colocated else ''}, {cfg.rollout.mode} rollouts (staleness {cfg.rollout.lag}), "
            f"trainer {resolve_dtype_name(t.dtype)}, generator {resolve_dtype_name(g.dtype)}"
            f"{f', {g.quantization} generator weights' if g.quantization != 'none' else ''}, {world.world_size} "
            f"process{'es' if world.world_size != 1 else ''}"
            f"{'' if world.source == 'local' else f' started by {world.source}'}{f' ({fit})' if fit else ''}"
            f"{f'; {kernels}' if kernels else ''}")


def _run_local(cfg: JobConfig, model_cfg: ModelConfig, world_size: int) -> dict:
    """The local launcher: run the job on this machine with `world_size` processes; returns the summary."""
    from megatron_rl.checkpointing import initial
    from megatron_rl.launch.spawn import LaunchError, RanksFailed, job_backend, local_gpus, run_local, start_method

    try:  # before anything is written: a machine with too few GPUs (or a bad start method) fails in one line
        start_method(local_gpus())
        backend = job_backend(cfg.run.backend, world_size, local_gpus())
    except LaunchError as e:
        raise ConfigError(str(e)) from None
    hang_s, collective_s = timeouts()
    with RunLock(run_dir_of(cfg), warn=_say):  # before anything is written into the run directory
        run_dir = prepare_run_dir(cfg)
        model_name = cfg.model.name  # the source's name: a converted source becomes run_dir/initial_model
        cfg = initial.prepare(cfg, run_dir, log=_say)
        t0 = time.perf_counter()
        # No time limit on the whole job (a run takes as long as its steps); a dead rank ends it at once, a hung one
        # when its heartbeat has been silent for the hang timeout.
        try:
            results = run_local(rank_main, world_size, cfg, model_cfg, str(run_dir), backend=backend, timeout=None,
                                dist_timeout_s=collective_s, hang_timeout_s=hang_s, preload=RANK_MODULES,
                                stop_grace_s=cfg.run.stop_grace_s,
                                on_signal=lambda signum: _say_below_bar(
                                    f"{signals.name(signum)}: stopping at the next weight push with a checkpoint "
                                    f"(ranks killed after run.stop_grace_s={cfg.run.stop_grace_s:g} s"
                                    f"{'; Ctrl-C again kills them now' if signum == signal.SIGINT else ''})"))
        except RanksFailed as e:
            raise _failed(cfg, run_dir, e) from None
        return write_summary(cfg, results[0], run_dir, time.perf_counter() - t0, {"backend": backend},
                             model_name=model_name)


def check_world(cfg: JobConfig, world_size: int) -> ModelConfig:
    """The world must have exactly the ranks the executors use (fewer cannot run, more would idle); then the whole
    configuration is validated against it. Returns the resolved model."""
    need = cfg.world_size_needed
    if world_size != need:
        raise ConfigError(f"executors need {need} ranks ({_executors_text(cfg)}) but {world_size} "
                          f"{'was' if world_size == 1 else 'were'} launched")
    return validate(cfg, world_size)


def run_dir_of(cfg: JobConfig) -> Path:
    return Path(cfg.checkpoint.dir) / cfg.run.name


def prepare_run_dir(cfg: JobConfig) -> Path:
    """The run directory (both launchers): created, the resolved config written (metrics.jsonl is left to
    the job's metrics writer, which starts it afresh or keeps the rows before a resumed step)."""
    import yaml

    run_dir = run_dir_of(cfg)
    check_run_dir(cfg, run_dir)  # a resume that would change what the run trains on is refused here
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "config.yaml.tmp"  # written whole, then renamed: other ranks may read it
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    tmp.replace(run_dir / "config.yaml")
    return run_dir


def _layout_text(section) -> str:
    """tp=2 pp=1 dp=1 (pp and dp only where they are not 1)."""
    return " ".join(f"{d}={getattr(section, d)}" for d in ("tp", "pp", "dp") if d == "tp" or getattr(section, d) != 1)


def write_summary(cfg: JobConfig, result: dict, run_dir: Path, wall: float, extra: Optional[dict] = None,
                  model_name: Optional[str] = None) -> dict:
    """summary.json and metrics.png from rank 0's `rank_main` result (both launchers). The
    rows are those of metrics.jsonl (all steps of the run, including those before a resume) when it exists.
    `model_name` names the model in both (default: `cfg.model.name`)."""
    from megatron_rl.controller.metrics import plot_run, read_metrics

    metrics = run_dir / "metrics.jsonl"
    rows = read_metrics(metrics) if metrics.exists() else result["rows"]
    evals = [r["eval/reward"] for r in rows if "eval/reward" in r]
    summary = {
        "run_dir": str(run_dir), "model": model_name or cfg.model.name, "steps": len(rows),
        "resumed_from_step": result.get("start_step", 0),
        "wall_time_s": round(wall, 1),
        "warm_start_s": round(rows[0]["warm_start_s"], 1) if rows else None,
        "eval_reward_start": evals[0] if evals else None, "eval_reward_end": evals[-1] if evals else None,
        "eval_reward_gain": (evals[-1] - evals[0]) if len(evals) > 1 else None,
        "mean_step_s": sum(r["time/total_s"] for r in rows) / max(len(rows), 1),
        "mode": cfg.rollout.mode, "staleness": cfg.rollout.lag,
        **result.get("stopped", {}), **(extra or {}),
    }
    if result.get("compiled_graphs"):
        summary["compiled_graphs"] = result["compiled_graphs"]
    plot = plot_run(rows, run_dir / "metrics.png",
                    title=f"{summary['model']}: {cfg.rollout.mode} AIPO, trainer {_layout_text(cfg.trainer)}, "
                          f"generator {_layout_text(cfg.generator)}")
    summary["plot"] = str(plot) if plot else None
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def report_config_error(world: Union[LocalWorld, EnvWorld], line: str, wait_s: float = 60.0) -> int:
    """Rank 0 (the local launcher is rank 0) prints the error and exits with 2. The other ranks found the same error
    but stay quiet: they wait for the launcher (torchrun, or srun --kill-on-bad-exit) to end them once rank 0 has
    exited, so the line is printed once and is not lost when a faster rank's exit makes the launcher kill rank 0
    first; after `wait_s` they exit with 2 on their own."""
    if world.rank == 0:
        print(line, file=sys.stderr, flush=True)
    else:
        time.sleep(wait_s)
    return 2


def env_backend(cfg: JobConfig, world: EnvWorld, cuda_devices: int) -> str:
    """run.backend for one rank of a launched world: "auto" is NCCL where CUDA is present; NCCL gives each rank of a
    node its own GPU (LOCAL_RANK), so a node must show at least as many GPUs as it runs ranks."""
    from megatron_rl.launch.spawn import LaunchError, job_backend

    try:
        backend = job_backend(cfg.run.backend, 1, cuda_devices)
    except LaunchError as e:
        raise ConfigError(f"run.backend={cfg.run.backend!r}: {e}") from None
    if backend == "nccl" and world.local_rank >= cuda_devices:
        raise ConfigError(f"rank {world.rank} has local rank {world.local_rank} but its node shows {cuda_devices} "
                          f"GPU{'s' if cuda_devices != 1 else ''}: start at most one rank per GPU")
    return backend


def timeouts() -> tuple[float, float]:
    """(hang timeout, collective timeout) in seconds (`parallel/liveness.py`); ConfigError for a bad value."""
    try:
        return liveness.hang_timeout_s(), liveness.collective_timeout_s()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _run_launched(cfg: JobConfig, model_cfg: ModelConfig, world: EnvWorld) -> Optional[dict]:
    """This process as one rank of a world torchrun or srun started. Returns the summary on rank 0; elsewhere None,
    or the stop when a signal stopped the job. RunDirLocked (rank 0) when another job holds the run directory,
    JobFailed when this rank fails."""
    signals.install()  # from here on a SIGTERM or SIGINT stops the job at its next consistent point
    if not 0 <= world.rank < world.world_size:
        raise ConfigError(f"rank {world.rank} is outside the world of {world.world_size}")
    from megatron_rl.checkpointing.initial import megatron_checkpoint

    try:  # every rank would convert at once: a HF or GGUF source must be converted before the launch
        megatron_checkpoint(cfg.model.checkpoint)
    except ValueError as e:
        raise ConfigError(str(e)) from None

    import torch.distributed as dist

    from megatron_rl.compat import activate
    from megatron_rl.launch.spawn import RankFailure, RanksFailed, bind_device, cause_of, init_process_group, local_gpus

    cuda_devices = local_gpus()
    backend = env_backend(cfg, world, cuda_devices)
    os.environ.update(MASTER_ADDR=world.master_addr, MASTER_PORT=str(world.master_port), RANK=str(world.rank),
                      WORLD_SIZE=str(world.world_size), LOCAL_RANK=str(world.local_rank))
    bind_device(world.local_rank)
    activate()  # a no-op when CUDA is present
    run_dir = run_dir_of(cfg)
    check_run_dir(cfg, run_dir)  # every rank (it only reads), so that a refusal does not leave others waiting
    with RunLock(run_dir, warn=_say) if world.rank == 0 else contextlib.nullcontext():
        if world.rank == 0:
            prepare_run_dir(cfg)
        hang_s, collective_s = timeouts()
        t0 = time.perf_counter()
        init_process_group(backend, world.rank, world.world_size, collective_s)
        _watch_ranks(cfg, world, run_dir, hang_s)
        try:
            result = rank_main(world.rank, world.world_size, cfg, model_cfg, str(run_dir))
        except Exception as e:
            import traceback

            failure = RankFailure(world.rank, cause_of(e), traceback.format_exc())
            raise _failed(cfg, run_dir, RanksFailed([failure], world.world_size), one_rank=True) from None
        finally:
            liveness.uninstall()
            dist.destroy_process_group()
        if world.rank != 0:
            return result.get("stopped")
        return write_summary(cfg, result, run_dir, time.perf_counter() - t0,
                             {"launcher": f"env ({world.source})", "world_size": world.world_size,
                              "backend": backend})


def _watch_ranks(cfg: JobConfig, world: EnvWorld, run_dir: Path, hang_s: float) -> None:
    """This rank's heartbeat through the rendezvous store, and its watch over the next ranks of the ring
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
    liveness.install(liveness.Heartbeat(beats.publish, liveness.beat_interval_s(hang_s)))


def write_failure_log(run_dir: Path, text: str, append: bool = False) -> str:
    """Write failure.log in the run directory; where that cannot be written (a full disk, a read-only or vanished
    directory), in the system's temporary directory. Returns the words for the failure line: "every rank's
    traceback: PATH", saying so when the run directory refused it."""
    import tempfile

    log = run_dir / FAILURE_LOG
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(log, "a" if append else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        return f"every rank's traceback: {log}"
    except OSError as e:
        fd, spare = tempfile.mkstemp(prefix="megatron-rl-failure-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return f"every rank's traceback: {spare} ({log} could not be written: {os.strerror(e.errno or 0)})"


def srun_failure_line(run_dir: Path, torchrun_log: Path, rc: int) -> str:
    """The one line a SLURM recipe prints when srun ended with `rc` != 0 (`launch/slurm/*.sbatch`): the failing
    rank's own line (the first `megatron-rl:` line in failure.log: a rank that raised, or the watcher of a hung
    rank), else a stop's line from the ranks' output, else the rank torchrun found dead (a signal before an exit
    code), else srun's exit code; with where the reports are."""
    import re

    log_words = f"torchrun's report: {torchrun_log}"
    failure = run_dir / FAILURE_LOG
    if failure.is_file():
        for line in failure.read_text(errors="replace").splitlines():
            if line.startswith("megatron-rl: "):
                return f"{line}; every rank's traceback: {failure}; {log_words}"
    text = torchrun_log.read_text(errors="replace") if torchrun_log.is_file() else ""
    for line in re.split(r"[\r\n]", text):
        if line.startswith("megatron-rl: stopped by "):
            return line
    causes = [(int(code), int(rank)) for rank, code in
              re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*exitcode\s*:\s*(-?\d+)", text)]
    if causes:
        code, rank = min(causes, key=lambda c: (c[0] >= 0, causes.index(c)))  # a signal death first
        try:
            from megatron_rl.config import load_config

            role = f" ({rank_role(load_config(run_dir / 'config.yaml', []), rank)})"
        except Exception:  # noqa: BLE001 - the role only adds to the line
            role = ""
        import signal as signal_mod

        what = (f"died with signal {-code} ({signal_mod.Signals(-code).name})" if code < 0
                else f"exited with code {code}")
        return f"megatron-rl: rank {rank}{role} {what}; {log_words}"
    return f"megatron-rl: srun exited with code {rc} before any rank reported; {log_words}"

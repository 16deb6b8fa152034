"""A job's run directory: where it is (`run_dir_of`), the run it already holds checked against the job about to use
it before anything is written (`check_run_dir`), and its preparation for the job (`prepare_run_dir`).

A run directory (`checkpoint.dir/run.name`) holds one run. Launching the same job again resumes it (after a crash,
or with a larger run.steps to extend it), and a relaunch may change how the run executes, never what it trains:

    may change  run.name, run.steps, run.eval_interval, run.world_size, run.backend, run.wandb.*, run.stop_grace_s;
                checkpoint.*; trainer.lr (a run that went unstable resumes at a lower rate);
                the executors' layouts and kernels: trainer.tp / pp / dp, trainer.micro_batch_size, trainer.packing,
                trainer.max_tokens_per_micro_batch, trainer.attention, trainer.max_nonfinite_steps, the step guard's
                trainer.spike_factor and trainer.max_guarded_steps, generator.* (a
                trainer checkpoint loads at any layout, a step does not depend on how its batch is split, the
                generator's weights come from the trainer); reward.timeout_s, reward.num_workers
    may not     everything else: model.*, data.*, reward.kind / function / model, algorithm.*, rollout.*, run.seed,
                and the rest of the optimizer and its precision (trainer.lr_warmup_steps, ..., trainer.dtype,
                use_distributed_optimizer)

`checkpoint.resume=false` where checkpoints exist is refused as well: a fresh run there would mix its checkpoints
with the earlier run's (pruning keeps the highest step numbers, the earlier run's), and its metrics.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.checkpointing.layout import list_checkpoints
from megatron_rl.config import ConfigError, JobConfig
from megatron_rl.models.presets import PRESETS

# Fields a resume may change: a name, or a section prefix ending in ".".
RESUMABLE = ("run.name", "run.steps", "run.eval_interval", "run.world_size", "run.backend", "run.wandb.",
             "run.stop_grace_s", "checkpoint.", "trainer.lr", "trainer.tp", "trainer.pp", "trainer.dp", "trainer.ep",
             "trainer.micro_batch_size", "trainer.packing", "trainer.max_tokens_per_micro_batch", "trainer.attention",
             "trainer.max_nonfinite_steps", "trainer.spike_factor", "trainer.max_guarded_steps", "generator.",
             "reward.timeout_s", "reward.num_workers")


def may_change_on_resume(key: str) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in RESUMABLE)


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _model_fields(model: dict) -> dict:
    """The model section with its preset's shape filled in, so that naming a preset's own value is no change."""
    preset = model.get("preset")
    shape = dataclasses.asdict(PRESETS[preset]) if preset in PRESETS and not model.get("checkpoint") else {}
    shape.pop("name", None)
    return {**shape, **model}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def changed_fields(saved: dict, cfg: JobConfig) -> list[str]:
    """The fields a resume may not change (see the module docstring) on which `cfg` differs from a run's saved
    config.yaml, each as "key (old -> new)". Outside the model section, a field one side lacks (added or retired
    since the run started) is not compared."""
    new = cfg.to_dict()
    old = dict(saved)
    old["model"], new["model"] = _model_fields(old.get("model") or {}), _model_fields(new["model"])
    old, new = _flat(old), _flat(new)
    changed = []
    for key in dict.fromkeys([*old, *new]):
        if may_change_on_resume(key) or (not key.startswith("model.") and (key not in old or key not in new)):
            continue
        if old.get(key) != new.get(key):
            changed.append(f"{key} ({_short(old.get(key))} -> {_short(new.get(key))})")
    return changed


def check_run_dir(cfg: JobConfig, run_dir: Path) -> None:
    """Raise ConfigError (one line) when the job would mix with the run that `run_dir` holds: a resume that changes
    what the run trains on, or `checkpoint.resume=false` where checkpoints exist. Reads only; call it before
    anything is written into `run_dir`. A directory without checkpoints is never refused (nothing to resume)."""
    steps = [p.name for _, p in list_checkpoints(run_dir)]  # complete-looking checkpoints, oldest first
    if not steps:
        return
    if not cfg.checkpoint.resume:
        raise ConfigError(f"checkpoint.resume=false, but {run_dir} holds an earlier run's checkpoints (newest "
                          f"{steps[-1]}); starting afresh there would mix the two runs: use a new run.name, or "
                          f"delete {run_dir}")
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return
    try:
        old = yaml.safe_load(saved.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        old = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if not isinstance(old, dict):
        raise ConfigError(f"{saved}: cannot read the configuration of the run to resume ({old!r:.80}); restore it, "
                          f"or delete it to resume without comparing")
    changed = changed_fields(old, cfg)
    if changed:
        raise ConfigError(f"{run_dir} holds a run trained with other settings: {', '.join(changed)}; a resume may "
                          f"change the layouts, steps and intervals, not what the run trains on: use a new run.name, "
                          f"or the run's own settings")


WORKER_LOG = "workers.log"  # what the job's reward and environment workers print, and their calls' tracebacks


def run_dir_of(cfg: JobConfig) -> Path:
    return Path(cfg.checkpoint.dir) / cfg.run.name


def worker_log(cfg: JobConfig) -> Path:
    """The file the job's reward-function and environment workers write to (their prints, warnings, and the
    traceback of every call that failed), so that the console keeps the job's own lines."""
    return run_dir_of(cfg) / WORKER_LOG


def prepare_run_dir(cfg: JobConfig) -> Path:
    """The run directory (both launchers): checked against the run it holds (`check_run_dir`), created, the
    resolved config written (metrics.jsonl is left to the job's metrics writer, which starts it afresh or keeps the
    rows before a resumed step)."""
    run_dir = run_dir_of(cfg)
    check_run_dir(cfg, run_dir)  # a resume that would change what the run trains on is refused here
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "config.yaml.tmp"  # written whole, then renamed: other ranks may read it
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    tmp.replace(run_dir / "config.yaml")
    return run_dir

"""What a finished (or stopped) run did, and how the command ends for it.

    write_summary  summary.json and metrics.png in the run directory, from rank 0's `rank_main` result (both
                   worlds); the command prints the same summary as its one line of JSON
    exit_code      0, or 128 + the signal that stopped the run (`launch/signals.py`)
    stopped_line   the line a stopped run prints: which signal, after which step, which checkpoint holds it
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Optional

from megatron_rl.config import JobConfig
from megatron_rl.launch import signals


def _layout_text(section) -> str:
    """tp=2 pp=1 dp=1 (pp, dp and ep only where they are not 1)."""
    return " ".join(f"{d}={getattr(section, d)}" for d in ("tp", "pp", "dp", "ep")
                    if d == "tp" or getattr(section, d) != 1)


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
        "mode": cfg.rollout.mode, "staleness": cfg.rollout.effective_staleness,
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


def exit_code(summary: Optional[dict]) -> int:
    """The command's exit code for a job that ended with this summary: 0, or 128 + the signal that stopped it."""
    if summary and summary.get("stopped_by"):
        return signals.exit_code(signal.Signals[summary["stopped_by"]])
    return 0


def stopped_line(summary: dict) -> str:
    return signals.stopped_line(signal.Signals[summary["stopped_by"]], summary["stopped_after_step"],
                                summary["checkpoint"])

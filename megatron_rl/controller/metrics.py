"""Metrics of a run: one JSON row per step in metrics.jsonl, TensorBoard scalars when available, a PNG summary."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional


class MetricsWriter:
    """Appends each step's row as soon as it exists (a crash loses nothing already logged).

    `start_step`: the step this process starts at. Rows from step `start_step` on, written by an earlier process
    that died after its last checkpoint, are dropped (those steps run again), so every step has exactly one row;
    TensorBoard purges them the same way. A fresh run (start 0) starts an empty file.
    """

    def __init__(self, run_dir: Path, start_step: int = 0):
        self.path = run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) < start_step] if self.path.exists() else []
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(self.path)
        self._file = open(self.path, "a")
        self._tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step if start_step else None)
        except Exception:  # tensorboard is optional (pip install tensorboard)
            self._tb = None

    def write(self, row: dict) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(k, v, row["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path) -> list[dict]:
    rows = []
    for line in open(path):
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line cut short by a crash
            continue
    return rows


def plot_run(rows: list[dict], out: Path, title: Optional[str] = None) -> Optional[Path]:
    """Reward, held-out reward, staleness and the step-time breakdown as one PNG (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    ax.plot(steps, [r["reward"] for r in rows], label="train reward (accuracy)", alpha=0.6)
    ev = [(r["step"], r["eval/reward"]) for r in rows if "eval/reward" in r]
    if ev:
        ax.plot([e[0] for e in ev], [e[1] for e in ev], "o-", label="held-out reward (accuracy)")
    ax.set_xlabel("step")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("reward")
    ax = axes[1]
    ax.plot(steps, [r.get("staleness", 0) for r in rows], label="staleness (versions)")
    ax.plot(steps, [r.get("is_truncated_frac", 0) for r in rows], label="IS weights truncated (fraction)")
    ax.set_xlabel("step")
    ax.legend()
    ax.set_title("asynchrony")
    ax = axes[2]
    for key, label in (("time/total_s", "trainer step (total)"), ("time/train_s", "training"),
                       ("time/generation_s", "generation (generator)"), ("time/trainer_wait_s", "trainer idle"),
                       ("time/generator_wait_s", "generator idle (weight sync)")):
        ax.plot(steps, [r.get(key, 0.0) for r in rows], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    ax.set_title("step time (async: generation overlaps training)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out

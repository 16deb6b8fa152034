"""Metrics of a run: one JSON row per step in metrics.jsonl, TensorBoard scalars when available, a PNG summary,
and optionally a Weights & Biases run with the same scalars, the PNG and sample rollouts (`run.wandb`)."""

from __future__ import annotations

import json
import math
import netrc
import os
import secrets
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional
from urllib.parse import urlparse

if TYPE_CHECKING:
    from megatron_rl.config import JobConfig
    from megatron_rl.run_settings import WandbSettings


class MetricsWriter:
    """Appends each step's row as soon as it exists (a crash loses nothing already logged).

    `start_step`: the step this process starts at. Rows from step `start_step` on, written by an earlier process
    that died after its last checkpoint, are dropped (those steps run again), so every step has exactly one row;
    TensorBoard purges them the same way. A fresh run (start 0) starts an empty file.
    """

    def __init__(self, run_dir: Path, start_step: int = 0, wandb: Optional["WandbLogger"] = None):
        self.wandb = wandb
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
            for k, v in scalars(row).items():
                self._tb.add_scalar(k, v, row["step"])
        if self.wandb is not None:
            self.wandb.log(row)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self.wandb is not None:
            self.wandb.finish(read_metrics(self.path))


def open_metrics(cfg: "JobConfig", run_dir: Path, start_step: int, echo: Optional[Callable[[str], None]] = None
                 ) -> MetricsWriter:
    """The metrics writer of a job's rank 0, with a W&B run when `run.wandb` asks for one (`echo` tells the user
    where it goes, around the progress bar). A W&B run that cannot start (no network for an online run, a bad
    entity) costs one line, never the training run."""
    echo = echo or (lambda text: print(text, file=sys.stderr, flush=True))
    wandb = None
    if cfg.run.wandb.enabled:
        try:
            wandb = WandbLogger(cfg.run.wandb, run_dir, start_step, cfg.to_dict(), cfg.run.name)
            echo(f"megatron-rl: {wandb.where()}")
        except Exception as e:  # noqa: BLE001 - W&B raises many kinds; the job goes on with its own files
            echo(f"megatron-rl: W&B logging is off for this run: {type(e).__name__}: {e}")
    return MetricsWriter(run_dir, start_step=start_step, wandb=wandb)


# The trainer-generator log-prob gap (`logp_diff_mean`, the mean |logp_pi - logp_mu| over a step's response tokens)
# above which the staleness study on the real-model recipe saw held-out accuracy fall (docs/benchmarks.md, "The
# seeded study"): over 3 seeds, staleness 1 learned as well as sync and its 5-step mean gap never passed 0.072;
# staleness 4 ended 0.18-0.37 below sync (which gained 0.52) with or without a correction, and its 5-step mean
# passed 0.08 by step 6 (staleness 2, one seed: 0.08-0.09, and it fell too). tests/test_loop.py replays the study's
# runs through GapWatch.
LOGP_GAP_WARN = 0.08
GAP_WINDOW = 5  # steps the gap is averaged over before it is compared


class GapWatch:
    """Tells the user, once per process, when the trainer-generator log-prob gap averaged over the last
    `GAP_WINDOW` steps passes `LOGP_GAP_WARN`: the generator runs far enough behind (or computes differently enough)
    that learning suffered there in the study."""

    def __init__(self, staleness: int, say: Callable[[str], None]):
        self.staleness, self.say = staleness, say
        self.recent: list[float] = []
        self.warned = False

    def see(self, row: dict) -> None:
        gap = row.get("logp_diff_mean")
        if self.warned or not isinstance(gap, (int, float)) or not math.isfinite(gap):
            return
        self.recent = (self.recent + [float(gap)])[-GAP_WINDOW:]
        mean = sum(self.recent) / len(self.recent)
        if len(self.recent) == GAP_WINDOW and mean > LOGP_GAP_WARN:
            self.warned = True
            self.say(f"megatron-rl: warning: at step {row.get('step')} the trainer and the generator differ by "
                     f"{mean:.3f} nats a token (logp_diff_mean over {GAP_WINDOW} steps, rollout staleness "
                     f"{self.staleness}); past {LOGP_GAP_WARN}, held-out accuracy fell in the staleness study "
                     f"(docs/benchmarks.md): lower rollout.staleness, or check generator.dtype and "
                     f"generator.quantization")


# A run that cannot learn: the gradient norm exactly 0 (no response of a prompt scored differently from the others,
# so every advantage is 0, or the model collapsed), or the policy uniform over the vocabulary (its entropy the log of
# the vocabulary's size: a learning rate far too high flattens every logit), for STUCK_STEPS steps in a row. A
# model fresh from its random initialization sits about 0.01 nats below uniform (logits of std 0.2), so "uniform"
# means within UNIFORM_NATS of it.
STUCK_STEPS = 5
UNIFORM_NATS = 1e-3


class StuckWatch:
    """Tells the user, once per process, when the gradient norm has been exactly zero, or the policy uniform over
    the `vocab_size` tokens, for `STUCK_STEPS` steps in a row: such a run goes on to its end with nothing learned
    and exit code 0."""

    def __init__(self, vocab_size: int, say: Callable[[str], None]):
        self.uniform_entropy = math.log(vocab_size)
        self.vocab_size, self.say = vocab_size, say
        self.zero_grad = self.uniform = 0  # steps in a row
        self.warned = False

    def see(self, row: dict) -> None:
        if self.warned:
            return
        grad, entropy = row.get("grad_norm"), row.get("entropy")
        if isinstance(grad, (int, float)):
            self.zero_grad = self.zero_grad + 1 if grad == 0 else 0
        if isinstance(entropy, (int, float)):
            self.uniform = self.uniform + 1 if abs(entropy - self.uniform_entropy) <= UNIFORM_NATS else 0
        if max(self.zero_grad, self.uniform) < STUCK_STEPS:
            return
        self.warned = True
        lower = "lower trainer.lr (or trainer.sft_lr, for the warm start)"
        flat = (f"uniform over the {self.vocab_size} tokens (entropy {entropy:.4f} = ln {self.vocab_size})"
                if self.uniform else "")
        if self.zero_grad and self.uniform:
            what = (f"the gradient norm has been exactly 0 for {self.zero_grad} steps in a row and the policy "
                    f"{flat} for {self.uniform} steps: the model has collapsed and is not learning; {lower}")
        elif self.uniform:
            what = f"the policy has been {flat} for {self.uniform} steps in a row: the model has collapsed; {lower}"
        else:
            what = (f"the gradient norm has been exactly 0 for {self.zero_grad} steps in a row: the run is not "
                    f"learning (every response scored the same as the others of its prompt, so every advantage is 0, "
                    f"or the model has collapsed)")
        self.say(f"megatron-rl: warning: at step {row.get('step')} {what}")


def scalars(row: dict) -> dict[str, float]:
    """The plottable values of a row (what TensorBoard and W&B get): finite numbers, not booleans or lists."""
    return {k: v for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def wandb_logged_in(environ: Optional[dict] = None) -> bool:
    """Whether W&B has credentials here without asking its server: WANDB_API_KEY, or the netrc entry that
    `wandb login` writes for the W&B host (WANDB_BASE_URL, default api.wandb.ai)."""
    env = os.environ if environ is None else environ
    if env.get("WANDB_API_KEY"):
        return True
    host = urlparse(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return netrc.netrc(env.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(mode: str, environ: Optional[dict] = None) -> str:
    """`run.wandb.mode` as W&B's own mode: "auto" is WANDB_MODE when set, else online with a login, else offline."""
    if mode != "auto":
        return mode
    env = os.environ if environ is None else environ
    if env.get("WANDB_MODE") in ("online", "offline", "disabled"):
        return env["WANDB_MODE"]
    return "online" if wandb_logged_in(env) else "offline"


class WandbLogger:
    """The run in Weights & Biases: each metrics row's scalars at its step, the rows' sample rollouts in one table
    (step, sample, text) that grows with the run, and the run's PNG plot at the end.

    One W&B run per run directory: its id is kept in `<run dir>/wandb_run_id`. A process that resumes the job
    from a checkpoint (`start_step` > 0) continues that W&B run; a fresh start (step 0) begins a new one, as
    metrics.jsonl does. Rows are logged at W&B step = the job's step: online, W&B ignores a step below the run's
    last one, so the steps a resumed job runs again keep the values logged first. W&B's files go under
    `<run dir>/wandb/`; offline, each process writes its own directory there, under the same run id, for
    `wandb sync`. Runs in rank 0's process; `wandb` is imported only when a job asks for it.
    """

    ID_FILE = "wandb_run_id"

    def __init__(self, settings: "WandbSettings", run_dir: Path, start_step: int, config: dict, default_name: str):
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / self.ID_FILE
        run_id = id_file.read_text().strip() if start_step > 0 and id_file.exists() else ""
        if not run_id:
            run_id = secrets.token_hex(6)  # W&B ids: letters, digits, - and _
            tmp = id_file.with_suffix(".tmp")
            tmp.write_text(run_id + "\n")
            tmp.replace(id_file)
        self.run_dir = run_dir
        self.run = wandb.init(project=settings.project or "megatron-rl", entity=settings.entity,
                              name=settings.name or default_name, id=run_id, resume="allow", dir=str(run_dir),
                              mode=wandb_mode(settings.mode), config=config,
                              settings=wandb.Settings(console="off", silent=True))
        self._wandb = wandb
        self._samples = wandb.Table(columns=["step", "sample", "text"], log_mode="INCREMENTAL")

    def where(self) -> str:
        """Where the run goes, for the user: its page, or the offline directory to upload."""
        if self.run.settings.mode == "offline":
            return f"W&B run {self.run.id} is offline; upload it with: wandb sync {Path(self.run.dir).parent}"
        return f"W&B run {self.run.id}: {self.run.url}"

    def log(self, row: dict) -> None:
        data: dict[str, Any] = dict(scalars(row))
        samples = row.get("samples") or []
        for i, text in enumerate(samples):
            self._samples.add_data(row["step"], i, text)
        if samples:
            data["samples"] = self._samples
        self.run.log(data, step=row["step"])

    def finish(self, rows: list[dict]) -> None:
        """Log the plot of all the run's rows (those of earlier processes too) at the last step, and close."""
        try:
            if rows:
                png = plot_run(rows, self.run_dir / "wandb" / "metrics.png")
                if png is not None:
                    self.run.log({"plot": self._wandb.Image(str(png))}, step=rows[-1]["step"])
        finally:
            self.run.finish()


def read_metrics(path: Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line cut short by a crash
                continue
    return rows


def _import_plotting() -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except ImportError:
        pass


def import_plotting_in_background() -> threading.Thread:
    """Import matplotlib (Agg) and pyplot in a daemon thread, for a process that waits while its ranks run (the
    local launcher): `plot_run` at the end then finds them imported. The import took 1.5-2 s of the command's end on
    this 2-core machine, after the ranks had finished; in the background it overlaps the ranks' work. Python's
    per-module import locks make a `plot_run` that starts first wait for it, not import twice."""
    thread = threading.Thread(target=_import_plotting, name="import-matplotlib", daemon=True)
    thread.start()
    return thread


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
    if all(0 <= r["reward"] <= 1 for r in rows):  # a verifier's accuracy (a reward model's score is unbounded)
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
                       ("time/generator_wait_s", "generator idle (weight sync)"),
                       ("time/reward_model_s", "reward model (its own ranks)")):
        if any(key in r for r in rows):
            ax.plot(steps, [r.get(key, 0.0) for r in rows], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    ax.set_title("step time (async: generation overlaps training)")
    if title:
        fig.suptitle(title)
    # Fixed margins for this fixed figure: `tight_layout` measured every tick label's box to find them, 0.3 of the
    # 0.6 s a plot took at the end of every run on a 2-core machine, for the same picture.
    fig.subplots_adjust(left=0.04, right=0.99, bottom=0.12, top=0.85 if title else 0.9, wspace=0.18)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out

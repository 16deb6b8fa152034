"""The LlamaRL paper's step-time table, predicted by the planner (the planner's validation against published numbers).

The paper's table: Llama 3.1 8B on 256 GPUs, 70B (GPU count not given), 405B on 1024 GPUs; a
DeepSpeed-Chat-like synchronous step and a LlamaRL (asynchronous) step for each.

Assumptions, each with where it comes from:
- hardware: H100 80GB, the shipped calibration (`planning/h100.yaml`, every rate sourced there);
- layouts: our recipes, `configs/llama3-{8b,70b,405b}.yaml` (launch/README.md explains them; 70B runs on 512
  GPUs there because the paper gives no count); the synchronous baseline puts the trainer's TP x PP on all GPUs;
- workload: the paper's per-step workload is not in what we hold, so one workload is assumed for all three sizes,
  `PAPER_WORKLOAD`: 256 prompts x 8 samples, 512-token prompts, 768-token responses (GSM8K/MATH-length answers; chosen
  once, by comparing a small grid of round values against the table, and shared by all six predictions);
- the baseline generates with an unoptimized engine (`baseline_decode_efficiency`, from our measured transformers
  vs ours ratio) at the job's batch setting where its memory allows;
- the trainer's TP, pipeline and DP communication is added to its single-GPU MFU at the calibrated link rates, as
  the job runs it (exposed: no transformer-engine overlap, no sequence parallelism, gradients reduced in fp32
  after the last micro-batch; `planning/steptime.py`).

The 405B asynchronous step is the one the planner misses (tests/test_plan.py keeps it as a strict expected
failure). Our recipe's step is bound by training, plus the sync; the paper's 59.5 s is about 1.5x that. What was
checked and does not account for it: the pipeline bubble (PP14 with 512 micro-batches of one sequence per DP rank:
2.5%), TP/PP/DP communication (now in the model: +13%), the DDMA sync (2.8 s planned against the paper's "about
2 s"), KV-cache capacity (the int8 generator holds 29 sequences per replica in one wave, well under its 96 slots)
and the max-length straggler (every response already runs to the cap). What would: a generator or trainer that
runs at about two thirds of the calibrated H100 rates at this scale (the calibration's MFU and decode efficiency
are single-GPU measurements of an 8B decode and a 1B training step), or a larger per-step workload at 405B than
at 8B/70B; the paper's text we hold states neither its layouts nor its workload, so either would be a fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_rl.config import load_config, validate
from megatron_rl.planning.calibration import Calibration
from megatron_rl.planning.plan import make_plan

PAPER_STEP_TIMES = {  # model: (DeepSpeed-Chat-like sync step s, LlamaRL async step s), from the paper
    "llama3-8b": (22.45, 8.90),
    "llama3-70b": (82.32, 20.67),
    "llama3-405b": (635.8, 59.5),
}
PAPER_WORKLOAD = ["rollout.prompts_per_step=256", "rollout.samples_per_prompt=8", "rollout.max_prompt_length=512",
                  "rollout.max_new_tokens=768"]


@dataclass(frozen=True)
class PaperRow:
    model: str
    gpus: int
    paper_sync_s: float
    paper_async_s: float
    sync_s: float
    async_s: float

    @property
    def sync_error(self) -> float:
        return self.sync_s / self.paper_sync_s - 1

    @property
    def async_error(self) -> float:
        return self.async_s / self.paper_async_s - 1


def reproduce_paper(configs: Path, calibration: Calibration) -> list[PaperRow]:
    """Plan each recipe under the paper workload; one row per model."""
    rows = []
    for name, (paper_sync, paper_async) in PAPER_STEP_TIMES.items():
        cfg = load_config(Path(configs) / f"{name}.yaml", PAPER_WORKLOAD)
        model = validate(cfg, cfg.run.world_size)
        plan = make_plan(cfg, model, calibration)
        rows.append(PaperRow(name, plan.assumptions["gpus"], paper_sync, paper_async, plan.steps.sync_s,
                             plan.steps.async_s))
    return rows

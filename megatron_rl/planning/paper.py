"""The LlamaRL paper's step-time table, predicted by the planner (the planner's validation against published numbers).

The paper's table: Llama 3.1 8B on 256 GPUs, 70B (GPU count not given), 405B on 1024 GPUs; a
DeepSpeed-Chat-like synchronous step and a LlamaRL (asynchronous) step for each.

Assumptions, each with where it comes from:
- hardware: H100 80GB, the shipped calibration (`planning/h100.yaml`, every rate sourced there);
- layouts: our recipes, `configs/llama3-{8b,70b,405b}.yaml` (launch/README.md explains them; 70B runs on 512
  GPUs there because the paper gives no count); the synchronous baseline puts the trainer's TP x PP on all GPUs.
  For 405B the trainer/generator split (448 trainer GPUs at TP8 x PP14 x DP4, 576 generator GPUs), the int8
  generator and the workload below are ours: the parts of the paper we can read state none of them (nor its
  layout: PP16 is Llama 3's pretraining layout, not a LlamaRL number);
- the paper's trainer: its figure caption says "The policy model has two instances, implementing based on the Fully
  Sharded Data Parallel (FSDP) and CUDA Graph for training and inference optimizations, respectively". An FSDP
  trainer gathers parameters in every micro-batch's forward and backward; the step model counts one gradient and
  parameter exchange per step (Megatron-Core DDP with the distributed optimizer, as our job trains), so the planned
  trainer is likely optimistic for the paper's system;
- workload: the paper's per-step workload is not in what we hold, so one workload is assumed for all three sizes,
  `PAPER_WORKLOAD`: 256 prompts x 8 samples, 512-token prompts, 768-token responses (GSM8K/MATH-length answers; chosen
  once, by comparing a small grid of round values against the table, and shared by all six predictions);
- the baseline generates with an unoptimized engine (`baseline_decode_efficiency`, from our measured transformers
  vs ours ratio) at the job's batch setting where its memory allows;
- the trainer's TP, pipeline and DP communication is added to its single-GPU MFU at the calibrated link rates, as
  the job runs it (exposed: no transformer-engine overlap, no sequence parallelism, gradients reduced in fp32
  after the last micro-batch; `planning/steptime.py`).

The 405B asynchronous step is the one the planner misses (tests/test_plan.py keeps it as a strict expected
failure; the numbers and what was checked are in docs/benchmarks.md, "Against the paper's step-time table"). Our
recipe's step is bound by training, plus the sync, and is planned short of the paper's. That is the expected
direction: the planned trainer runs at about the per-GPU rate Meta reports for tuned Llama 3 405B pretraining (an
upper bound for an RL step; the calibration's MFU and decode efficiency are single-GPU measurements of a 1B
training step and an 8B decode), and the paper's trainer is FSDP-based (above). Checked and not the cause: the
pipeline bubble, TP/PP/DP communication, the DDMA sync against the paper's "about 2 s", KV-cache capacity and the
max-length straggler. `benchmarks/paper_405b_sensitivity.py` re-plans the case with one unstated choice changed at
a time (split, quantization format, batch, trainer MFU): single choices move the planned step over a range that
reaches the paper's, some without moving the synchronous prediction, so the miss is within the uncertainty of what
the paper does not state. It stays an expected failure, not tuned away: choosing those values to hit the table
would be a fit. What would make it a prediction is the paper's 405B trainer/generator split, quantization format,
batch size and generation length.
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

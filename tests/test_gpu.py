"""The `gpu` set: the real twins of the CUDA-rules tests, and a colocated job killed and resumed, on this machine's
GPU. Each runs in a process of its own that sees the GPU (the session hides it from every other test:
conftest.py); where no GPU is present each is skipped, saying why.

    python -m pytest -q -m gpu        # only this set
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.gpu


def _run(args, env, timeout=600, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, start_new_session=True,
                          cwd=HERE.parent, **kw)


@pytest.mark.parametrize("check", ["decode", "int8", "checkpoint"])
def test_the_cuda_path_on_the_gpu(check, gpu_env, tmp_path):
    """decode: the CUDA-graph decode step at TP1 against transformers' greedy tokens; int8: the int8 generator
    against transformers on int8-rounded weights; checkpoint: a background save with pinned staging copies resumes
    into the same next step (tests/gpu_checks.py)."""
    done = _run([sys.executable, str(HERE / "gpu_checks.py"), check, str(tmp_path)], gpu_env)
    assert done.returncode == 0, done.stderr[-4000:]
    print(done.stdout.strip().splitlines()[-1])


def test_a_colocated_job_on_the_gpu_is_killed_and_resumes(gpu_env, tmp_path):
    """The default job fitted to the machine's GPUs (colocated at TP1 on one), SIGKILLed inside a trainer step,
    resumes from its newest checkpoint with the same command and finishes: every step's row once."""
    args = [sys.executable, "-m", "megatron_rl.cli", "train", "run.steps=6", "trainer.sft_warmup_steps=10",
            "run.eval_interval=100", "rollout.prompts_per_step=4", "data.eval_size=4", "rollout.max_new_tokens=6",
            "checkpoint.save_interval=2", f"checkpoint.dir={tmp_path}", "run.name=gpu"]
    killed = _run(args, {**gpu_env, "MEGATRON_RL_FAILPOINT": "train_step:5"})
    assert killed.returncode == 1, killed.stderr[-4000:]
    assert re.search(r"died with signal 9 \(SIGKILL\)", killed.stderr), killed.stderr[-4000:]
    assert re.search(r"\((fitted to \d+ GPUs?|the configured layout uses \d+ of \d+ GPUs?)",
                     killed.stdout.splitlines()[0]), killed.stdout[-2000:]
    latest = (tmp_path / "gpu" / "latest").read_text().strip()
    resumed = _run(args, {k: v for k, v in gpu_env.items() if k != "MEGATRON_RL_FAILPOINT"})
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["resumed_from_step"] == int(latest.removeprefix("step_")) and summary["backend"] == "nccl"
    rows = [json.loads(x) for x in (tmp_path / "gpu" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))

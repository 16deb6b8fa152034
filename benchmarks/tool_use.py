"""Does a real model learn to use a tool? SmolLM2-135M-Instruct with a calculator, `configs/smollm2-calculator.yaml`.

    python benchmarks/tool_use.py                      # the recipe as it is
    python benchmarks/tool_use.py run.steps=60         # any override of the recipe
    python benchmarks/tool_use.py --config smollm2-calculator-agent.yaml   # the task as an agent with a function tool

Runs `megatron-rl train -c configs/smollm2-calculator.yaml` from scratch into a fresh run directory (under
checkpoints/, named tool_use-<time>), then reads its metrics: held-out accuracy (word problems never trained on, one
episode each) after the warm start and at the last step, with the standard error of the gain; and tool use, the
calculator calls per training episode (turns per episode - 1: an episode that answers at once has one turn, one
that calls the calculator first has two), at step 0 (after the warm start) and over the first and the last 10 steps. Ends with one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402
from learning import recipe_report  # noqa: E402


def main(argv: list[str]) -> int:
    recipe = "smollm2-calculator.yaml"
    if argv[:1] == ["--config"]:
        recipe, argv = argv[1], argv[2:]
    result, run_dir = recipe_report("tool_use", recipe, argv)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first, last = rows[:10], rows[-10:]

    def calls(part):
        return round(sum(r["episode/turns"] for r in part) / len(part) - 1, 3)

    result.update({"calls_per_episode_step0": calls(rows[:1]), "calls_per_episode_first10": calls(first), "calls_per_episode_last10": calls(last),
                   "train_reward_first10": round(sum(r["reward"] for r in first) / len(first), 3),
                   "train_reward_last10": round(sum(r["reward"] for r in last) / len(last), 3),
                   "env_failures": sum(r["env_failures"] for r in rows)})
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

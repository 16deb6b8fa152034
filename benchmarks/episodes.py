"""Does an agent learn from its environment? The tiny model plays the guessing game of `configs/guess-number.yaml`.

    python benchmarks/episodes.py                      # the recipe as it is
    python benchmarks/episodes.py env.max_turns=4      # any override of the recipe
    python benchmarks/episodes.py --seeds 0 1 2        # the recipe at run.seed 0, 1, 2: the mean and its standard error

Runs `megatron-rl train -c configs/guess-number.yaml` from scratch into a fresh run directory (under checkpoints/,
named episodes-<time>), then reads its metrics: the held-out success (episodes that find the hidden number, over
`data.eval_size` x `data.eval_samples` episodes of numbers never trained on) after the warm start and at the last
step, beside its reference: one turn, with no answer to learn from, finds a number in 1..16 at most 1 time in 16
whatever the policy (`one_turn_ceiling`). Also the turns per episode, the environment's share of the episode's
tokens and its time. The standard error of the gain treats episodes as independent. Ends with one JSON line. With
`--seeds`, one run per seed (each its own warm start, rollouts and held-out sampling) and a last line with the
held-out success of each, their mean and its standard error over seeds (sample standard deviation / sqrt(seeds)).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402
from learning import recipe_report  # noqa: E402

ONE_TURN_CEILING = 1 / 16  # one guess in 1..16, with no answer yet


def one_run(argv: list[str]) -> dict:
    result, run_dir = recipe_report("episodes", "guess-number.yaml", argv)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = rows[-20:]
    result.update({
        "one_turn_ceiling": ONE_TURN_CEILING,
        "heldout_after_over_one_turn": round(result["heldout_after"] / ONE_TURN_CEILING, 2),
        "turns_per_episode_first": round(rows[0]["episode/turns"], 2),
        "turns_per_episode_last": round(sum(r["episode/turns"] for r in last) / len(last), 2),
        "env_token_share_last": round(sum(r["episode/env_tokens"] for r in last)
                                      / sum(r["episode/env_tokens"] + r["episode/policy_tokens"] for r in last), 3),
        "env_s_per_step": round(sum(r["time/env_s"] for r in rows) / len(rows), 4),
        "env_failures": sum(r["env_failures"] for r in rows),
        "guarded_steps": int(sum(r.get("guarded", 0) for r in rows))})
    emit(result)
    return result


def main(argv: list[str]) -> int:
    if "--seeds" not in argv:
        one_run(argv)
        return 0
    at = argv.index("--seeds")
    seeds, rest = [], argv[at + 1:]
    while rest and rest[0].lstrip("-").isdigit():
        seeds.append(int(rest.pop(0)))
    overrides = argv[:at] + rest
    runs = [one_run([*overrides, f"run.seed={s}"]) for s in seeds]
    after = [r["heldout_after"] for r in runs]
    mean = sum(after) / len(after)
    se = math.sqrt(sum((a - mean) ** 2 for a in after) / (len(after) - 1) / len(after)) if len(after) > 1 else None
    emit({"benchmark": "episodes-seeds", "overrides": overrides, "seeds": seeds, "heldout_before":
          [r["heldout_before"] for r in runs], "heldout_after": after, "heldout_after_mean": round(mean, 4),
          "heldout_after_se": round(se, 4) if se is not None else None, "optimal_player": 1.0,
          "mean_over_optimal": round(mean, 4), "curves": [r["curve"] for r in runs],
          "wall_time_s": [r["wall_time_s"] for r in runs]})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Does an agent learn from its environment? The tiny model plays the guessing game of `configs/guess-number.yaml`.

    python benchmarks/episodes.py                      # the recipe as it is
    python benchmarks/episodes.py env.max_turns=4      # any override of the recipe

Runs `megatron-rl train -c configs/guess-number.yaml` from scratch into a fresh run directory (under checkpoints/,
named episodes-<time>), then reads its metrics: the held-out success (episodes that find the hidden number, over
`data.eval_size` x `data.eval_samples` episodes of numbers never trained on) after the warm start and at the last
step, beside its reference: one turn, with no answer to learn from, finds a number in 1..16 at most 1 time in 16
whatever the policy (`one_turn_ceiling`). Also the turns per episode, the environment's share of the episode's
tokens and its time. The standard error of the gain treats episodes as independent. Ends with one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402
from learning import recipe_report  # noqa: E402

ONE_TURN_CEILING = 1 / 16  # one guess in 1..16, with no answer yet


def main(argv: list[str]) -> int:
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
        "env_failures": sum(r["env_failures"] for r in rows)})
    emit(result)
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

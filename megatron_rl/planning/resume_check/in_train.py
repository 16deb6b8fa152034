"""Inside `train`, before a resume loads anything (`controller/job.py`): the checkpoint rehearsed for the trainer
the job will build, one line when a rank would not load it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional


from megatron_rl.checkpointing.layout import CheckpointError, first_line
from megatron_rl.planning.resume_check.stages import ResumeCheckError, TrainerSpec, build_stage
from megatron_rl.planning.resume_check.index import loading, read_index
from megatron_rl.planning.resume_check.rehearsal import _Rehearsal
from megatron_rl.planning.resume_check.index import check_files


def check_resume(path: Path, target: TrainerSpec, group=None) -> Optional[str]:
    """Collective over `group` (every rank of the job; None: the default group): checkpoint `path` rehearsed at the
    layout it was written with and at `target`'s, the stages shared out over the ranks; every rank raises the same
    ResumeCheckError (the first stage's, in order) when one fails. Reads META, and the index on the ranks with a
    share. A stage the rehearsal cannot build (a module the meta device does not take) fails no resume: the first
    such note is returned, on every rank, and the load's own checks still run."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    failures, notes = [], []
    try:
        index = read_index(path)
        if rank == 0:
            check_files(index, checksums=False)
        specs = [target] if index.layout in (None, target.layout) else \
            [dataclasses.replace(target, layout=index.layout), target]
        specs = [loading(s, index) for s in specs]
        units = [(i, tp, pp) for i, s in enumerate(specs) for pp in range(s.layout.pp) for tp in range(s.layout.tp)]
        checks = [_Rehearsal(index, s) for s in specs]
    except CheckpointError as e:
        failures.append((-1, str(e)))
        units = []
    for i in range(rank, len(units), world):
        which, tp, pp = units[i]
        try:
            checks[which].stage(build_stage(specs[which], tp, pp))
        except CheckpointError as e:
            failures.append((i, str(e)))
            break
        except Exception as e:  # noqa: BLE001 - every rank must reach the gather
            notes.append((i, f"resume-check could not rehearse the load at {specs[which].layout} "
                             f"({first_line(e)}); loading without it"))
    found: list = [None] * world
    dist.all_gather_object(found, (failures, notes), group=group)
    failures = sorted(f for part, _ in found for f in part)
    if failures:
        raise ResumeCheckError(failures[0][1])
    notes = sorted(n for _, part in found for n in part)
    return notes[0][1] if notes else None

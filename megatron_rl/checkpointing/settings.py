"""The `checkpoint` section: where a run's checkpoints go, how often, how many are kept, how a run resumes, and
whether saves complete in the background. `dir_problems` checks, creating nothing, that the run's directory can
be written before any process starts."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

from megatron_rl.settings import Section, ranged


@dataclass
class CheckpointSettings(Section):
    SECTION: ClassVar[str] = "checkpoint"
    dir: str = "checkpoints"
    # steps between checkpoints; always one after the last step (0: only that one)
    save_interval: int = ranged(50, ">= 0", "(0: only the final checkpoint)")
    # false: no checkpoint after the last step (a smoke run; with save_interval 0 none at all, so the run can be
    # neither resumed nor extended). A stop (SIGTERM, SIGINT, SIGHUP) still saves.
    save_final: bool = True
    keep_last: int = ranged(2, ">= 1")
    resume: bool = True
    fallback: bool = False  # resume from an older checkpoint when the latest is corrupt
    # Training waits only while each rank copies its state out; the files are written and the checkpoint completed
    # in the background (the next save, a stop and the end wait for it). false: every save completes before
    # training goes on.
    async_save: bool = True

    def dir_problems(self, run_name: str, path: str = "checkpoint") -> list[str]:
        """Why the run's directory (`dir`/`run_name`) cannot be written, as one line, or nothing."""
        for key, where in ((f"{path}.dir", Path(self.dir)), ("run.name", Path(self.dir) / run_name)):
            problem = _directory_problem(where)
            if problem:
                return [f"{key}: {where} {problem}"]
        return []


def _directory_problem(path: Path) -> Optional[str]:
    """Why files cannot be written in directory `path` (None when they can): it is not a directory, it cannot be
    written, or it does not exist and its nearest existing parent cannot be written. Creates nothing."""
    if path.exists():
        if not path.is_dir():
            return "is not a directory"
        return None if os.access(path, os.W_OK | os.X_OK) else "is not writable"
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                return f"cannot be created ({parent} is not a directory)"
            return None if os.access(parent, os.W_OK | os.X_OK) else f"cannot be created ({parent} is not writable)"
    return None

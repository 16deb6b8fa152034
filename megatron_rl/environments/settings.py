"""The `env` section: the environment class of multi-turn episodes, how long they may run, and its worker processes.
Imports nothing heavy (no torch); the user's class is imported (to check it) only by `problems_importing`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from megatron_rl.environments.pool import environment_problem, spec_problem
from megatron_rl.settings import Section, ranged


@dataclass
class EnvSettings(Section):
    """cls: the environment class (`module:Class` or `path/file.py:Class`), built per episode as `Class(record,
    seed)`; None: single-turn rollouts scored by the reward. An episode ends when the environment says so, after
    `max_turns` model turns, or when its tokens after the first prompt (the model's and the environment's together)
    reach `max_tokens`. `timeout_s` bounds one environment call; `num_workers` processes run the calls."""

    SECTION: ClassVar[str] = "env"
    cls: Optional[str] = None
    max_turns: int = ranged(4, ">= 1", "(the most model turns in an episode)")
    max_tokens: int = ranged(512, ">= 1", "(an episode's token budget after its first prompt)")
    timeout_s: float = ranged(10.0, "> 0")
    num_workers: int = ranged(2, ">= 1")

    def rules(self, path: str) -> list[str]:
        problem = spec_problem(self.cls) if self.cls is not None else None
        return [f"{path}.cls={self.cls!r} {problem}"] if problem else []

    def problems_importing(self, path: str = "env") -> list[str]:
        """The class imported here, as each environment worker will, so that a bad spec is one line now: a module or
        file that cannot be imported, an attribute that is missing, not a class, or without callable `reset` and
        `step`."""
        if self.cls is None or spec_problem(self.cls):
            return []  # `rules` reports a malformed spec
        problem = environment_problem(self.cls)
        return [f"{path}.cls={self.cls!r}: {problem}"] if problem else []

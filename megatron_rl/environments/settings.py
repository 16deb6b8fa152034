"""The `env` section: the environment class of multi-turn episodes, how long they may run, and its worker processes.
Imports nothing heavy (no torch); the user's class is imported (to check it) only by `problems_importing`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from megatron_rl.environments.pool import agent_problem, environment_problem, spec_problem
from megatron_rl.settings import Section, ranged


@dataclass
class EnvSettings(Section):
    """cls: the environment class (`module:Class` or `path/file.py:Class`), built per episode as `Class(record,
    seed)`; agent: instead, an agent function (`module:function`) called per episode as `function(record, seed,
    client)` with an OpenAI client bound to it, returning its reward (`agents/`); neither: single-turn rollouts
    scored by the reward. An episode ends when the environment (or agent) says so, after
    `max_turns` model turns, or when its tokens after the first prompt (the model's and the environment's together)
    reach `max_tokens`. `timeout_s` bounds one environment call; `num_workers` processes run the calls.

    answer_steps: the decode steps after a turn ends at which its observation enters (`inference/episodes.py`):
    1, the next step; an environment that answers later makes the generator wait for it. An environment slower than
    a decode step answers while the other sequences decode when this is that many steps (its answers to turns that
    end at nearby steps computed together); each episode's slot stands idle that many steps a turn. Fixed in
    steps, not seconds, so a batch of episodes stays a pure function of its requests, seeds and environments."""

    SECTION: ClassVar[str] = "env"
    cls: Optional[str] = None
    agent: Optional[str] = None
    max_turns: int = ranged(4, ">= 1", "(the most model turns in an episode)")
    max_tokens: int = ranged(512, ">= 1", "(an episode's token budget after its first prompt)")
    timeout_s: float = ranged(10.0, "> 0")
    num_workers: int = ranged(2, ">= 1")
    answer_steps: int = ranged(1, ">= 1", "(decode steps between a turn's end and its observation)")

    @property
    def episodic(self) -> bool:
        """Whether rollouts are episodes (an environment class or an agent)."""
        return self.cls is not None or self.agent is not None

    @property
    def field(self) -> str:
        """The field that makes rollouts episodes, for messages."""
        return "env.agent" if self.agent is not None else "env.cls"

    def rules(self, path: str) -> list[str]:
        if self.cls is not None and self.agent is not None:
            return [f"{path}.cls and {path}.agent are two ways to play an episode: set one"]
        if self.answer_steps != 1 and not self.episodic:
            return [f"{path}.answer_steps={self.answer_steps} times the answers of episodes: set {path}.cls too"]
        if self.agent is not None and self.answer_steps != 1:
            return [f"{path}.answer_steps={self.answer_steps}: an agent's next request enters at the next step "
                    f"(env.agent answers batch by batch); set it with env.cls"]
        if self.agent is not None:
            module, _, attr = self.agent.rpartition(":")
            return [] if module and attr else [f"{path}.agent={self.agent!r} must look like 'module:function' (or "
                                               f"'path/file.py:function')"]
        problem = spec_problem(self.cls) if self.cls is not None else None
        return [f"{path}.cls={self.cls!r} {problem}"] if problem else []

    def problems_importing(self, path: str = "env") -> list[str]:
        """The class imported here, as each environment worker will, so that a bad spec is one line now: a module or
        file that cannot be imported, an attribute that is missing, not a class, or without callable `reset` and
        `step`."""
        if self.agent is not None and self.cls is None and not self.rules(path):
            problem = agent_problem(self.agent)
            return [f"{path}.agent={self.agent!r}: {problem}"] if problem else []
        if self.cls is None or spec_problem(self.cls):
            return []  # `rules` reports a malformed spec
        problem = environment_problem(self.cls)
        return [f"{path}.cls={self.cls!r}: {problem}"] if problem else []

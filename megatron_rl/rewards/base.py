"""The interface every reward executor's scorer has: a batch of (prompt, response, reference) -> floats.

Scoring is batched because the expensive scorers (user functions in worker processes, sympy checks) gain from
running a batch across several workers; the cheap ones just loop.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Optional, Sequence, Tuple, Union

log = logging.getLogger(__name__)

# (prompt, response, reference), and optionally the prompt record's fields (`PromptRecord.as_dict`), which reward
# functions that ask for them get (`function.py`)
RewardItem = Union[Tuple[str, str, Optional[str]], Tuple[str, str, Optional[str], dict]]


class RewardFunction(ABC):
    """A scorer. `score` never raises for a bad response; it returns 0.0 for it (and logs when it is unusual)."""

    name: str = "reward"
    failures: int = 0  # responses of the last `score` call that could not be scored (scored 0.0); see FunctionReward

    @abstractmethod
    def score(self, items: Sequence[RewardItem]) -> list[float]:
        """One float per (prompt, response, reference), in order."""

    def __call__(self, prompt: str, response: str, reference: Optional[str] = None) -> float:
        return self.score([(prompt, response, reference)])[0]

    def close(self) -> None:
        """Release worker processes, if any."""

    def __enter__(self) -> "RewardFunction":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PerItemReward(RewardFunction):
    """A scorer that is plain, fast Python per item: subclasses implement `score_one`.

    An exception in `score_one` is a verifier bug on an odd input; it scores 0.0 and is logged rather than ending a
    long run.
    """

    @abstractmethod
    def score_one(self, prompt: str, response: str, reference: Optional[str]) -> float: ...

    def score(self, items: Sequence[RewardItem]) -> list[float]:
        out = []
        for prompt, response, reference, *_ in items:
            try:
                out.append(float(self.score_one(prompt, response, reference)))
            except Exception:
                log.exception("%s reward raised on response %.200r; scored 0.0", self.name, response)
                out.append(0.0)
        return out

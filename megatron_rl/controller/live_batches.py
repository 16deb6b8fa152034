"""A generator replica's training batches in its live engine (`rollout.in_flight`, `inference/live.py`).

`GeneratorExecutor.generate(batch)` asks `LiveBatches.generate`: batch `batch` is queued (unless it already was,
while the batch before it drained) with batch `batch + 1` behind it, whose sequences take the slots this one frees;
the engine runs until `batch`'s last sequence ends, and batch `batch + 1`'s go on in their slots and see the next
weight push land (`switch`). With episodes (`env.cls`) each batch keeps its own `Turns` (its episodes' returns and
the environments' failure rule are the batch's), joined into the engine's one.

A checkpoint holds `state()`: the engine's sequences (the queued batches, partly sampled, the environments' answers
that were outstanding) and each queued batch's episodes; `restore` goes on from it, the caches recomputed at the
resumed run's first push.
"""

from __future__ import annotations

from typing import Callable, Optional

from megatron_rl.inference import Generator
from megatron_rl.inference.live import LiveGeneration


class LiveBatches:
    """The batches queued in one replica's live engine (module docstring), opened at the first batch.

    `requests(batch)`: the replica's requests of a training batch and, with episodes, their `Turns` (else None);
    `restored(saved)`: a batch's `Turns` from its checkpointed state (`EpisodeTurns.state`)."""

    def __init__(self, generator: Generator, max_len: int, filtering: bool, steps: int,
                 requests: Callable[[int], tuple[list, Optional[object]]],
                 restored: Optional[Callable[[list], object]] = None):
        self.generator, self.max_len, self.filtering, self.steps = generator, max_len, filtering, steps
        self.requests, self.restored = requests, restored
        self.live: Optional[LiveGeneration] = None
        self.handles: dict[int, list] = {}  # batch -> its handles in the engine
        self.turns: dict[int, object] = {}  # batch -> its episodes' turns

    def _engine(self, version: int) -> LiveGeneration:
        if self.live is None:
            self.live = LiveGeneration(self.generator, self.max_len, filtering=self.filtering, noise=True,
                                       version=version)
        return self.live

    def generate(self, batch: int, version: int) -> tuple[list, Optional[object]]:
        """Batch `batch`'s outputs and its episodes' turns (None for single responses)."""
        live = self._engine(version)
        for b in (batch, batch + 1):
            if b < self.steps and b not in self.handles:
                reqs, turns = self.requests(b)
                if turns is not None:
                    self.turns[b] = turns
                self.handles[b] = live.add(reqs, turns)
        return live.run(self.handles.pop(batch)), self.turns.pop(batch, None)

    def run(self, requests: list, turns, version: int, ahead: bool = False) -> list:
        """Requests outside the training batches, run to their end: the held-out evaluation, queued behind them, or
        (`ahead`) a batch's refills (`algorithm.dynamic_sampling`), queued ahead of the next batch's sequences."""
        live = self._engine(version)
        return live.run(live.add(requests, turns, ahead=ahead))

    def switch(self, version: int, recompute: bool) -> None:
        """A push wrote weights `version`: the running sequences go on under them, their caches kept or recomputed."""
        if self.live is not None:
            self.live.switch(version, recompute)

    def state(self) -> Optional[dict]:
        """Plain containers for the checkpoint; None before the first batch."""
        if self.live is None:
            return None
        state = self.live.snapshot(self.handles)
        state["episodes"] = {b: t.state() for b, t in self.turns.items()}
        return state

    def restore(self, state: dict) -> None:
        """Go on from `state()` (its caches are recomputed at the first weight push)."""
        live = self._engine(state["engine"]["version"])
        self.handles = {int(b): hs for b, hs in live.restore(state).items()}
        for b, saved in state.get("episodes", {}).items():
            self.turns[int(b)] = self.restored(saved)
            live.rejoin(self.handles[int(b)], self.turns[int(b)])


def oldest_version(outs: list, version: int) -> int:
    """A live engine's batch's version: its oldest token's (`version` where no output records versions)."""
    return min((min(o.versions) for o in outs if o.versions), default=version)

"""What the generator asks between the turns of an episode: the environment side, as the decode loop sees it.

An episode is one sequence of the generator that alternates between the model and an environment: the model
samples a reply (a turn ends at a stop token or after `max_new_tokens` of the turn), the environment answers with
an observation, whose token ids are appended to the sequence, and the model continues from there, in the same KV
cache slot: only the observation's tokens are prefilled, never the history. The generator knows token ids only;
`Turns` turns replies into observations (decoding the reply, calling the environment, rendering its message into
the ids of one chat turn) and keeps the episode's rewards.

Timing is part of the contract, for exactness: the turns that end at decode iteration i are handed to `start` at
iteration i, on every rank of the replica, and their observations are taken with `finish` at iteration
i + `answer_steps` (1 by default: the next), after that iteration's decode step has been launched (so the
environment calls overlap the decode steps between), also on every rank, or earlier where nothing would decode
meanwhile (every sequence in a slot waiting for an answer); up to `answer_steps` starts are outstanding at once,
finished in the order they were started. A sequence that waits for its environment keeps its slot while the others
decode. Because the iteration at
which an observation enters is fixed, which sequences share a decode step never depends on how long an environment
took, and a batch of episodes is a pure function of its requests, seeds and environments: a resumed run draws the
same episodes. (An environment slower than `answer_steps` decode steps makes the generator wait for it.) A
pipelined generator keeps the same order of calls, with a lane's round for an iteration, and finishes a start as late
as the next start or the round its observations enter (`inference/pipeline.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class EndedTurn:
    """A turn of an episode that has just ended: the request and sample it belongs to, the reply's token ids (this
    turn's sampled tokens only) and their log-probs, and why it ended ("stop": a stop token; "length": the turn's or
    the episode's token limit)."""

    request: int
    sample: int
    reply: tuple[int, ...]
    reason: str
    logprobs: tuple[float, ...] = ()


class Turns(ABC):
    """The environments of one `Generator.generate` call (one batch of episodes), or of a live engine's batches
    joined together (`empty`, `join`), as every rank of a generator replica sees them. `max_turns`: the most model
    turns an episode has; `max_tokens`: its budget of tokens after the prompt (the model's and the environments'
    together); `answer_steps`: the steps from a turn's `start` to its `finish`."""

    max_turns: int
    max_tokens: int
    answer_steps: int = 1  # the iterations from a turn's `start` to its `finish` (module docstring)

    @abstractmethod
    def start(self, ended: list[EndedTurn]) -> None:
        """Begin answering `ended` (every rank calls it with the same list; the replica's leader starts the
        environment calls)."""

    @abstractmethod
    def finish(self) -> list[Optional[list[int]]]:
        """The observations of the turns of the last `start`, in its order: each one's token ids to append, or None
        when its episode is over (the environment said done, or failed). Every rank of the replica gets the same
        answer (a collective where the replica has several ranks)."""

    def closed(self, request: int, finish: str) -> None:
        """Episode `request` is over after the answer `finish` took (`Sequence.observe`: "done", or "turns" and
        "length" where the job ended it with an observation unused). Every rank calls it; nothing by default."""

    # ---- for a live engine (`inference/live.py`), which plays the episodes of several batches at once ----------
    # One `Turns` answers them all (`empty`, then `join` per batch), so that the turns of every batch that end at a
    # step are answered by one `start`: an environment's workers are driven by one thread at a time.
    def empty(self) -> "Turns":
        """A `Turns` of no episode yet, over the same environments, to `join` batches into."""
        raise NotImplementedError(f"{type(self).__name__} cannot be played by a live engine (no `empty`/`join`)")

    def join(self, batch: "Turns", requests: list[Optional[int]]) -> None:
        """Play `batch`'s episodes too: its request k is this one's `requests[k]` (None: not played, such as a request
        the generator refused, or an episode a checkpoint saved already over). Their answers are recorded where
        `batch` keeps them (its returns are its episodes')."""
        raise NotImplementedError(f"{type(self).__name__} cannot be played by a live engine (no `empty`/`join`)")

    def resume(self, ended: list[EndedTurn]) -> None:
        """`start` the answers to `ended` again, in a resumed run: a checkpoint was saved after their turns were
        handed to `start` and before `finish` took the answers (which it does not hold). By default, `start`."""
        self.start(ended)


class EpisodeLoop:
    """Episodes as a client of the one-stage engine (`inference/engine.py`), keeping `Turns`' timing contract: after
    each engine step, the observations of the turns handed to `start` `answer_steps` steps ago are taken (`finish`:
    this step's decode has been launched meanwhile) and applied, each episode resumed in its slot at the next step
    or released, and then the turns that ended at this step are started."""

    def __init__(self, turns: Turns, max_len: int):
        self.turns, self.max_len = turns, max_len
        # The outstanding starts, oldest first: [the iterations left until its `finish`, its sequences in order].
        self.answering: list[list] = []

    def after_step(self, engine, ended: list) -> None:
        """Between two engine steps: `ended` are the sequences whose turns ended at the step just run."""
        for round_ in self.answering:
            round_[0] -= 1
        if self.answering and (self.answering[0][0] <= 0
                               or not (engine.running or engine.resumed or engine.waiting)):
            # Due, or nothing decodes meanwhile (every sequence in a slot waits for an answer): waiting for it now
            # changes no step's batch.
            _, seqs = self.answering.pop(0)
            for seq, obs in zip(seqs, self.turns.finish(), strict=True):  # an answer for every turn
                if seq.observe(obs, self.turns.max_turns, self.max_len):
                    engine.resume(seq)
                else:
                    engine.release(seq)
                    self.turns.closed(seq.req, seq.finish)
        seqs = [s for s in ended if s.episode]
        if seqs:
            self.answering.append([self.turns.answer_steps, seqs])
            self.turns.start([s.ended_turn() for s in seqs])

"""The built-in multi-turn environment for the tiny default model: guess a hidden number from "higher" / "lower".

The tiny model is byte-level and reads and writes short plain text, so every message is a few bytes: the prompt
("guess 1-16:"), then "higher", "lower" or "a number" after each reply. An optimal player halves the range each turn
and needs at most ceil(log2(high - low + 2)) replies; `binary_search_transcript` writes such a game down, for a
supervised warm start.
"""

from __future__ import annotations

import random
import re
from typing import Optional

_INTEGER = re.compile(r"-?\d+")


def first_integer(text: str) -> Optional[int]:
    """The first integer anywhere in `text` ("8", " 8\\n9", "is it 8?" all give 8); None when there is none."""
    m = _INTEGER.search(text)
    return int(m.group()) if m else None


class GuessNumber:
    """Guess `record["reference"]` (an integer, as text) in as few turns as the episode allows; `record["prompt"]`
    is the first message. A reply's first integer is its guess: right ends the episode with reward 1; too small is
    answered "higher", too large "lower", and a reply without a number "a number", each with reward 0. The job
    ends an episode that runs out of turns (`env.max_turns`). Deterministic: `seed` is not used."""

    def __init__(self, record: dict, seed: int):
        self.prompt = record["prompt"]
        self.hidden = int(record["reference"])

    def reset(self) -> str:
        return self.prompt

    def step(self, response: str) -> tuple[Optional[str], float, bool]:
        guess = first_integer(response)
        if guess is None:
            return "a number", 0.0, False
        if guess == self.hidden:
            return None, 1.0, True
        return ("higher" if guess < self.hidden else "lower"), 0.0, False


def narrowed(low: int, high: int, guess: int, message: Optional[str]) -> tuple[int, int]:
    """The range [low, high] a player still has open after `guess` was answered `message` (GuessNumber's words:
    "higher", "lower"; any other message leaves it as it was)."""
    if message == "higher":
        return max(low, guess + 1), high
    if message == "lower":
        return low, min(high, guess - 1)
    return low, high


def guess_records(count: int, seed: int, low: int = 1, high: int = 16) -> list[dict]:
    """`count` prompt records of the game (id, prompt, reference), the hidden numbers drawn uniformly from
    [low, high] by `seed`: the same arguments give the same records."""
    if low > high:
        raise ValueError(f"low={low} must be <= high={high}")
    rng = random.Random(seed)
    return [{"id": f"guess-{seed}-{i}", "prompt": f"guess {low}-{high}:", "reference": str(rng.randint(low, high))}
            for i in range(count)]


def binary_search_transcript(hidden: int, low: int, high: int) -> list[tuple[str, Optional[str]]]:
    """The game an optimal player plays against `GuessNumber`: (reply, the environment's next message) per turn,
    each reply the middle of the range still open; the last message is None (guessed)."""
    if not low <= hidden <= high:
        raise ValueError(f"hidden={hidden} is not in [{low}, {high}]")
    env = GuessNumber({"prompt": f"guess {low}-{high}:", "reference": str(hidden)}, 0)
    turns: list[tuple[str, Optional[str]]] = []
    while True:
        reply = str((low + high) // 2)
        message, _, done = env.step(reply)
        turns.append((reply, message))
        if done:
            return turns
        low, high = narrowed(low, high, int(reply), message)

"""Environments for multi-turn rollouts: a user class (`env.cls=module:Class`) built per episode as
`Class(record, seed)`, answering the model's replies with messages and rewards.

- `settings.py`: the `env` section (`EnvSettings`): the class, the episode's turn and token budgets, its workers.
- `pool.py`: `EnvironmentPool`, the classes run in worker processes with the reward functions' guarantees, one
  `Turn` per episode and call; the contract an environment class keeps is in its docstring.
- `play.py`: episodes played on a generator replica (`Episodes`, `EpisodeTurns`, `TurnTemplate`): the job's
  generator executors and `megatron-rl eval` use it; it imports torch, so it is not imported here.
- `guess.py`: `GuessNumber`, the built-in game for the tiny default model, with its records and an optimal player.
- `calculator.py`: `Calculator`, the built-in tool-use task: word problems with a calculator the model calls.
"""

from megatron_rl.environments.guess import GuessNumber, binary_search_transcript, first_integer, guess_records
from megatron_rl.environments.pool import (MAX_FAILING_BATCHES, EnvironmentFailureError, EnvironmentPool,
                                           EnvironmentSpecError, Turn, as_message, environment_problem,
                                           resolve_environment)
from megatron_rl.environments.settings import EnvSettings

__all__ = [
    "MAX_FAILING_BATCHES", "EnvSettings", "EnvironmentFailureError", "EnvironmentPool", "EnvironmentSpecError",
    "GuessNumber", "Turn", "as_message", "binary_search_transcript", "environment_problem", "first_integer",
    "guess_records", "resolve_environment",
]

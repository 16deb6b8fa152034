"""Environments for multi-turn rollouts: a user class (`env.cls=module:Class`) built per episode as
`Class(record, seed)`, answering the model's replies with messages and rewards.

- `settings.py`: the `env` section (`EnvSettings`): the class, the episode's turn and token budgets, its workers.
- `pool.py`: `EnvironmentPool`, the classes run in the sandbox's worker processes (`sandbox.WorkerPool`, as reward
  functions are), one `Turn` per episode and call; the contract an environment class keeps is in its docstring
  (`Environment`, a typing Protocol).
- `play.py`: episodes played on a generator replica (`Episodes`, `EpisodeTurns`, `TurnTemplate`): the job's
  generator executors and `megatron-rl eval` use it; it imports torch, so it is not imported here.
- `guess.py`: `GuessNumber`, the built-in game for the tiny default model, with its records and an optimal player.
- `calculator.py`: `Calculator`, the built-in tool-use task: word problems with a calculator the model calls.

From `megatron-rl train env.cls=module:Class` to the class's `step`, by name:
1. `cli.cmd_train` -> `controller.train.train` -> each rank's `controller.rank.rank_main` builds the job
   (`controller.job.Job`), whose generator executor (`controller.executors.GeneratorExecutor`) makes its replica's
   `play.Episodes` when `env.episodic`; `controller/loop.py` runs the steps.
2. Each batch: `GeneratorExecutor._sample` -> `Episodes.requests` (the first messages, from `pool.EnvironmentPool
   .first`) -> `inference.generator.Generator.generate(requests, turns)`, whose engine hands the turns that end to
   `inference.episodes.EpisodeLoop`, which calls `play.EpisodeTurns.start` (the replies, decoded) and, before the
   next decode step that needs them, `EpisodeTurns.finish` (the observations, shared over the replica).
3. `EpisodeTurns.start` -> `EnvironmentPool.step` (a thread on the replica leader) -> `sandbox.WorkerPool.map` ->
   in a worker, `sandbox.pool._worker_main` calls the target `pool.runner(spec)` built at its start ->
   `pool.Runner.__call__` -> `Runner._step` -> the class's `step(reply)`, its answer checked there.
4. After the batch: `Episodes.end_batch` -> `EnvironmentPool.end_batch`, the failure rule (`pool
   .episode_failure_rule`).
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

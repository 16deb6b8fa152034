"""The process sandbox for user code: reward functions, environments and agents run here, never in the job's process.

- `imports.py`: `resolve`, which imports a `module:attr` spec, and `SpecError`, its one line when it cannot.
- `pool.py`: `WorkerPool`, worker processes with per-call and per-batch deadlines, hung or dead workers killed and
  replaced, one `Outcome` per call; `start_worker` and `messages`, a worker's first steps and its
  loop (also the agents' own workers').
- `log.py`: the run's `workers.log`, where the workers' output and tracebacks go, kept bounded.
- `failures.py`: the rule that stops a run on user code that fails batch after batch.

Its callers compose it: `rewards.function.FunctionReward` runs a user's function in a pool,
`environments.pool.EnvironmentPool` runs an environment class's `Runner` in one, `agents.workers.AgentWorkers` starts
its threaded workers the same way.
"""

from megatron_rl.sandbox.failures import MAX_FAILING_BATCHES, failing_batches
from megatron_rl.sandbox.imports import FORM, SpecError, resolve
from megatron_rl.sandbox.log import LOG_MAX_BYTES, bound_log, write_to_log
from megatron_rl.sandbox.pool import (Outcome, WorkerPool, default_batch_timeout, default_start_method, messages,
                                      start_worker)

__all__ = [
    "FORM", "LOG_MAX_BYTES", "MAX_FAILING_BATCHES", "Outcome", "SpecError", "WorkerPool", "bound_log", "default_batch_timeout",
    "default_start_method", "failing_batches", "messages", "resolve", "start_worker", "write_to_log",
]

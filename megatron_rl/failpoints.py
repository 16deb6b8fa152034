"""Fault injection for crash tests: kill the process group at a named point, as a node failure would.

`MEGATRON_RL_FAILPOINT=<name>` or `<name>:<tag>` (e.g. `train_step:3`, `checkpoint_before_rename:step_00000004`)
makes the process that reaches that point SIGKILL its whole process group: no cleanup, no exception handlers, no
flushed buffers. A rank of the local launcher leads a group of its own (`launch/spawn.py`): the rank dies with
all it started, and the launcher names it and ends the other ranks. Unset (always, outside tests), a failpoint is
one dictionary lookup.

`MEGATRON_RL_FAILPOINT_ACTION=stop` makes the process SIGSTOP itself there instead, every thread at once: a stand-in
for a rank stuck in a kernel, on a dead mount or on a frozen node (`parallel/liveness.py` must find it).
`MEGATRON_RL_FAILPOINT_ACTION=sleep:S` makes it sleep S seconds there and go on: a stand-in for slow work (a large
model's warm-start step) whose length does not depend on the test machine's speed.
"""

from __future__ import annotations

import os
import signal
import time


def failpoint(name: str, tag: str = "") -> None:
    if os.environ.get("MEGATRON_RL_FAILPOINT") in (name, f"{name}:{tag}"):
        action = os.environ.get("MEGATRON_RL_FAILPOINT_ACTION", "")
        if action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif action.startswith("sleep:"):
            time.sleep(float(action.removeprefix("sleep:")))
        else:
            os.killpg(os.getpgrp(), signal.SIGKILL)

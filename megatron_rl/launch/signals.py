"""Stopping a job on SIGTERM, SIGINT or SIGHUP at a point where every rank agrees, with a checkpoint.

A signal may reach any subset of the ranks at any moment (the local launcher forwards its own to every rank; under
torchrun or srun each rank gets it itself). A rank only notes it (`install`, `requested`); it never stops where it
is, because its peers would then wait for it in a collective. At the next `PushWeights` action of the plan, which
every rank takes part in in every layout, the loop asks `Job.stop_requested()`: an all-reduce (MAX) of the noted
signal over the world. If any rank was signalled, every rank saves the checkpoint of that point together and leaves
the loop; the run ends with exit code 128 + the signal's number (143 for SIGTERM, 130 for SIGINT, 129 for SIGHUP).

SIGHUP is what a closed terminal or a dropped ssh connection sends: a stop like the others (torchrun forwards it to
its ranks too). A signal the process was started ignoring stays ignored: under `nohup` a hang-up is no stop.
"""

from __future__ import annotations

import re
import signal
from multiprocessing import resource_tracker

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_noted = 0  # the last stop signal a thread of this process was handed, 0 for none


def _note(signum: int, frame) -> None:
    global _noted
    _noted = signum


def install() -> None:
    """Note SIGTERM, SIGINT and SIGHUP in this process (a rank's main thread, before it starts threads or
    processes) instead of dying of them; those it ignores (`nohup`) stay ignored.

    They are also blocked: they wait, pending, for `requested` to find them, and every process the rank starts
    from now on inherits the block (the mask survives fork and exec). So when a launcher or a terminal signals the
    rank's whole process group (torchrun and srun do), Megatron-Core's checkpoint writers, the manager process they
    report to and the reward workers keep running until the rank has saved its checkpoint; they end with the rank.
    A thread that does not block them (one started earlier) runs the handler, which notes them too."""
    # multiprocessing unblocks both signals after it starts its resource tracker (which it does before the first
    # process it spawns): start it now, so that this block stays.
    resource_tracker.ensure_running()
    noted = [sig for sig in STOP_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN]
    for sig in noted:
        signal.signal(sig, _note)
    signal.pthread_sigmask(signal.SIG_BLOCK, noted)


def requested() -> int:
    """The stop signal this process received (the highest-numbered: SIGTERM over SIGINT over SIGHUP), 0 for
    none."""
    received = {_noted} | (signal.sigpending() & set(STOP_SIGNALS))
    return max(int(sig) for sig in received)


def name(signum: int) -> str:
    return signal.Signals(signum).name


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number."""
    return 128 + signum


# The part of `stopped_line` that says the stop is complete: what a launch script looks for in the ranks' output.
STOPPED_WITH_CHECKPOINT = re.compile(r"megatron-rl: stopped by [A-Z]+ after step \d+; checkpoint \S+ saved")


def stopped_line(signum: int, step: int, checkpoint: str) -> str:
    """What the user reads when a stop completes."""
    return (f"megatron-rl: stopped by {name(signum)} after step {step}; checkpoint {checkpoint} saved; relaunch to "
            f"resume")

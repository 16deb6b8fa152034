"""What ends a job's processes when what started them is gone, and what keeps a job writing when its terminal is:
a rank of a torchrun/srun world ends with its agent, with everything it started (`launch/lifeline.py`); stdout
and stderr survive a hung-up terminal and a closed pipe (`launch/console.py`); `nohup` keeps SIGHUP ignored
(`launch/signals.py`); the run lock is not taken over while a process of the old job runs (`launch/runlock.py`)."""

import errno
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from megatron_rl.launch import console
from megatron_rl.launch.runlock import LOCK_FILE, RunDirLocked, RunLock


def _python(code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True, **kw)


def _gone_within(pids, seconds):
    deadline = time.monotonic() + seconds
    while True:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def test_a_launched_rank_and_what_it_started_end_when_its_agent_dies():
    """torchrun's agent (here: a parent process) is SIGKILLed: its rank (the child, as `_join_world` sets it up)
    and the process the rank started end within a second, though nothing signalled them."""
    agent = _python("""
        import subprocess, sys, time
        rank = subprocess.Popen([sys.executable, "-c", '''
        import functools, subprocess, sys, time
        from megatron_rl.launch import lifeline
        lifeline.watch_parent(functools.partial(lifeline.end_this_rank, "rank 0: its agent has ended"))
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(helper.pid, flush=True)
        time.sleep(60)
        '''], stdout=subprocess.PIPE, text=True)
        print(rank.pid, rank.stdout.readline().strip(), flush=True)
        time.sleep(60)
    """)
    try:
        rank, helper = map(int, agent.stdout.readline().split())
        assert _gone_within([rank, helper], 0.5) == [rank, helper]  # alive while the agent is
        agent.kill()
        agent.wait()
        assert _gone_within([rank, helper], 5.0) == []
    finally:
        agent.kill()
        agent.wait()
        agent.stdout.close()


def test_a_rank_whose_agent_is_already_gone_ends_at_once():
    code = """
        import os, time
        from megatron_rl.launch import lifeline
        lifeline.watch(lifeline.Owner(os.getppid(), -1.0), lifeline.end_this_rank)  # (-1: not the parent's start)
        time.sleep(30)
    """
    proc = _python(code)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    proc.stdout.close()


def _pty_stream():
    master, slave = os.openpty()
    return master, io.TextIOWrapper(io.FileIO(slave, "w"), write_through=False)


def test_output_survives_a_terminal_that_hung_up():
    master, stream = _pty_stream()
    out = console._Survivor(stream)
    out.write("before\n")
    out.flush()
    assert os.read(master, 100) == b"before\r\n"
    os.close(master)  # the terminal hangs up: writes to it now fail with EIO
    with pytest.raises(OSError) as e:
        os.write(stream.fileno(), b"x")
    assert e.value.errno == errno.EIO
    assert out.write("after the hang-up\n") == len("after the hang-up\n")
    out.flush()
    assert os.readlink(f"/proc/self/fd/{stream.fileno()}") == os.devnull  # later writes, C's too, are dropped
    out.write("more\n")
    out.flush()
    stream.close()


def test_output_survives_a_closed_pipe_and_other_write_errors_still_raise():
    r, w = os.pipe()
    os.close(r)
    out = console._Survivor(io.TextIOWrapper(io.FileIO(w, "w"), write_through=True))
    out.write("nobody reads this\n")  # EPIPE (`megatron-rl train | head -1`)
    out.flush()
    full = console._Survivor(io.TextIOWrapper(open("/dev/full", "wb", buffering=0), write_through=True))
    with pytest.raises(OSError) as e:  # a full disk is an error to report, not a reader that left
        full.write("x")
    assert e.value.errno == errno.ENOSPC
    out.close()
    full.close()


@pytest.mark.parametrize("ignored", [False, True], ids=["terminal", "nohup"])
def test_sighup_is_a_stop_signal_unless_the_process_ignores_it(ignored):
    code = f"""
        import os, signal, time
        # as nohup starts a command, or a terminal (whatever the tests' own disposition is)
        signal.signal(signal.SIGHUP, signal.SIG_IGN if {ignored} else signal.SIG_DFL)
        from megatron_rl.launch import signals
        signals.install()
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.1)
        print(signals.requested(), flush=True)
    """
    proc = _python(code)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and int(out) == (0 if ignored else signal.SIGHUP)


def test_run_lock_is_not_taken_over_while_a_process_of_the_old_job_runs(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        holder = {"host": os.uname().nodename, "pid": int(dead.stdout), "started": "2026-01-01T00:00:00+0000",
                  "processes": [{"pid": rank.pid, "started": psutil.Process(rank.pid).create_time()},
                                {"pid": int(dead.stdout), "started": 0.0}]}  # (a reused pid is not the old rank)
        (tmp_path / LOCK_FILE).write_text(json.dumps(holder))
        with pytest.raises(RunDirLocked) as e:
            RunLock(tmp_path).acquire()
        host = os.uname().nodename
        assert str(e.value) == (f"{tmp_path} is still written by a megatron-rl job whose launcher has ended: pid "
                                f"{dead.stdout.strip()} on host {host} (started 2026-01-01T00:00:00+0000) left "
                                f"processes {rank.pid} running; end them (kill -9 {rank.pid}) or wait for them, or use "
                                f"another run.name")
    finally:
        rank.kill()
        rank.wait()
    warnings = []
    with RunLock(tmp_path, warn=warnings.append) as lock:
        assert warnings == [f"taking over the stale lock of pid {dead.stdout.strip()} on host {os.uname().nodename} "
                            f"(started 2026-01-01T00:00:00+0000): that job is no longer running (its launcher and "
                            f"the 2 processes it started have ended)"]
        lock.record([os.getpid()])
        recorded = json.loads((tmp_path / LOCK_FILE).read_text())
        assert recorded["pid"] == os.getpid() and recorded["processes"] == [
            {"pid": os.getpid(), "started": psutil.Process().create_time()}]
    assert not (tmp_path / LOCK_FILE).exists()

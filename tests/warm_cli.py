"""`megatron-rl` commands for the tests, started warm: forked from the session's fork server, where torch,
Megatron-Core and the package are already imported, instead of from a fresh interpreter that imports them again.

A cold `python -m megatron_rl.cli train` pays the interpreter's start and its imports (2.5 s), and its fork server
then imports torch and Megatron-Core once more before the first rank starts (another 2.5-3 s): the tiny default
job took 10 s cold and takes 4-4.5 s warm on a 2-core machine, and the suite runs dozens of jobs. A warm command is
the same command in a process of its own: its own pid, session and process group, environment, working directory,
standard streams and exit status (a signal's is negative, as `subprocess` reports it), running `cli.run` as the
console script does. Its ranks come from a fork server of its own, as a cold command's do; that server is forked
from the command's process before the command starts, with everything already imported, and serves until the
command and its ranks are gone, as `multiprocessing`'s own does. A test's own entry (`main=`, "module:function")
runs the same way, for a command whose environment must reach the ranks it starts (a failpoint).

It relies on `multiprocessing.forkserver`'s internals as Python 3.10-3.13 have them (`forkserver.main`, and the
client's server address, "alive" fd and pid in `forkserver._forkserver`); Python 3.14's fork server also checks an
authentication key, which `_own_fork_server` would have to hand over too.

What a warm command cannot show is what happens before `cli.run`: the interpreter's start, the imports and their
warnings, the console script. The tests of those start cold commands (test_launch's quiet default job, test_config's
one-line errors, the launch scripts).
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from multiprocessing import forkserver
from multiprocessing.reduction import DupFd
from typing import Optional, Sequence

CLI = "megatron_rl.cli:run"  # the console script's entry


def _own_fork_server() -> None:
    """Fork this (single-threaded) process into a fork server and make it this process's own, as
    `multiprocessing.forkserver.ensure_running` starts one, but without a fresh interpreter: what the ranks import
    is imported here already. It serves until every holder of the "alive" pipe's write end (this process and the
    ranks it starts) is gone."""
    server = forkserver._forkserver
    address = multiprocessing.connection.arbitrary_address("AF_UNIX")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(alive_w)
            try:
                forkserver.main(listener.fileno(), alive_r, [])
            finally:
                os._exit(0)
        os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


def _call(spec: str):
    module, _, function = spec.partition(":")
    return getattr(importlib.import_module(module), function)()


def _command(argv: list[str], env: dict, cwd: str, new_session: bool, stdout: DupFd, stderr: DupFd,
             before: Optional[str], main: str, on_terminal: bool = False) -> None:
    """The command's process: a child of the session's fork server, made into what a cold start would be."""
    sys.stdout.flush(), sys.stderr.flush()
    for fd, dup in ((1, stdout), (2, stderr)):
        new = dup.detach()
        os.dup2(new, fd)
        os.close(new)
    if new_session:
        os.setsid()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if on_terminal:  # a command started from a terminal hangs up with it, whatever ignored SIGHUP above the tests
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    if before:
        _call(before)
    _own_fork_server()
    sys.argv = ["megatron-rl" if main == CLI else main.partition(":")[0], *argv]
    _call(main)


def python_c() -> None:
    """`python -W ignore -c CODE` as a `main=`: `sys.argv[1]` run as the main module, for code that changes its
    process for good (the CPU layer's patches of torch.cuda)."""
    import warnings

    warnings.simplefilter("ignore")
    exec(compile(sys.argv[1], "<string>", "exec"), {"__name__": "__main__"})


class WarmProcess:
    """What the tests use of `subprocess.Popen(..., stdout=PIPE, stderr=PIPE, text=True)`, for one warm
    `megatron-rl ARGS` command (or another `main`, "module:function", which reads `sys.argv`; its exit status is 1
    when it raises, as multiprocessing reports it)."""

    def __init__(self, args: Sequence[str], env: Optional[dict] = None, cwd=None, start_new_session: bool = False,
                 before: Optional[str] = None, main: str = CLI, terminal: Optional[int] = None):
        self.args = [str(a) for a in args]
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self._lock = threading.Lock()  # poll() reads the exit status from a pipe: once, by one thread
        out, err = (self._out.fileno(), self._err.fileno()) if terminal is None else (terminal, terminal)
        self._proc = multiprocessing.get_context("forkserver").Process(
            target=_command, args=(self.args, dict(os.environ if env is None else env), str(cwd or os.getcwd()),
                                   start_new_session, DupFd(out), DupFd(err), before, main, terminal is not None),
            name=f"megatron-rl {' '.join(self.args)[:60]}")
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        with self._lock:
            if self.returncode is None:
                self.returncode = self._proc.exitcode
            return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.poll() is None:
            multiprocessing.connection.wait([self._proc.sentinel], timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: Optional[float] = None) -> tuple[str, str]:
        """The command's output, once it has ended; its files are then closed."""
        self.wait(timeout)
        try:
            return self._text(self._out), self._text(self._err)
        finally:
            self._out.close()
            self._err.close()

    @staticmethod
    def _text(f) -> str:
        f.seek(0)
        return f.read().decode(errors="replace")


def start(args: Sequence[str], env: Optional[dict] = None, cwd=None, before: Optional[str] = None,
          main: str = CLI, terminal: Optional[int] = None) -> WarmProcess:
    """`subprocess.Popen(["megatron-rl", *args], stdout=PIPE, stderr=PIPE, text=True, start_new_session=True)`,
    warm. `before` ("module:function"): called in the command's process before its fork server is forked, so the
    ranks inherit what it changes (a test's fault). `terminal`: a file descriptor (a pty's) that the command writes
    its standard output and error to instead, as a command started from a terminal does; `communicate` then
    returns nothing for them."""
    return WarmProcess(args, env=env, cwd=cwd, start_new_session=True, before=before, main=main, terminal=terminal)


def run(args: Sequence[str], timeout: Optional[float] = 300, env: Optional[dict] = None, cwd=None,
        before: Optional[str] = None, main: str = CLI) -> subprocess.CompletedProcess:
    """`subprocess.run(["megatron-rl", *args], capture_output=True, text=True, ...)`, warm. Past `timeout` the
    command's process group is killed and TimeoutExpired raised, as `subprocess.run` does."""
    return finish(start(args, env=env, cwd=cwd, before=before, main=main), timeout)


def run_with_failpoint(args: Sequence[str], failpoint: Optional[str] = None,
                       timeout: Optional[float] = 300) -> subprocess.CompletedProcess:
    """`run(args)` with MEGATRON_RL_FAILPOINT set to `failpoint` for the command and its ranks (unset with None)."""
    env = dict(os.environ)
    env.pop("MEGATRON_RL_FAILPOINT", None)
    if failpoint:
        env["MEGATRON_RL_FAILPOINT"] = failpoint
    return run(args, timeout=timeout, env=env)


def finish(proc: WarmProcess, timeout: Optional[float] = 300) -> subprocess.CompletedProcess:
    """A started command's result, as `run` returns it: past `timeout` its process group is killed and
    TimeoutExpired raised."""
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

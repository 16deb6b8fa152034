"""How a run ends when it does not finish: a SIGTERM to `megatron-rl train` stops the job at a consistent point
with a checkpoint, ends every process of the run, and a relaunch resumes with every step's metrics exactly once;
so does a closed terminal (SIGHUP); a killed launcher leaves no process behind; one job per run directory (a second
launch exits 2 with one line, a stale lock is taken over); a failed or killed rank is named in one line."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from megatron_rl.launch.runlock import LOCK_FILE, RunDirLocked, RunLock
import warm_cli

REPO = Path(__file__).resolve().parents[1]
FAST = ["trainer.sft_warmup_steps=0", "checkpoint.save_interval=1000", "rollout.prompts_per_step=4",
        "data.eval_size=4", "run.eval_interval=1000", "rollout.max_new_tokens=6"]


def _train(tmp_path, *overrides, terminal=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    return warm_cli.start(["train", *FAST, f"checkpoint.dir={tmp_path}", *overrides], cwd=REPO, env=env,
                          terminal=terminal)


def _rows(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(condition, timeout, proc):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_sigterm_stops_at_a_checkpoint_ends_every_process_and_a_relaunch_resumes(tmp_path):
    run = tmp_path / "t"
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} + {i % 7} =", "answer": str(i + i % 7)}) + "\n"
                            for i in range(64)))
    # a user reward function: the run has reward worker processes too
    args = ["run.name=t", "data.dataset=jsonl", f"data.path={data}", "reward.kind=function",
            "reward.function=stop_workers:exact_answer"]
    proc = _train(tmp_path, *args, "run.steps=200")
    _wait_for(lambda: len(_rows(run)) >= 2, 120, proc)
    launcher = psutil.Process(proc.pid)
    family = launcher.children(recursive=True)  # fork server, ranks, their checkpoint writers and reward workers
    ranks = [p for p in family if p.pid == os.getpgid(p.pid)]
    started_by_ranks = [p for p in family if p not in ranks and os.getpgid(p.pid) in {r.pid for r in ranks}]
    assert len(ranks) == 3 and started_by_ranks
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)

    assert proc.returncode == 143, err[-3000:]
    assert "after finishing" not in err  # the leaders closed their reward workers: every rank exited at once
    line = err.strip().splitlines()[-1]
    step = int(line.split("after step ")[1].split(";")[0])
    assert line == f"megatron-rl: stopped by SIGTERM after step {step}; checkpoint step_{step:08d} saved; " \
                   f"relaunch to resume"
    assert (run / "latest").read_text().strip() == f"step_{step:08d}" and (run / f"step_{step:08d}").is_dir()
    assert [r["step"] for r in _rows(run)] == list(range(step))
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["stopped_by"] == "SIGTERM" and summary["stopped_after_step"] == step
    assert (run / "summary.json").exists() and not (run / LOCK_FILE).exists()
    time.sleep(0.5)
    assert [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    for r in ranks:  # nothing a rank started is left in its process group
        with pytest.raises(ProcessLookupError):
            os.killpg(r.pid, 0)

    again = _train(tmp_path, *args, f"run.steps={step + 2}")
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err[-3000:]
    assert "after finishing" not in err
    assert f"resumed from {run / f'step_{step:08d}'}" in err
    assert [r["step"] for r in _rows(run)] == list(range(step + 2))  # every step exactly once


def _family(proc):
    """The processes of a running job: its fork server, its ranks and what they started."""
    return psutil.Process(proc.pid).children(recursive=True)


def _running(processes):
    return [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _gone_within(processes, seconds):
    deadline = time.monotonic() + seconds
    while _running(processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _running(processes)


def test_a_killed_launcher_leaves_no_process_behind_and_a_relaunch_takes_over_and_resumes(tmp_path):
    run = tmp_path / "k"
    args = ["run.name=k", "checkpoint.save_interval=4"]
    proc = _train(tmp_path, *args, "run.steps=300")
    _wait_for(lambda: len(_rows(run)) >= 6 and (run / "latest").exists(), 120, proc)
    family = _family(proc)
    ranks = [p for p in family if p.pid == os.getpgid(p.pid)]
    assert len(ranks) == 3
    rows_at_kill = len(_rows(run))
    proc.kill()
    assert _gone_within(family, 5.0) == []  # the ranks ended with their launcher, and so did the fork server
    rows = len(_rows(run))
    assert rows <= rows_at_kill + 1  # at most the row being written as the launcher died
    latest = (run / "latest").read_text().strip()
    time.sleep(1.0)
    assert len(_rows(run)) == rows and (run / "latest").read_text().strip() == latest  # nothing written since
    step = int(latest.removeprefix("step_"))

    again = _train(tmp_path, *args, f"run.steps={step + 2}")
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err[-3000:]
    assert (f"taking over the stale lock of pid {proc.pid} on host {os.uname().nodename}" in err
            and "that job is no longer running (its launcher and the 3 processes it started have ended)" in err)
    assert f"resumed from {run / latest}" in err
    assert [r["step"] for r in _rows(run)] == list(range(step + 2))  # every step exactly once


def test_a_closed_terminal_stops_the_job_at_a_checkpoint(tmp_path):
    """The job writes to a terminal (a pty) that hangs up: its writes fail from then on (EIO), and the SIGHUP the
    terminal's session gets stops it like a SIGTERM: exit 129, a checkpoint, no process left (a relaunch resumes from
    it as from a SIGTERM's: `test_sigterm_stops_...`)."""
    run = tmp_path / "h"
    master, slave = os.openpty()
    proc = _train(tmp_path, "run.name=h", "run.steps=300", terminal=slave)
    os.close(slave)
    drain = threading.Thread(target=lambda: _read_until_hangup(master), daemon=True)
    drain.start()
    _wait_for(lambda: len(_rows(run)) >= 2, 120, proc)
    family = _family(proc)
    os.close(master)  # the terminal goes away: the rank's progress bar and the launcher's lines now fail to write
    proc.send_signal(signal.SIGHUP)  # what the kernel sends the session of a terminal that hung up
    proc.communicate(timeout=60)
    assert proc.returncode == 129
    summary = json.loads((run / "summary.json").read_text())
    step = summary["stopped_after_step"]
    assert summary["stopped_by"] == "SIGHUP" and (run / "latest").read_text().strip() == f"step_{step:08d}"
    assert [r["step"] for r in _rows(run)] == list(range(step))
    assert _gone_within(family, 2.0) == [] and not (run / LOCK_FILE).exists()


def _read_until_hangup(fd):
    try:
        while os.read(fd, 65536):
            pass
    except OSError:
        pass


def test_a_second_launch_on_a_running_run_dir_exits_2_and_the_first_finishes(tmp_path):
    run = tmp_path / "l"
    first = _train(tmp_path, "run.name=l", "run.steps=3", "trainer.sft_warmup_steps=20")  # still running below
    _wait_for(lambda: (run / "config.yaml").exists(), 60, first)
    started = json.loads((run / LOCK_FILE).read_text())["started"]  # the lock is taken before config.yaml is written
    second = _train(tmp_path, "run.name=l", "run.steps=3")
    out, err = second.communicate(timeout=60)
    assert second.returncode == 2 and out.splitlines()[1:] == []
    assert err.strip().splitlines() == [
        f"megatron-rl: {run} is in use by another megatron-rl job: pid {first.pid} on host {os.uname().nodename} "
        f"(started {started}); wait for it to end, or use another run.name"]
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 3
    assert [r["step"] for r in _rows(run)] == [0, 1, 2] and not (run / LOCK_FILE).exists()


def test_run_lock_takes_over_a_stale_lock_and_refuses_a_live_one(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    holder = {"host": os.uname().nodename, "pid": int(dead.stdout), "started": "2026-01-01T00:00:00+0000"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(holder))
    warnings = []
    with RunLock(tmp_path, warn=warnings.append):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
        assert warnings == [f"taking over the stale lock of pid {holder['pid']} on host {holder['host']} (started "
                            f"2026-01-01T00:00:00+0000): that job is no longer running"]
    assert not (tmp_path / LOCK_FILE).exists()

    # a live holder in another process
    code = (f"from megatron_rl.launch.runlock import RunLock; import sys, time; "
            f"l = RunLock({str(tmp_path)!r}); l.acquire(); print('held', flush=True); sys.stdin.read()")
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(RunDirLocked, match=f"in use by another megatron-rl job: pid {other.pid} on host"):
            RunLock(tmp_path).acquire()
    finally:
        other.stdin.close()
        other.wait(timeout=30)
        other.stdout.close()
    with RunLock(tmp_path):  # released when its holder ended
        pass


def test_a_failed_rank_is_named_with_its_cause_not_its_peers_errors():
    from megatron_rl.launch.failures import RanksFailed
    from megatron_rl.launch.spawn import run_local

    from stop_workers import rank_1_raises

    with pytest.raises(RanksFailed) as e:
        run_local(rank_1_raises, 3, timeout=120)
    assert (e.value.first.rank, e.value.first.cause) == (1, "FileNotFoundError: data/x.jsonl")
    assert "Traceback" in e.value.first.report


def test_a_killed_rank_is_named():
    from megatron_rl.launch.failures import RanksFailed
    from megatron_rl.launch.spawn import run_local

    from stop_workers import rank_1_is_killed

    with pytest.raises(RanksFailed) as e:
        run_local(rank_1_is_killed, 3, timeout=120)
    assert (e.value.first.rank, e.value.first.cause) == (1, "died with signal 9 (SIGKILL)")


def test_a_hung_rank_is_named_not_the_ranks_that_timed_out_waiting():
    from megatron_rl.launch.failures import RanksFailed
    from megatron_rl.launch.spawn import run_local

    from stop_workers import rank_1_hangs

    with pytest.raises(RanksFailed) as e:
        run_local(rank_1_hangs, 3, timeout=120, dist_timeout_s=3)
    assert (e.value.first.rank, e.value.first.cause) == (1, "hung: still running when the other ranks gave up "
                                                            "waiting for it")
    assert {f.rank for f in e.value.failures} == {0, 1, 2}


@pytest.mark.parametrize("close", [True, False], ids=["closed", "left_running"])
def test_a_rank_that_cannot_exit_after_finishing_is_named(close, monkeypatch, caplog):
    """A rank whose reward workers still run cannot exit: they block SIGTERM as the rank does, so the terminate
    its exit sends them is held. The launcher waits `EXIT_WAIT_S` for it, then kills it and says so; a rank that
    closed its pool exits at once, unnamed (a job's ranks close theirs: `Job.close`)."""
    from megatron_rl.launch import spawn

    from stop_workers import starts_reward_workers

    monkeypatch.setattr(spawn, "EXIT_WAIT_S", 1.0)
    with caplog.at_level("WARNING", logger=spawn.__name__):
        assert spawn.run_local(starts_reward_workers, 2, close, timeout=120, stop_grace_s=30) == [0, 1]
    named = [r.getMessage() for r in caplog.records if "after finishing" in r.getMessage()]
    if close:
        assert named == []  # both exited within EXIT_WAIT_S
    else:
        assert named == ["megatron-rl: ranks 0, 1 had not exited 1 s after finishing (a process or thread it "
                         "started still ran); killed"]


def test_the_failure_line_and_log(tmp_path):
    from megatron_rl.config import load_config
    from megatron_rl.controller.train import failure_report
    from megatron_rl.launch.failures import FAILURE_LOG, RankFailure, RanksFailed

    cfg = load_config(None, [])
    failures = [RankFailure(2, "FileNotFoundError: data/x.jsonl", "Traceback ...\nFileNotFoundError: data/x.jsonl"),
                RankFailure(0, "DistBackendError: Connection closed by peer", "Traceback ...")]
    e = failure_report(cfg, tmp_path, RanksFailed(failures, 3))
    assert e.exit_code == 1 and str(e) == (f"megatron-rl: rank 2 (generator) failed: FileNotFoundError: data/x.jsonl;"
                                           f" every rank's traceback: {tmp_path / FAILURE_LOG}")
    log = (tmp_path / FAILURE_LOG).read_text()
    assert "--- rank 2 (generator): FileNotFoundError" in log and "--- rank 0 (trainer): DistBackendError" in log
    e = failure_report(cfg, tmp_path, RanksFailed([RankFailure(1, "died with signal 9 (SIGKILL)", "died with signal 9 "
                                                                                             "(SIGKILL)")], 3))
    assert str(e).startswith("megatron-rl: rank 1 (trainer) died with signal 9 (SIGKILL); every rank's traceback")
    e = failure_report(cfg, tmp_path, RanksFailed([], 3, signal=signal.SIGINT, killed="twice"))
    assert e.exit_code == 130 and str(e) == ("megatron-rl: stopped by SIGINT: ranks killed at a second SIGINT; no "
                                             "checkpoint saved; relaunch to resume")


def test_ranks_of_a_launched_world_stop_together_when_each_gets_sigterm(tmp_path):
    """torchrun starts the ranks; every rank gets SIGTERM, as under srun or scancel: the same consistent stop."""
    run = tmp_path / "e"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "megatron_rl.cli", "train", "--launcher", "env", *FAST, "trainer.tp=1",
                             "run.steps=200", f"checkpoint.dir={tmp_path}", "run.name=e"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    _wait_for(lambda: len(_rows(run)) >= 2, 120, proc)
    for rank in psutil.Process(proc.pid).children():
        rank.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    summary = json.loads(out.strip().splitlines()[-1])
    step = summary["stopped_after_step"]
    assert summary["stopped_by"] == "SIGTERM" and (run / "latest").read_text().strip() == f"step_{step:08d}"
    assert f"megatron-rl: stopped by SIGTERM after step {step}; checkpoint step_{step:08d} saved" in err
    assert [r["step"] for r in _rows(run)] == list(range(step)) and not (run / LOCK_FILE).exists()

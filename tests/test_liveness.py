"""A hung rank is found by its silent heartbeat, not by how long its peers wait (issue 27): a SIGSTOPped trainer,
generator or reward-model rank ends the job in one line naming it and its action, within the timeout plus a few
beats, under the local launcher and under torchrun; a healthy job whose warm start outlasts the same short timeout
runs to the end."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from megatron_rl.parallel import liveness
import warm_cli

REPO = Path(__file__).resolve().parents[1]
FAST = ["trainer.sft_warmup_steps=0", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=4", "run.steps=200"]
TIMEOUT_S = 2  # seconds of silence before a rank is called hung (1 s once caught a healthy rank under load)


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_FAILPOINT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(Path(__file__).parent),
                                                                env.get("PYTHONPATH", "")]), **extra)
    return env


def _stopped_at(point):
    return _env(MEGATRON_RL_DIST_TIMEOUT_S=str(TIMEOUT_S), MEGATRON_RL_FAILPOINT=point,
                MEGATRON_RL_FAILPOINT_ACTION="stop")


def _run(cmd, env, tmp_path):
    """Run a job to its end: `megatron-rl CMD...` (warm_cli), or a command line starting with the interpreter;
    (result, seconds, the stopped process's pid seen while it ran or None)."""
    t0 = time.monotonic()
    if cmd[0] == sys.executable:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    else:
        proc = warm_cli.start(cmd, env=env, cwd=REPO)
    stopped: list[int] = []

    def watch():  # note the rank that stopped itself, to check that nothing is left of it afterwards
        while proc.poll() is None:
            try:
                for p in psutil.Process(proc.pid).children(recursive=True):
                    if p.status() == psutil.STATUS_STOPPED and p.pid not in stopped:
                        stopped.append(p.pid)
            except psutil.Error:
                pass
            time.sleep(0.2)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    t.join()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.monotonic() - t0, stopped


def _hang_line(err):
    lines = [line for line in re.split(r"[\r\n]", err) if "hung: no heartbeat" in line]
    assert len(lines) == 1, err[-3000:]
    return lines[0][lines[0].index("megatron-rl: rank"):]


def _assert_gone(pids):
    assert pids, "the failpoint never stopped a rank"
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_stopped_trainer_rank_ends_the_local_job_in_one_line(tmp_path):
    cmd = ["train", *FAST, f"checkpoint.dir={tmp_path}"]
    out, seconds, stopped = _run(cmd, _stopped_at("train_step:1"), tmp_path)
    assert out.returncode == 1
    line = _hang_line(out.stderr)
    silent = re.match(r"megatron-rl: rank [01] \(trainer\) hung: no heartbeat for (\d+) s", line)
    assert silent and TIMEOUT_S <= int(silent.group(1)) <= TIMEOUT_S + 2, line
    assert "last in Train(step=1)" in line and line.endswith(str(tmp_path / "default" / "failure.log"))
    _assert_gone(stopped)
    assert seconds < 90, seconds


def test_a_stopped_generator_rank_under_torchrun_is_named_by_its_watcher(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "megatron_rl.cli", "train", "--launcher", "env", *FAST, "trainer.tp=1", f"checkpoint.dir={tmp_path}"]
    out, seconds, stopped = _run(cmd, _stopped_at("generate:1"), tmp_path)
    assert out.returncode != 0
    line = _hang_line(out.stderr)
    assert line.startswith("megatron-rl: rank 1 (generator) hung: no heartbeat for "), line
    log = (tmp_path / "default" / "failure.log").read_text()
    assert log.startswith("megatron-rl: rank 1 (generator) hung") and "found by rank 0" in log
    _assert_gone(stopped)
    assert seconds < 60, seconds  # a rank on its host SIGKILLs it; torchrun alone would wait 30 s more


def test_a_stopped_reward_model_rank_ends_the_job(reward_model_job, tmp_path):
    d = reward_model_job
    args = [f"model.checkpoint={d / 'hf'}", "data.dataset=jsonl", f"data.path={d / 'words.jsonl'}",
            "data.answer_field=null", "data.eval_size=4", "data.eval_samples=2", "reward.kind=reward-model",
            f"reward.model={d / 'rm'}", "reward.executor.tp=1", "reward.executor.dp=1", "trainer.tp=1",
            "generator.colocated=true", "generator.dtype=fp32", "trainer.dtype=fp32", *FAST,
            f"checkpoint.dir={tmp_path}"]
    out, seconds, stopped = _run(["train", *args],
                                 _stopped_at("reward_model_batch:2"), tmp_path)
    assert out.returncode == 1
    assert _hang_line(out.stderr).startswith("megatron-rl: rank 1 (reward model) hung: no heartbeat for ")
    _assert_gone(stopped)


def test_a_warm_start_longer_than_the_timeout_is_not_a_hang(tmp_path):
    """The trainer's warm start takes several timeouts; the generator waits for it in a collective all along. The
    timeout is TIMEOUT_S: with 1 s, a healthy rank of this job on the loaded 2-core machine once went 1 s without a
    beat (a clean-clone CI run, stop 51). Each of the 6 steps sleeps three quarters of a second (a failpoint), so
    the warm start outlasts two timeouts on any machine (a generator whose beat stopped while it waited would be
    called hung after one); the beat is a thread of its own, which a step's sleep does not silence."""
    cmd = ["train", "trainer.sft_warmup_steps=6", "run.steps=1", f"checkpoint.dir={tmp_path}"]
    env = _env(MEGATRON_RL_DIST_TIMEOUT_S=str(TIMEOUT_S), MEGATRON_RL_FAILPOINT="warm_start_step",
               MEGATRON_RL_FAILPOINT_ACTION="sleep:0.75")
    out, _, _ = _run(cmd, env, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["warm_start_s"] >= 6 * 0.75 > 2 * TIMEOUT_S and summary["steps"] == 1


def test_store_watchers_report_a_silent_rank_once_and_every_rank_ends():
    """Three ranks' beats in one store; rank 2 stops beating. Its watchers (ranks 0 and 1) both find it, one reports,
    and every rank's `end` runs."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)  # port 0: the system picks one
    reports, ended = [], set()
    beats = [liveness.StoreBeats(store, r, 3, 0.3, lambda r, s, label: f"rank {r} hung in {label}", reports.append,
                                 lambda r=r: ended.add(r)) for r in range(3)]
    assert beats[0].watched == [1, 2] and beats[2].watched == [0, 1]
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # stands in for rank 2's process
    os.kill(stopped.pid, signal.SIGSTOP)
    beats[2].store.set("where/2", f"{socket.gethostname()}|{stopped.pid}")
    beats[2].publish(1, "Train(step=5)")
    for i in range(10):
        for b in beats[:2]:
            b.publish(i + 1, "waiting")
        time.sleep(0.1)
    assert reports == ["rank 2 hung in Train(step=5)"] and ended == {0, 1}
    assert stopped.wait(timeout=5) == -signal.SIGKILL  # a rank on its host ended it: a stopped process ignores TERM
    beats[2].publish(2, "Train(step=5)")  # resumed after the verdict: it ends too
    assert ended == {0, 1, 2}


def test_local_beats_count_silence_from_the_last_beat_or_the_start():
    import multiprocessing as mp

    beats = liveness.LocalBeats(mp.get_context("fork"), 2)
    hb = beats.heartbeat(0, 0.05)
    hb.publish(1, "x")
    hb.show_label("Generate(batch=1, version=0, evaluate=False)")
    started = time.monotonic() - 10
    assert beats.silent([0, 1], started, 5) == [(1, pytest.approx(10, abs=0.5))]
    assert beats.label(0) == "Generate(batch=1, version=0, evaluate=False)"


def test_bad_timeouts_are_one_line(monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_DIST_TIMEOUT_S", "ten")
    with pytest.raises(ValueError, match=r"MEGATRON_RL_DIST_TIMEOUT_S='ten' is not a number of seconds"):
        liveness.hang_timeout_s()
    monkeypatch.setenv("MEGATRON_RL_DIST_TIMEOUT_S", "30")
    monkeypatch.setenv("MEGATRON_RL_COLLECTIVE_TIMEOUT_S", "5")
    assert liveness.collective_timeout_s() == 30  # never below the hang timeout

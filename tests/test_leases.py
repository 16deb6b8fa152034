"""Readers of a run's checkpoints and its retention (`checkpointing/leases.py`): a step read by another process is
kept until its lease is gone, a dead reader's lease does not keep it, a removed step is named as removed; and
`megatron-rl eval` beside a job that saves every step succeeds every time."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.checkpointing.inspect import InspectError, reading
from megatron_rl.checkpointing.layout import META, TRAIN_FORMAT, list_checkpoints
from megatron_rl.checkpointing.leases import READERS_DIR
from megatron_rl.checkpointing.training import TrainCheckpointer
import warm_cli

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path, steps=(1, 2, 3, 4)):
    """A run directory holding `steps` (metadata only) with `latest` naming the newest."""
    root = tmp_path / "run"
    for step in steps:
        d = root / f"step_{step:08d}"
        (d / "model").mkdir(parents=True, exist_ok=True)
        (d / META).write_text(json.dumps({"format": TRAIN_FORMAT, "step": step}))
    (root / "latest").write_text(f"step_{steps[-1]:08d}\n")
    return root


def _prune(root):
    newest = list_checkpoints(root)[-1][1]
    TrainCheckpointer(root, keep_last=2)._prune(keep=newest)
    return [p.name for _, p in list_checkpoints(root)]


def test_a_live_lease_keeps_its_step_until_it_is_released(tmp_path):
    root = _run(tmp_path)
    with reading(root / "step_00000001") as ckpt:
        assert ckpt == root / "step_00000001"
        assert _prune(root) == ["step_00000001", "step_00000003", "step_00000004"]
        assert ckpt.is_dir()
    assert not list((root / READERS_DIR).iterdir())  # released
    assert _prune(root) == ["step_00000003", "step_00000004"]
    with reading(root) as ckpt:  # a run root: its latest, held the same way
        assert ckpt == root / "step_00000004"


def test_a_save_repeating_a_read_step_replaces_it_only_once_its_reader_is_done(tmp_path):
    """A resume from an older checkpoint saves a step again: while another process reads the earlier directory of
    that step (its lease), the save waits, saying so once, and the reader's files stay as they were; once the
    reader is done, the new directory replaces it and `latest` names it. Without a reader, no wait."""
    import threading

    root = _run(tmp_path, steps=(2, 4))
    final = root / "step_00000004"
    (final / "model" / "shard").write_text("old")
    said = []
    ck = TrainCheckpointer(root, log=said.append)

    def write(content):
        tmp = root / "step_00000004.tmp"
        (tmp / "model").mkdir(parents=True)
        (tmp / "model" / "shard").write_text(content)
        return tmp

    with reading(final) as ckpt:
        saving = threading.Thread(target=ck._publish, args=(write("new"), final))
        saving.start()
        saving.join(1.0)
        assert saving.is_alive() and (ckpt / "model" / "shard").read_text() == "old"
        assert said == [f"checkpoint step_00000004: an earlier step_00000004 is being read (a lease in "
                        f"{root / READERS_DIR}); it is replaced once its reader is done"]
    saving.join(10)
    assert not saving.is_alive() and (final / "model" / "shard").read_text() == "new"
    assert (root / "latest").read_text().strip() == "step_00000004" and not list(root.glob(".step_*"))
    t0 = time.monotonic()
    ck._publish(write("newer"), final)
    assert (final / "model" / "shard").read_text() == "newer" and len(said) == 1 and time.monotonic() - t0 < 1


def test_a_dead_readers_lease_does_not_keep_its_step(tmp_path):
    root = _run(tmp_path)
    code = ("import sys, time\nfrom megatron_rl.checkpointing.inspect import reading\n"
            "with reading(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(600)\n")
    reader = subprocess.Popen([sys.executable, "-c", code, str(root / "step_00000002")], stdout=subprocess.PIPE,
                              text=True, cwd=REPO)
    try:
        assert reader.stdout.readline().strip() == "held"
        assert _prune(root) == ["step_00000002", "step_00000003", "step_00000004"]  # alive: kept
        reader.send_signal(signal.SIGKILL)
        reader.wait(timeout=30)
    finally:
        reader.kill()
        reader.stdout.close()
    assert len(list((root / READERS_DIR).iterdir())) == 1  # left behind by the killed reader
    assert _prune(root) == ["step_00000003", "step_00000004"]
    assert not list((root / READERS_DIR).iterdir())  # the stale lease is removed with its step


def test_a_job_starting_from_another_runs_checkpoint_holds_its_step_while_it_runs(tmp_path):
    """`initial.prepared`, around a job in its launcher: `model.checkpoint=RUN` becomes RUN's latest step, held."""
    import dataclasses

    from megatron_rl.checkpointing.initial import prepared
    from megatron_rl.config import load_config

    root = _run(tmp_path, steps=(1, 2))
    cfg = load_config(None, [])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, checkpoint=str(root)))
    with prepared(cfg, tmp_path / "job", log=print) as started:
        assert started.model.checkpoint == str(root / "step_00000002")
        _run(tmp_path, steps=(3, 4))  # the other run goes on saving
        assert _prune(root) == ["step_00000002", "step_00000003", "step_00000004"]
    assert _prune(root) == ["step_00000003", "step_00000004"]


def test_a_step_removed_by_retention_is_named_as_removed_with_the_newest(tmp_path):
    from megatron_rl.evaluation import EvalError, evaluate

    root = _run(tmp_path)
    _prune(root)
    line = (f"{root / 'step_00000001'}: removed by the run's checkpoint retention (checkpoint.keep_last); the "
            f"newest is {root / 'step_00000004'}")
    with pytest.raises(InspectError) as e:
        reading(root / "step_00000001")
    assert str(e.value) == line
    with pytest.raises(EvalError) as e:
        evaluate(root / "step_00000001")
    assert str(e.value) == line
    with pytest.raises(InspectError, match="step_00000009: does not exist$"):  # not older than the newest
        reading(root / "step_00000009")


def test_a_reader_without_a_lease_names_the_step_removed_under_it(tmp_path, monkeypatch):
    """A run directory where no lease can be written (here `.readers` is a file): the reader goes on without one,
    and a step that retention removes while it reads is named as removed, not as a missing file."""
    from megatron_rl.evaluation import EvalError, evaluate
    from megatron_rl.evaluation import eval as evaluation

    root = _run(tmp_path, steps=(1, 2))
    (root / READERS_DIR).write_text("")
    read_meta = evaluation.read_checkpoint_meta

    def saved_and_pruned_meanwhile(ckpt):
        _run(tmp_path, steps=(3, 4))
        assert _prune(root) == ["step_00000003", "step_00000004"]
        return read_meta(ckpt)

    monkeypatch.setattr(evaluation, "read_checkpoint_meta", saved_and_pruned_meanwhile)
    with pytest.raises(EvalError) as e:
        evaluate(root)
    assert str(e.value) == (f"{root / 'step_00000002'}: removed by the run's checkpoint retention "
                            f"(checkpoint.keep_last); the newest is {root / 'step_00000004'}")


def test_eval_beside_a_job_saving_every_step_always_succeeds(shared_data, tmp_path):
    """The issue's case: `eval RUN_DIR` while the job saves every step, here keeping only the newest
    (`checkpoint.keep_last=1`, the tightest retention): without the leases, retention removed the step under the
    first evaluations."""
    from megatron_rl.evaluation import EvalSettings, evaluate

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    job = warm_cli.start(["train", "trainer.sft_warmup_steps=0", "rollout.prompts_per_step=4", "data.eval_size=4",
                          "run.eval_interval=1000", "rollout.max_new_tokens=6", "checkpoint.save_interval=1",
                          "checkpoint.keep_last=1", "run.steps=16", f"checkpoint.dir={tmp_path}", "run.name=r"],
                         cwd=REPO, env=env)
    run = tmp_path / "r"
    results = []
    try:
        while job.poll() is None:
            if not (run / "latest").is_file():
                time.sleep(0.2)
                continue
            results.append(evaluate(run, EvalSettings(limit=1, max_new_tokens=2, batch_size=1)))
    except BaseException:
        job.kill()
        raise
    done = warm_cli.finish(job, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len({r["checkpoint"] for r in results}) >= 3, results  # several steps read, each while newer ones saved
    assert all(r["n"] == 1 for r in results)
    assert not list((run / READERS_DIR).iterdir())  # every lease released


def test_without_flock_a_lease_is_its_readers_by_pid_and_start_time(tmp_path, monkeypatch):
    """Where the file system has no flock, a lease is live while its reader runs; a lease naming a live pid with
    another start time is a dead reader's whose pid was reused (issue 65): its step goes at the next prune."""
    import psutil

    from megatron_rl.checkpointing import leases
    from megatron_rl.launch.runlock import RunLock

    root = _run(tmp_path)
    monkeypatch.setattr(leases, "try_flock", lambda fd, blocking=False: None)  # no flock on this file system
    me = psutil.Process()
    readers = root / READERS_DIR
    readers.mkdir()
    for step, started in ((2, me.create_time()), (3, me.create_time() - 100.0)):  # live; a reused pid
        (readers / f"step_{step:08d}.x.{me.pid}.0").write_text(json.dumps(
            {"step": f"step_{step:08d}", "host": os.uname().nodename, "pid": me.pid, "started": started}))
    assert leases.leased_steps(root) == {"step_00000002"}
    assert [p.name for p in readers.iterdir()] == [f"step_00000002.x.{me.pid}.0"]  # the stale one is removed
    # The run lock names its holder the same way: a lock file whose pid runs under another start time is stale.
    dead_holder = {"host": os.uname().nodename, "pid": me.pid, "started": "then",
                   "process_started": me.create_time() - 100.0}
    assert not RunLock._held_elsewhere({**dead_holder, "pid": os.getppid(),
                                        "process_started": psutil.Process(os.getppid()).create_time() - 1})
    assert RunLock._held_elsewhere({**dead_holder, "pid": os.getppid(),
                                    "process_started": psutil.Process(os.getppid()).create_time()})

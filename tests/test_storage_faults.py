"""When the checkpoint directory's filesystem refuses a save (issue 27): one line naming the directory, the cause, what
to do and the checkpoint kept; nothing left behind that blocks the next save; failure.log written where it can be;
a warning before the first save when the space cannot hold the checkpoints the run keeps."""

import errno
import os
import re
import subprocess
import uuid
from pathlib import Path

import pytest

from megatron_rl.checkpointing import storage
from megatron_rl.checkpointing.layout import dir_bytes
import warm_cli

REPO = Path(__file__).resolve().parents[1]
FAST = ["trainer.sft_warmup_steps=0", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=4", "checkpoint.save_interval=2"]


@pytest.fixture
def small_fs(tmp_path):
    """A real 8 MiB filesystem (tmpfs), grown by `grow(mib)`; skipped where this process may not mount."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")

    def grow(mib):
        subprocess.run(["mount", "-o", f"remount,size={mib}m", str(mnt)], check=True)

    yield mnt, grow
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _train(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_FAILPOINT")}
    return warm_cli.run(["train", *FAST, *args], cwd=REPO, env=dict(env, OMP_NUM_THREADS="1"))


def _lines(err):
    return [line for line in re.split(r"[\r\n]", err) if line.startswith("megatron-rl: ") and "%|" not in line]


def test_a_full_disk_is_one_line_and_the_run_resumes_when_it_grows(small_fs):
    mnt, grow = small_fs
    out = _train("run.steps=12", f"checkpoint.dir={mnt}")
    assert out.returncode == 1
    run = mnt / "default"
    lines = _lines(out.stderr)
    assert lines[0].startswith(f"megatron-rl: warning: {run} has ") and "a save will fail" in lines[0], lines
    failed = [line for line in lines if "failed" in line]
    assert len(failed) == 1, out.stderr[-3000:]
    # whichever rank's write met the full disk first names it (every rank writes its part: generators their RNG;
    # rank 0 its metrics row, which the save's write in the background may beat)
    assert re.search(rf"\((trainer|generator)\) failed: CheckpointError: {run}: (step_\d+ not saved|a write failed): "
                     rf"no space left on the device "
                     rf"\(.* free\): free space there, or set checkpoint.dir to a larger filesystem, then relaunch to "
                     rf"resume; the last complete checkpoint, step_\d+, is kept; every rank's traceback: "
                     rf"{run / 'failure.log'}$", failed[0]), failed[0]
    assert "Traceback" not in out.stderr and "ERROR:" not in out.stderr  # the writers' reports are in failure.log
    kept = (run / "latest").read_text().strip()
    assert f"the last complete checkpoint, {kept}, is kept" in failed[0]
    assert not list(run.glob("*.tmp")) and "Traceback" in (run / "failure.log").read_text()
    grow(32)
    again = _train("run.steps=12", f"checkpoint.dir={mnt}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {run / kept}" in again.stderr
    assert (run / "latest").read_text().strip() == "step_00000012"
    # The space warning's estimate against what a save wrote: below it by the files' own overheads (metadata, RNG
    # state, per-tensor headers), which a 0.25M-parameter model makes large and a real one negligible.
    from megatron_rl.config import load_config, validate
    from megatron_rl.controller.job import checkpoint_bytes

    cfg = load_config(None, FAST)
    ratio = checkpoint_bytes(cfg, validate(cfg)) / dir_bytes(run / "step_00000012")
    assert 0.8 <= ratio <= 1.0, ratio


def test_unfinished_writes_are_removed_and_reported(tmp_path):
    from megatron_rl.checkpointing.training import TrainCheckpointer

    for step in (4, 6):
        (tmp_path / f"step_{step:08d}.tmp" / "model").mkdir(parents=True)
        (tmp_path / f"step_{step:08d}.tmp" / "model" / "x.distcp").write_bytes(b"\0" * 3000)
    (tmp_path / "step_00000002").mkdir()
    notes = []
    TrainCheckpointer(tmp_path, log=notes.append).remove_unfinished()
    assert notes == [f"removed 2 unfinished checkpoint writes (step_00000004.tmp, step_00000006.tmp): 5.9 KiB freed "
                     f"in {tmp_path}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]


def test_the_cause_is_found_in_the_exception_or_by_a_probe(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:  # torch's: per-rank (exception, stack) pairs, no cause in its message
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as e:
        full = CheckpointException("CheckpointException ranks:dict_keys([1])", {1: _wrap_exception(e)})
    assert storage.diagnose(tmp_path, full).startswith("no space left on the device (")
    try:
        try:
            raise OSError(errno.EROFS, "Read-only file system")
        except OSError as e:
            raise RuntimeError("write failed") from e
    except RuntimeError as e:
        assert storage.diagnose(tmp_path, e).startswith("the filesystem is read-only: remount it writable")
    # Nothing in the exception, and the directory takes a write: not the filesystem's fault.
    assert storage.diagnose(tmp_path, ValueError("shape mismatch")) is None
    gone = tmp_path / "gone"
    assert storage.diagnose(gone, RuntimeError("x")).startswith("the directory vanished during the save")
    # A bug (here, before the first save created the directory) is not a storage fault: its own error stands.
    assert storage.diagnose(gone, AttributeError("'NoneType' object has no attribute 'numel'")) is None


def test_a_read_only_checkpoint_directory_is_named(small_fs):
    mnt, _ = small_fs
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    assert storage.diagnose(mnt, RuntimeError("CheckpointException ranks:dict_keys([])")).startswith(
        "the filesystem is read-only")


def test_failure_log_goes_to_the_temporary_directory_when_the_run_directory_refuses_it(tmp_path):
    from megatron_rl.launch.failures import write_failure_log

    blocker = tmp_path / "file"
    blocker.write_text("")  # a run directory under a file cannot exist
    where = write_failure_log(blocker / "run", "the report " + uuid.uuid4().hex)
    m = re.fullmatch(r"every rank's traceback: (\S+) \((\S+) could not be written: (.+)\)", where)
    assert m and m.group(2) == str(blocker / "run" / "failure.log") and m.group(3) == "Not a directory", where
    assert Path(m.group(1)).read_text().startswith("the report ")
    os.unlink(m.group(1))
    assert write_failure_log(tmp_path / "run", "x") == f"every rank's traceback: {tmp_path / 'run' / 'failure.log'}"


def test_the_space_warning_counts_the_checkpoints_kept():
    free = storage.shutil.disk_usage("/").free
    assert storage.space_warning(Path("/"), 1024, keep_last=2, present=0) is None
    text = storage.space_warning(Path("/"), int(free * 0.6), keep_last=2, present=1)  # two more needed
    assert text is not None and "checkpoint.keep_last=2" in text
    assert storage.space_warning(Path("/"), int(free * 0.6), keep_last=2, present=3) is None  # one more: it fits
    assert storage.estimate_checkpoint_bytes(1000, 2, with_reference=False) == 14000  # bf16 + fp32 main + 2 moments
    # fp32 weights: the optimizer's checkpoint still holds its fp32 copy (`optimizer.state.param.*`) and 2 moments
    assert storage.estimate_checkpoint_bytes(1000, 4, with_reference=True) == 20000

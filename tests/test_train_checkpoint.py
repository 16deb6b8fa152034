"""Training checkpoints: save at one trainer layout, resume at another, continue exactly; atomic writes."""

import pytest
import torch

from ckpt_workers import index_contents, load_and_continue, train_save_continue
from megatron_rl.launch.spawn import run_local
from rl_workers import random_full_state
import warm_cli


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Saved at TP2 x PP2 x DP2: every way a checkpoint's tensors are cut."""
    state = tmp_path_factory.mktemp("init") / "full.pt"
    torch.save(random_full_state(), state)
    root = tmp_path_factory.mktemp("ckpt")
    return run_local(train_save_continue, 8, dict(tp=2, pp=2, dp=2), str(state), str(root), 3)


def test_the_save_rehearsed_on_the_meta_device_is_the_one_written(saved):
    """`resume-check` reasons about a save it builds on the meta device (each rank's stage, model state dict and
    distributed-optimizer boxes): its index equals the one the real save wrote, tensor by tensor (global shape,
    dtype, every chunk's offsets and sizes) and object by object."""
    from pathlib import Path

    from megatron_rl.models import get_preset
    from megatron_rl.parallel import ParallelLayout
    from megatron_rl.planning.resume_check import TrainerSpec, read_index, rehearsed_index

    written = read_index(Path(saved[0]["path"]))
    rehearsed = rehearsed_index(TrainerSpec(get_preset("tiny"), ParallelLayout(2, 2, 2), attention="sdpa"),
                                Path("tiny-tp2-pp2-dp2"))
    assert index_contents(rehearsed) == index_contents(written)
    assert sum(len(e.chunks) for _, _, e in written.tensors()) > 100


@pytest.mark.parametrize("layout", [dict(tp=1, pp=1, dp=2), dict(tp=2, pp=1, dp=2)], ids=["tp1dp2", "tp2dp2"])
def test_resume_at_another_layout_continues_exactly(saved, layout):
    """A fresh trainer at another layout, restored from the TP2 x PP2 x DP2 checkpoint, takes the same next step;
    each of its ranks read from the files the bytes `resume-check` predicted for it."""
    from pathlib import Path

    from megatron_rl.models import get_preset
    from megatron_rl.parallel import ParallelLayout
    from megatron_rl.planning.resume_check import TrainerSpec, read_index, rehearse

    ref = saved[0]
    out = run_local(load_and_continue, layout["tp"] * layout["dp"], layout, ref["path"], 3)
    target = ParallelLayout(**layout)
    predicted = sorted(rehearse(read_index(Path(ref["path"])), TrainerSpec(get_preset("tiny"), target,
                                                                            attention="sdpa")),
                       key=lambda r: target.local_rank(r.tp, r.pp, r.dp))
    assert [r["read_bytes"] for r in out] == [r.read_bytes for r in predicted]
    for r in out:
        assert r["rl_state"] == {"step": 3, "weight_version": 3}
        assert r["steps_done"] == 4
        assert r["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], rel=1e-5, abs=1e-7)
        assert r["metrics"]["lr"] == pytest.approx(ref["metrics"]["lr"], rel=1e-12)
        for k, v in ref["params"].items():
            torch.testing.assert_close(r["params"][k], v, atol=1e-5, rtol=0, msg=lambda s: f"{k}: {s}")


@pytest.fixture(scope="module")
def saved_dp2(tmp_path_factory):
    """Saved at TP2 x DP2 (each DP rank owns half of every bucket, so its ranges cut parameters mid-row), in the
    background: the next step changes the weights before the files are written."""
    state = tmp_path_factory.mktemp("init") / "full.pt"
    torch.save(random_full_state(), state)
    root = tmp_path_factory.mktemp("ckpt_dp2")
    return run_local(train_save_continue, 4, dict(tp=2, pp=1, dp=2), str(state), str(root), 3, True)


@pytest.mark.parametrize("layout", [dict(tp=1, pp=2, dp=2)], ids=["tp1pp2dp2"])
def test_state_saved_in_pieces_resumes_at_another_layout(saved_dp2, layout):
    """No rank gathers: every rank writes the boxes of its own ranges, from the copies taken when `save` returned.
    A layout that splits the parameters differently in TP, PP and DP reads them back and takes the same next
    step."""
    from megatron_rl.checkpointing.layout import verify

    ref = saved_dp2[0]
    assert verify(ref["path"]).optimizer_format == "model_space_pieces"
    out = run_local(load_and_continue, layout["tp"] * layout["pp"] * layout["dp"], layout, ref["path"], 3)
    for r in out:
        assert r["steps_done"] == 4
        assert r["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], rel=1e-5, abs=1e-7)
        for k, v in ref["params"].items():
            torch.testing.assert_close(r["params"][k], v, atol=1e-5, rtol=0, msg=lambda s: f"{k}: {s}")


def test_a_checkpoint_of_the_gathered_format_still_loads(tmp_path):
    """Checkpoints written before the pieces format (Megatron-Core's `fully_reshardable`, gathered on DP rank 0)
    hold the same keys and shapes: they load through the same code, at another layout."""
    from ckpt_workers import train_save_continue_old_format

    state = tmp_path / "full.pt"
    torch.save(random_full_state(), state)
    ref = run_local(train_save_continue_old_format, 2, dict(tp=1, dp=2), str(state), str(tmp_path / "run"), 3)[0]
    out = run_local(load_and_continue, 2, dict(tp=2, dp=1), ref["path"], 3)
    for r in out:
        assert r["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], rel=1e-5, abs=1e-7)
        for k, v in ref["params"].items():
            torch.testing.assert_close(r["params"][k], v, atol=1e-5, rtol=0, msg=lambda s: f"{k}: {s}")


def test_without_the_distributed_optimizer_a_checkpoint_resumes_at_another_layout(tmp_path):
    """`trainer.use_distributed_optimizer=false`: every DP rank holds the whole optimizer state, saved once (by
    DP rank 0 of each model-parallel shard) in Megatron-Core's own form."""
    state = tmp_path / "full.pt"
    torch.save(random_full_state(), state)
    ref = run_local(train_save_continue, 2, dict(tp=1, dp=2, distributed_optimizer=False), str(state),
                    str(tmp_path / "run"), 3)[0]
    out = run_local(load_and_continue, 2, dict(tp=2, dp=1, distributed_optimizer=False), ref["path"], 3)
    for r in out:
        assert r["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], rel=1e-5, abs=1e-7)
        for k, v in ref["params"].items():
            torch.testing.assert_close(r["params"][k], v, atol=1e-5, rtol=0, msg=lambda s: f"{k}: {s}")


def test_the_optimizer_state_matters(saved):
    """Control: restoring the weights alone (fresh Adam moments, fresh LR schedule) does not reproduce the next
    step, so the test above really checks the optimizer and scheduler restore."""
    ref = saved[0]
    out = run_local(load_and_continue, 1, dict(tp=1), ref["path"], 3, False)[0]
    diff = max((out["params"][k] - v).abs().max().item() for k, v in ref["params"].items())
    assert diff > 1e-4


@pytest.mark.parametrize("failpoint", ["checkpoint_between_model_and_optimizer", "checkpoint_background_write",
                                       "checkpoint_before_rename"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path, failpoint):
    import os
    from pathlib import Path

    from megatron_rl.checkpointing.layout import CheckpointError, read_latest, verify
    from megatron_rl.checkpointing.training import TrainCheckpointer

    state = tmp_path / "full.pt"
    torch.save(random_full_state(), state)
    root = tmp_path / "run"
    env = dict(os.environ, MEGATRON_RL_FAILPOINT=f"{failpoint}:step_00000004",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    proc = warm_cli.run([state, root], env=env, main="ckpt_workers:crash_main")
    # SIGKILLed inside the second save: the launcher names that rank
    assert proc.returncode != 0 and "died with signal 9" in proc.stderr, proc.stderr[-2000:]
    assert (root / "step_00000004.tmp").is_dir() and not (root / "step_00000004").exists()
    assert read_latest(root) == root / "step_00000002"
    assert verify(root / "step_00000002").step == 2
    assert TrainCheckpointer(root).find() == root / "step_00000002"
    with pytest.raises(CheckpointError, match="incomplete"):
        verify(root / "step_00000004.tmp")
    # The surviving checkpoint resumes exactly: same next step as an uninterrupted 2-step run.
    ref = run_local(train_save_continue, 1, dict(tp=1), str(state), str(tmp_path / "ref"), 2)[0]
    out = run_local(load_and_continue, 1, dict(tp=1), str(root / "step_00000002"), 2)[0]
    for k, v in ref["params"].items():
        torch.testing.assert_close(out["params"][k], v, atol=1e-6, rtol=0)


def test_corrupt_latest_is_named_and_fallback_only_when_asked(tmp_path):
    import json

    from megatron_rl.checkpointing.layout import META, CheckpointError
    from megatron_rl.checkpointing.training import TrainCheckpointer

    root = tmp_path / "run"
    for step in (2, 4):
        d = root / f"step_{step:08d}"
        (d / "model").mkdir(parents=True)
        (d / "model" / "shard.distcp").write_bytes(b"x" * 100)
        (d / META).write_text(json.dumps({"format": "megatron-rl/train", "step": step,
                                          "files": {"model/shard.distcp": 100}}))
    (root / "latest").write_text("step_00000004\n")
    assert TrainCheckpointer(root).find() == root / "step_00000004"
    (root / "step_00000004" / "model" / "shard.distcp").write_bytes(b"x" * 10)  # truncated
    with pytest.raises(CheckpointError, match=r"step_00000004: corrupt checkpoint \(model/shard.distcp has 10 "
                                              r"bytes, 100 were written\); set checkpoint.fallback=true to resume "
                                              r"from step_00000002"):
        TrainCheckpointer(root).find()
    assert TrainCheckpointer(root).find(fallback=True) == root / "step_00000002"


def _weights(d):
    """Every tensor of a dist_checkpointing directory, read back from its shards."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as t:
        dcp_to_torch_save(str(d), f"{t}/all.pt")
        sd = torch.load(f"{t}/all.pt", weights_only=False)
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def _flip_bits(f, offset=None):
    """Flip one byte in the middle of a file, keeping its size (what a size-only manifest cannot see)."""
    data = bytearray(f.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    f.write_bytes(bytes(data))


def test_flipped_bits_are_named_in_one_line_and_fallback_resumes_from_the_previous(tmp_path):
    import json
    from pathlib import Path

    from megatron_rl.checkpointing.layout import CHECKSUMS, META
    from megatron_rl.checkpointing.layout import CheckpointError, verify
    from megatron_rl.checkpointing.training import TrainCheckpointer
    from megatron_rl.launch.spawn import run_local
    from ckpt_workers import train_with_two_saves

    state = tmp_path / "full.pt"
    torch.save(random_full_state(), state)
    root = tmp_path / "run"
    run_local(train_with_two_saves, 2, str(state), str(root))
    new, old = root / "step_00000004", root / "step_00000002"
    meta = json.loads((new / META).read_text())
    assert set(meta[CHECKSUMS]) == set(meta["files"]) and all(v.startswith("crc32:") for v in meta[CHECKSUMS].values())
    assert verify(new, checksums=True).step == 4
    shard = sorted((new / "model").glob("__1_*.distcp"))[0]  # written by rank 1: its checksum came from rank 1
    _flip_bits(shard)
    verify(new)  # sizes alone still match
    line = rf"{shard}: checksum mismatch \(flipped bits or a partial copy\)"
    with pytest.raises(CheckpointError, match=line + "$"):
        verify(new, checksums=True)
    with pytest.raises(CheckpointError, match=line + "; set checkpoint.fallback=true to resume from step_00000002$"):
        TrainCheckpointer(root).find()
    with pytest.raises(CheckpointError, match=line + "$"):
        TrainCheckpointer(root).load(new)
    assert TrainCheckpointer(root).find(fallback=True) == old
    # The fallback resumes: the previous checkpoint loads at another layout (the files split over 2 ranks to check).
    out = run_local(load_and_continue, 2, dict(tp=1, dp=2), str(old), 2)
    assert all(r["rl_state"] == {"step": 2, "weight_version": 2} for r in out)
    # inspect names the file too, in one line.
    proc = warm_cli.run(["inspect", str(root)], timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert f"{shard}: checksum mismatch" in proc.stderr
    # A checkpoint written before checksums (no CHECKSUMS in its metadata) still loads.
    del meta[CHECKSUMS]
    (new / META).write_text(json.dumps(meta))
    assert TrainCheckpointer(root).find() == new and verify(new, checksums=True).step == 4
    assert Path(shard).stat().st_size == meta["files"][str(shard.relative_to(new))]


def test_an_update_that_makes_the_weights_non_finite_stops_and_is_never_saved(tmp_path):
    """The issue's `trainer.lr=inf`: loss and gradients finite, the update NaN. The step raises on every rank, a
    save refuses, and the checkpoint on disk holds only finite values."""
    from megatron_rl.checkpointing.layout import read_latest
    from megatron_rl.launch.spawn import run_local
    from ckpt_workers import overflowing_update

    state = tmp_path / "full.pt"
    torch.save(random_full_state(), state)
    root = tmp_path / "run"
    out = run_local(overflowing_update, 2, str(state), str(root))
    for r in out:
        assert r["step"].startswith("NonFiniteError: update 2 made the weights non-finite") and "\n" not in r["step"]
        assert r["save"].startswith(f"CheckpointError: {root / 'step_00000002'}: not written: the trainer's weights")
    assert read_latest(root) == root / "step_00000001"
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["latest", "step_00000001"]
    for sub in ("model", "optimizer"):
        tensors = _weights(root / "step_00000001" / sub)
        assert tensors and all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point()), sub


@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 3, 5), (2, 1, 6)])
def test_a_flat_range_is_covered_by_contiguous_boxes(shape):
    """`boxes` against the flat indices themselves: every box is one contiguous run of the range, in order, and
    there are at most 2N-1 of them for an N-d tensor."""
    import math
    import random

    from megatron_rl.checkpointing.optimizer_state import boxes

    n = math.prod(shape)
    index = torch.arange(n).view(shape)
    rng = random.Random(0)
    for _ in range(100):
        start = rng.randint(0, n)
        end = rng.randint(start, n)
        covered = []
        found = list(boxes(shape, start, end))
        assert len(found) <= 2 * len(shape) - 1
        for offset, size, flat in found:
            run = index[tuple(slice(o, o + z) for o, z in zip(offset, size))].reshape(-1).tolist()
            assert run == list(range(flat, flat + len(run)))
            covered += run
        assert covered == list(range(start, end))

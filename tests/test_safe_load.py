"""Loading a checkpoint runs no code: a pickle that runs a command, planted in each pickled file of a training
checkpoint and of a converted one (with the manifest's sizes and CRC-32s updated, so only the content is
hostile), is refused in one line by resuming, `inspect`, `eval`, `convert`, `plan --checkpoint` and the
initial-weights loader, and the command never runs."""

import contextlib
import io
import json
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_rl.checkpointing import safe_load
from megatron_rl.checkpointing.layout import CHECKSUMS, MANIFEST, META, CheckpointError, file_checksum
from megatron_rl.launch.spawn import run_local
import warm_cli

transformers = pytest.importorskip("transformers")

# Every pickled file of the checkpoints below, by what reads it: torch's `.metadata` reader (pickle.load), Megatron-
# Core's `common.pt` and our `.pt` files (torch.load), and the `_extra_state` blobs inside a shard (torch.load with
# weights_only=False).
TRAIN_FILES = ["model/.metadata", "optimizer/.metadata", "model/common.pt", "optimizer/common.pt",
               "rng/rank_00000.pt", "rl_state.pt", "model/*.distcp"]
CONVERTED_FILES = ["model/.metadata", "model/common.pt", "model/*.distcp"]


class _RunsCode:
    """Unpickles into a call of os.system (module `posix`), which creates `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A training checkpoint root (steps 2 and 4, 1 rank) and a converted checkpoint, each written once."""
    from ckpt_workers import train_with_two_saves
    from megatron_rl.checkpointing.convert import convert
    from rl_workers import random_full_state
    from tiny_hf import save_tiny_llama

    d = tmp_path_factory.mktemp("safe_load")
    torch.save(random_full_state(), d / "full.pt")
    run_local(train_with_two_saves, 1, str(d / "full.pt"), str(d / "run"))
    save_tiny_llama(d / "hf")
    convert(d / "hf", d / "converted", "megatron")
    return d / "run", d / "converted"


def _blob(ckpt: Path):
    """(shard file, offset, length) of the first `_extra_state` blob of `ckpt/model`, where its index says."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = FileSystemReader(str(ckpt / "model")).read_metadata()
    index, info = next((i, s) for i, s in md.storage_data.items()
                       if isinstance(md.state_dict_metadata[i.fqn], BytesStorageMetadata))
    return ckpt / "model" / info.relative_path, info.offset, info.length


def _plant(ckpt: Path, rel: str, marker: Path) -> Path:
    """Replace the pickle in `ckpt/rel` by one that runs a command, and record the new size and CRC-32 in the
    manifest when the checkpoint has one. Returns the file that now holds it."""
    f = ckpt / rel
    if rel.endswith(".distcp"):  # the blob's bytes, in place: a bare pickle, padded to the blob's length
        f, offset, length = _blob(ckpt)  # the shard the index places it in
        rel = str(f.relative_to(ckpt))
        evil = pickle.dumps(_RunsCode(marker))
        data = bytearray(f.read_bytes())
        data[offset:offset + length] = evil + b"\0" * (length - len(evil))
        f.write_bytes(bytes(data))
    elif rel.endswith(".pt"):
        torch.save({"state": _RunsCode(marker)}, f)
    else:
        f.write_bytes(pickle.dumps(_RunsCode(marker)))
    meta = json.loads((ckpt / META).read_text())
    if meta.get(MANIFEST):
        meta[MANIFEST][rel] = f.stat().st_size
        meta[CHECKSUMS][rel] = file_checksum(f)
        (ckpt / META).write_text(json.dumps(meta))
    return f


def _would_run(ckpt: Path, rel: str) -> None:
    """Load the planted file the way torch does without the check (the plant is real: the command runs, and
    torch then fails on what os.system returned)."""
    from torch.distributed.checkpoint import FileSystemReader

    with contextlib.suppress(Exception):
        if rel.endswith(".distcp"):
            shard, offset, length = _blob(ckpt)
            torch.load(io.BytesIO(shard.read_bytes()[offset:offset + length]), weights_only=False)
        elif rel.endswith(".pt"):
            torch.load(ckpt / rel, weights_only=False)
        else:
            FileSystemReader(str(ckpt / rel).removesuffix("/.metadata")).read_metadata()


def _one_line(text: str, f: Path) -> None:
    assert "\n" not in text.strip(), text
    assert f"{f}" in text and "holds posix.system, which a checkpoint may not hold" in text, text


def _refused_everywhere(ckpt: Path, f: Path, tmp: Path, capsys) -> None:
    """`inspect`, `eval`, `convert --to hf` and `plan --checkpoint` end in one line naming the file."""
    from megatron_rl.checkpointing.convert import convert
    from megatron_rl.checkpointing.layout import ConversionError
    from megatron_rl.checkpointing.inspect import run as inspect
    from megatron_rl.evaluation import EvalError, EvalSettings, evaluate
    from megatron_rl.planning.checkpoint import ReshardError, checkpoint_report

    assert inspect(ckpt) == 2
    _one_line(capsys.readouterr().err, f)
    data = tmp / "data"  # one GSM8K problem of its own: eval reads its problems, then the checkpoint
    (data / "gsm8k").mkdir(parents=True)
    (data / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"}) + "\n")
    settings = EvalSettings(data_dir=str(data), limit=1, max_new_tokens=2, tokenizer="byte")
    for call, error in ((lambda: evaluate(ckpt, settings), EvalError),
                        (lambda: convert(ckpt, tmp / "hf_out", "hf"), ConversionError),
                        (lambda: checkpoint_report(ckpt, None, None, None), ReshardError)):
        with pytest.raises(error) as e:
            call()
        _one_line(str(e.value), f)
    assert not (tmp / "hf_out").exists()


@pytest.mark.parametrize("rel", TRAIN_FILES)
def test_a_training_checkpoint_that_would_run_code_is_refused(saved, rel, tmp_path, capsys):
    from megatron_rl.checkpointing.layout import checksum_mismatches, read_meta
    from megatron_rl.checkpointing.training import TrainCheckpointer

    root = tmp_path / "run"
    shutil.copytree(saved[0], root)
    ckpt, marker = root / "step_00000004", tmp_path / "ran"
    f = _plant(ckpt, rel, marker)
    assert checksum_mismatches(ckpt, read_meta(ckpt)) == []  # only the content is hostile
    _would_run(ckpt, rel)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(CheckpointError) as e:
        TrainCheckpointer(root).find()
    _one_line(str(e.value), f)
    assert str(e.value).endswith("; set checkpoint.fallback=true to resume from step_00000002")
    with pytest.raises(CheckpointError) as e:
        TrainCheckpointer(root).load(ckpt)
    _one_line(str(e.value), f)
    assert TrainCheckpointer(root).find(fallback=True) == root / "step_00000002"
    _refused_everywhere(ckpt, f, tmp_path, capsys)
    assert not marker.exists()


@pytest.mark.parametrize("rel", CONVERTED_FILES)
def test_a_converted_checkpoint_that_would_run_code_is_refused(saved, rel, tmp_path, capsys):
    from megatron_rl.checkpointing.initial import load_weights

    ckpt, marker = tmp_path / "converted", tmp_path / "ran"
    shutil.copytree(saved[1], ckpt)
    f = _plant(ckpt, rel, marker)
    _would_run(ckpt, rel)
    assert marker.exists()
    marker.unlink()
    _refused_everywhere(ckpt, f, tmp_path, capsys)
    with pytest.raises(CheckpointError) as e:  # a job's initial weights: before any rank reads them
        load_weights(None, ckpt)
    _one_line(str(e.value), f)
    assert not marker.exists()


def test_the_checked_files_are_every_pickle_and_clean_checkpoints_pass(saved):
    train, converted = saved
    ckpt = train / "step_00000004"
    assert safe_load.pickled_files(ckpt) == ["model/.metadata", "optimizer/.metadata", "rl_state.pt",
                                             "rng/rank_00000.pt"]
    assert safe_load.problems(ckpt) == [] and safe_load.problems(converted) == []
    # Outside the dist_checkpointing directories no file but these holds a pickle: JSON, tokenizer files, shards.
    others = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()} - set(TRAIN_FILES[:-1])
    assert all(p.endswith((".json", ".distcp")) for p in others), others


def test_a_resumed_job_refuses_in_one_line(saved, tmp_path):
    """The issue's case through the command itself: the RNG file of the newest checkpoint runs a command."""
    root = tmp_path / "ck" / "hostile"
    shutil.copytree(saved[0], root)
    marker = tmp_path / "ran"
    f = _plant(root / "step_00000004", "rng/rank_00000.pt", marker)
    proc = warm_cli.run(["train", f"checkpoint.dir={tmp_path / 'ck'}", "run.name=hostile", "trainer.tp=1",
                         "generator.colocated=true", "run.steps=6"])
    assert proc.returncode != 0 and not marker.exists()
    lines = [line for line in proc.stderr.splitlines() if "CheckpointError" in line]
    assert len(lines) == 1, proc.stderr
    _one_line(lines[0], f)


def test_rng_states_load_without_pickled_code_in_both_formats(tmp_path):
    """The RNG file holds tensors and numbers (torch's weights-only loader reads it as it is); one written before
    that, with numpy's state as an array, still restores numpy's stream."""
    from megatron_rl.checkpointing.rng import rng_state, set_rng_state

    np.random.seed(3)
    random.seed(4)
    torch.save(rng_state(), tmp_path / "new.pt")
    old = dict(torch.load(tmp_path / "new.pt", weights_only=True), numpy=np.random.get_state())
    torch.save(old, tmp_path / "old.pt")
    expected = (np.random.rand(4), random.random(), torch.rand(2))
    for name in ("new.pt", "old.pt"):
        np.random.seed(0)
        set_rng_state(safe_load.load_data(tmp_path / name, numpy_arrays=True))
        assert np.array_equal(np.random.rand(4), expected[0]) and random.random() == expected[1]
        assert torch.equal(torch.rand(2), expected[2])
    with pytest.raises(CheckpointError, match=r"old.pt: holds numpy\.\S+, which"):
        safe_load.load_data(tmp_path / "old.pt")  # arrays only where asked for
    torch.save({"numpy": _RunsCode(tmp_path / "ran")}, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match="holds posix.system"):
        safe_load.load_data(tmp_path / "bad.pt", numpy_arrays=True)
    assert not (tmp_path / "ran").exists()


def test_an_index_may_not_place_an_object_outside_its_directory(saved, tmp_path):
    """An index built only from torch's metadata classes still says where torch reads each object: a place outside
    the directory (or past the end of a shard) is refused before torch reads it."""
    import dataclasses

    ckpt = tmp_path / "converted"
    shutil.copytree(saved[1], ckpt)
    md = safe_load.read_dcp_metadata(ckpt / "model")
    index = next(i for i, s in md.storage_data.items() if i.fqn.endswith("_extra_state/shard_0_2"))
    shard = md.storage_data[index].relative_path
    for where, line in ((dict(relative_path="../megatron_rl.json"), "in '../megatron_rl.json', not a file of"),
                        (dict(length=1 << 30), f"outside {shard}")):
        md.storage_data[index] = dataclasses.replace(md.storage_data[index], **where)
        (ckpt / "model" / ".metadata").write_bytes(pickle.dumps(md))
        with pytest.raises(CheckpointError, match=line):
            safe_load.check_dist_dir(ckpt / "model")
        md = safe_load.read_dcp_metadata(saved[1] / "model")

"""A checkpoint whose index misses a chunk of a tensor, or lists one twice, is refused in one line before anything
loads (`checkpointing/coverage.py`), where torch's load would leave the missing elements as the new model held them.
The job's case: the default job (trainer TP2) saves, one of the two chunks of the embedding is removed from
`model/.metadata` (the manifest's size and CRC-32 updated, so only the coverage is wrong), and a resume at TP1 x DP2
fails naming the tensor and the range, as `megatron-rl resume-check` does from the checkpoint or its metadata alone
(which, on the intact checkpoint, reports what each rank reads, the same for the run's config as SOURCE)."""

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import yaml

from megatron_rl.checkpointing.coverage import tensor_problem
from megatron_rl.checkpointing.layout import CHECKSUMS, MANIFEST, META, file_checksum
from megatron_rl.checkpointing.optimizer_state import boxes
from megatron_rl.checkpointing.safe_load import read_dcp_metadata
import warm_cli

REPO = Path(__file__).resolve().parents[1]
FAST = ["trainer.sft_warmup_steps=0", "rollout.prompts_per_step=4", "data.eval_size=4", "run.eval_interval=1000",
        "rollout.max_new_tokens=6", "checkpoint.save_interval=1000"]


def _pieces(shape, parts):
    """The optimizer's pieces of `shape` for `parts` equal flat ranges (uneven boxes, cut mid-row)."""
    n = 1
    for s in shape:
        n *= s
    cuts = [n * i // parts for i in range(parts + 1)]
    return [(o, s) for a, b in zip(cuts, cuts[1:]) for o, s, _ in boxes(shape, a, b)]


@pytest.mark.parametrize("shape,parts", [((512, 64), 2), ((10, 7), 3), ((4, 352, 64), 5), ((7,), 4)])
def test_exact_tilings_pass_and_each_defect_is_named(shape, parts):
    chunks = _pieces(shape, parts)
    assert tensor_problem(shape, chunks) is None
    (o, s), rest = chunks[1], chunks[:1] + chunks[2:]
    lost = tensor_problem(shape, rest)
    assert lost.endswith("are in no saved chunk") and lost.startswith("elements [")
    lo = [int(a.split(":")[0]) for a in lost.split("[")[1].split("]")[0].split(", ")]
    assert all(oi <= li < oi + si for oi, si, li in zip(o, s, lo))  # the range named lies in the removed chunk
    assert tensor_problem(shape, chunks + [chunks[0]]).endswith("are in more than one saved chunk")
    outside = (tuple(shape[:-1] and [0] * (len(shape) - 1)) + (shape[-1] - 1,), (1,) * (len(shape) - 1) + (2,))
    assert "lies outside its shape" in tensor_problem(shape, chunks + [outside])


def test_a_resume_whose_index_misses_a_chunk_fails_in_one_line_before_loading(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    args = ["train", *FAST, f"checkpoint.dir={tmp_path}", "run.name=c"]
    first = warm_cli.run([*args, "run.steps=2"], cwd=REPO, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = tmp_path / "c" / "step_00000002"
    target = ["trainer.tp=1", "trainer.dp=2"]  # the layout the resume below takes
    report, _ = _resume_check([str(ckpt), *target, "--json"], env, 0)
    assert report["ok"] and (report["written_at"], report["target"]) == ("tp=2,pp=1,dp=1", "tp=1,pp=1,dp=2")
    assert [(r["tp"], r["pp"], r["dp"]) for r in report["per_rank"]] == [(0, 0, 0), (0, 0, 1)]
    assert report["read_bytes"] == sum(r["read_bytes"] for r in report["per_rank"]) < report["needed_bytes"]
    assert report["max_rank_needed_bytes"] == max(r["needed_bytes"] for r in report["per_rank"])
    assert report["load_s"] > 0 and report["tensors"] > 0 and report["objects"] > 0
    assert report["files"]["checked"] >= 6 and not report["files"]["checksums"]  # each present, with its size
    _damaged_files_are_one_line(ckpt, tmp_path, target)
    # The run's config as a SOURCE: the save its job writes, rehearsed on the meta device, is the one it wrote
    # (its dtype pinned to the one the run resolved "auto" to: resume-check resolves it for the calibrated GPU).
    config = yaml.safe_load((tmp_path / "c" / "config.yaml").read_text())
    config["trainer"]["dtype"] = {"bfloat16": "bf16", "float32": "fp32"}[json.loads((ckpt / META).read_text())["dtype"]]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    rehearsed, _ = _resume_check([str(tmp_path / "run.yaml"), *target, "--json"], env, 0)
    for k in ("tensors", "chunks", "objects", "written_bytes", "read_bytes", "needed_bytes", "per_rank"):
        assert rehearsed[k] == report[k], k
    index = ckpt / "model" / ".metadata"
    key = "embedding.word_embeddings.weight"
    entry = read_dcp_metadata(index.parent).state_dict_metadata[key]
    assert len(entry.chunks) == 2  # saved at trainer TP2
    removed = _rewrite_index(ckpt, lambda md: md.state_dict_metadata[key].chunks.pop())

    again = warm_cli.run([*args, "run.steps=4", "trainer.tp=1", "trainer.dp=2"], cwd=REPO, env=env)
    assert again.returncode == 1, again.stderr[-3000:]
    lo = [int(o) for o in removed.offsets]
    hi = [o + int(s) for o, s in zip(lo, removed.sizes)]
    rng = ", ".join(f"{a}:{b}" for a, b in zip(lo, hi))
    lines = [line for line in again.stderr.splitlines() if key in line]
    assert len(lines) == 1 and f"{index}: {key}: elements [{rng}] of {list(entry.size)} are in no saved chunk" \
        in lines[0], again.stderr[-3000:]
    assert "resumed from" not in again.stderr

    # resume-check names the same range, from the checkpoint or from a copy of its metadata alone
    alone = tmp_path / "metadata-only" / ckpt.name
    for sub in ("model", "optimizer"):
        (alone / sub).mkdir(parents=True)
        shutil.copy(ckpt / sub / ".metadata", alone / sub)
    shutil.copy(ckpt / META, alone)
    for where, json_too in ((ckpt, []), (alone, ["--json", "--index-only"])):
        failed, lines = _resume_check([str(where), *target, *json_too], env, 1)
        line = f"{where / 'model' / '.metadata'}: {key}: elements [{rng}] of {list(entry.size)} are in no saved chunk"
        assert line in lines[0] and (failed is None or line in failed["error"] and not failed["ok"])

    # With the chunk back and a layer's `_extra_state` gone, the index tiles every tensor (the load's own check
    # passes), and the resume fails in `resume-check`'s line instead of in the load
    _rewrite_index(ckpt, lambda md: md.state_dict_metadata[key].chunks.append(removed))
    gone = "decoder.layers.mlp.linear_fc2._extra_state/shard_2_4"
    _rewrite_index(ckpt, lambda md: md.state_dict_metadata.pop(gone))
    again = warm_cli.run([*args, "run.steps=4", *target], cwd=REPO, env=env)
    assert again.returncode == 1, again.stderr[-3000:]
    lines = [line for line in again.stderr.splitlines() if gone in line]
    assert len(lines) == 1 and f"{index}: holds no object {gone}, which is loaded by the ranks tp 0, pp 0 of the " \
        f"trainer at tp=2,pp=1,dp=1" in lines[0], again.stderr[-3000:]  # at the layout it was written with first
    assert "resumed from" not in again.stderr


def _damaged_files_are_one_line(ckpt, tmp_path, target):
    """`resume-check` looks at what the load will read (issue 65: it said yes to a checkpoint whose shards were
    deleted): a shard missing or cut short is one line naming it, exit 1, from the stat calls alone; one flipped
    byte is found with --checksums."""
    import contextlib
    import io

    from megatron_rl.planning import resume_check

    def check(where, *flags):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = resume_check.run(str(where), overrides=target, as_json=True, index_only="--index-only" in flags,
                                    checksums="--checksums" in flags)
        return code, [line for line in err.getvalue().splitlines() if not line.endswith(" s]")]

    rel = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*.distcp"))[-1]
    size = (ckpt / rel).stat().st_size
    prog = "megatron-rl resume-check"
    for damage, flags, says in (
            (lambda f: f.unlink(), [], "{ckpt}: corrupt checkpoint ({rel} missing), and the load reads it"),
            (lambda f: os.truncate(f, size - 1), [],
             f"{{ckpt}}: corrupt checkpoint ({{rel}} has {size - 1} bytes, {size} were written), and the load "
             "reads it"),
            (lambda f: f.write_bytes(bytes([f.read_bytes()[0] ^ 1]) + f.read_bytes()[1:]), ["--checksums"],
             "{ckpt}/{rel}: checksum mismatch (flipped bits or a partial copy), and the load reads it")):
        copy = tmp_path / "damaged" / ckpt.name
        shutil.rmtree(copy.parent, ignore_errors=True)
        shutil.copytree(ckpt, copy)
        damage(copy / rel)
        assert check(copy, *flags) == (1, [f"{prog}: " + says.format(ckpt=copy, rel=rel)])
    assert check(copy)[0] == 0  # a flipped byte keeps the size: found only by reading
    assert check(copy, "--checksums", "--index-only")[0] == 2


def _rewrite_index(ckpt, change):
    """Apply `change` to the index of checkpoint `ckpt`'s model (torch DCP's `Metadata`), write it back with its
    size and CRC-32 in the manifest (so that only the index is wrong), and return what `change` returned."""
    index = ckpt / "model" / ".metadata"
    md = read_dcp_metadata(index.parent)
    out = change(md)
    with open(index, "wb") as f:
        pickle.dump(md, f)
    meta = json.loads((ckpt / META).read_text())
    meta[MANIFEST]["model/.metadata"] = index.stat().st_size
    meta[CHECKSUMS]["model/.metadata"] = file_checksum(index)
    (ckpt / META).write_text(json.dumps(meta))
    return out


def _resume_check(args, env, code):
    """`megatron-rl resume-check ARGS`, whose exit status must be `code`: its JSON object (with --json) and the
    lines on stderr other than its progress (exit 1: exactly one)."""
    out = warm_cli.run(["resume-check", *args], cwd=REPO, env=env)
    assert out.returncode == code, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if not line.endswith(" s]")]  # progress lines end "[N s]"
    assert code == 0 or len(lines) == 1, out.stderr[-3000:]
    return json.loads(out.stdout) if "--json" in args else None, lines

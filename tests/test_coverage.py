"""A checkpoint whose index misses a chunk of a tensor, or lists one twice, is refused in one line before anything
loads (`checkpointing/coverage.py`), where torch's load would leave the missing elements as the new model held them.
The job's case: the default job (trainer TP2) saves, one of the two chunks of the embedding is removed from
`model/.metadata` (the manifest's size and CRC-32 updated, so only the coverage is wrong), and a resume at TP1 x DP2
fails naming the tensor and the range."""

import json
import os
import pickle
from pathlib import Path

import pytest

from megatron_rl.checkpointing.coverage import tensor_problem
from megatron_rl.checkpointing.layout import CHECKSUMS, MANIFEST, META, file_checksum
from megatron_rl.checkpointing.optimizer_state import boxes
from megatron_rl.checkpointing.safe_load import read_dcp_metadata
import warm_cli

REPO = Path(__file__).resolve().parents[1]
FAST = ["trainer.sft_warmup_steps=10", "rollout.prompts_per_step=4", "data.eval_size=4", "run.eval_interval=1000",
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
    index = ckpt / "model" / ".metadata"
    md = read_dcp_metadata(index.parent)
    key = "embedding.word_embeddings.weight"
    entry = md.state_dict_metadata[key]
    assert len(entry.chunks) == 2  # saved at trainer TP2
    removed = entry.chunks.pop()
    with open(index, "wb") as f:
        pickle.dump(md, f)
    meta = json.loads((ckpt / META).read_text())
    meta[MANIFEST]["model/.metadata"] = index.stat().st_size
    meta[CHECKSUMS]["model/.metadata"] = file_checksum(index)
    (ckpt / META).write_text(json.dumps(meta))

    again = warm_cli.run([*args, "run.steps=4", "trainer.tp=1", "trainer.dp=2"], cwd=REPO, env=env)
    assert again.returncode == 1, again.stderr[-3000:]
    lo = [int(o) for o in removed.offsets]
    hi = [o + int(s) for o, s in zip(lo, removed.sizes)]
    rng = ", ".join(f"{a}:{b}" for a, b in zip(lo, hi))
    lines = [line for line in again.stderr.splitlines() if key in line]
    assert len(lines) == 1 and f"{index}: {key}: elements [{rng}] of {list(entry.size)} are in no saved chunk" \
        in lines[0], again.stderr[-3000:]
    assert "resumed from" not in again.stderr

"""`megatron-rl inspect`: what a checkpoint holds, from its metadata only (no tensor is loaded).

Understands
- a conversion checkpoint: `DIR/megatron_rl.json` (format "megatron-rl/dist_checkpointing") + `DIR/model/`;
- a training checkpoint: `DIR/megatron_rl.json` (format "megatron-rl/train": step, weight version, layout, dtype,
  model, tokenizer, optionally a manifest of every file with its size and checksum) + `DIR/model/` +
  `DIR/optimizer/` + `DIR/rl_state.pt`;
- a run's checkpoint root: `ROOT/step_00000042/`-style checkpoints, `ROOT/latest` naming the newest complete one,
  and `*.tmp*` directories, which are incomplete writes;
- a bare Megatron-Core dist_checkpointing (torch_dist) directory.
`model/` and `optimizer/` are read through torch.distributed.checkpoint's `.metadata` (global shapes and dtypes of
every tensor). A checkpoint missing any of that is reported in one line naming the path and what is missing.
Read beyond metadata, to check them: the files of a checkpoint with checksums (a file whose content changed is
named in one line), and every pickled file, which may hold only data (`safe_load`: a file that would run code is
named in one line, and nothing in it runs).
The metadata, the step directories and `latest` are read through `layout.py`, as training reads them. Here too:
`reading`, how every reader (`inspect`, `eval`, `convert --to hf`, `plan --checkpoint`, a job's `model.checkpoint`)
resolves a path to a checkpoint and holds it against the run's retention while it reads (`leases.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

from megatron_rl.checkpointing.layout import (CONVERT_FORMAT, DCP_METADATA, LATEST, META, MODEL_DIR, OPTIMIZER_DIR,
                                              RL_STATE, RNG_DIR, STEP_DIR, TOKENIZER_DIR, TRAIN_FORMAT,
                                              CheckpointError, CheckpointMeta, InspectError, checksum_mismatches,
                                              dir_bytes, manifest_problems, mismatch_line, read_latest, read_meta,
                                              removed_line, step_dirs)
from megatron_rl.checkpointing import leases, safe_load
from megatron_rl.checkpointing.storage import human_bytes
from megatron_rl.models.presets import ModelConfig


# ---- small helpers -----------------------------------------------------------------------------------------------
def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def is_dist_checkpoint(d: Path) -> bool:
    return (d / DCP_METADATA).is_file()


def dist_tensors(d: Path, what: str = "model") -> list[dict]:
    """Every tensor of a torch_dist checkpoint directory: name, global shape, dtype, elements, bytes.

    Reads only `.metadata`. Non-tensor entries (Megatron's `_extra_state` blobs) are left out."""
    if not d.is_dir():
        raise InspectError(f"{d.parent}: incomplete checkpoint: {what}/ missing")
    if not is_dist_checkpoint(d):
        raise InspectError(f"{d.parent}: incomplete checkpoint: {what}/{DCP_METADATA} missing "
                           f"(a write that did not finish, or not a dist_checkpointing directory)")
    # torch loads here, not when the module is imported: resolving a checkpoint path (config checks, eval's argument
    # errors) stays fast.
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        md = safe_load.read_dcp_metadata(d)
    except CheckpointError as e:
        raise InspectError(str(e)) from None
    out = []
    for name, m in md.state_dict_metadata.items():
        if not isinstance(m, TensorStorageMetadata):
            continue
        shape = [int(s) for s in m.size]
        numel = 1
        for s in shape:
            numel *= s
        dtype = m.properties.dtype
        out.append({"name": name, "shape": shape, "dtype": _dtype_name(dtype), "numel": numel,
                    "bytes": numel * torch.empty((), dtype=dtype).element_size()})
    return out


def read_model(ckpt: Path) -> tuple[ModelConfig, CheckpointMeta]:
    """(ModelConfig, metadata) of a conversion or training checkpoint (`layout.read_meta`)."""
    meta = read_meta(Path(ckpt))
    return meta.model_config(), meta


# ---- run roots ---------------------------------------------------------------------------------------------------
def is_run_root(p: Path) -> bool:
    if not p.is_dir() or (p / META).exists():
        return False
    return (p / LATEST).is_file() or bool(step_dirs(p))


def _is_complete(d: Path) -> bool:
    return ".tmp" not in d.name and (d / META).is_file() and is_dist_checkpoint(d / MODEL_DIR)


def list_run(root: Path) -> list[dict]:
    """Checkpoint directories of a run root, by step: name, step, status (complete / incomplete), bytes."""
    return [{"name": c.name, "step": step, "status": "complete" if _is_complete(c) else "incomplete",
             "bytes": dir_bytes(c)} for step, c in step_dirs(root)]


def _latest_name(root: Path) -> Optional[str]:
    """The checkpoint name `ROOT/latest` points at (None without a pointer: `layout.read_latest`); a pointer that
    names nothing usable is an InspectError."""
    try:
        target = read_latest(root, must_exist=True)
    except CheckpointError as e:
        raise InspectError(str(e)) from None
    return None if target is None else target.name


def _missing(path: Path) -> InspectError:
    """The error for a path that does not exist: a step that retention removed says so (`layout.removed_line`)."""
    return InspectError(removed_line(path) or f"{path}: does not exist")


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory from a checkpoint or a run root (its `latest`, else its newest complete step).
    A reader holds it with `reading`, so that the run's retention does not remove it meanwhile."""
    path = Path(path)
    if not path.exists():
        raise _missing(path)
    if (path / META).is_file():
        return path
    if is_run_root(path):
        name = _latest_name(path)
        if name is None:
            done = [r for r in list_run(path) if r["status"] == "complete"]
            if not done:
                raise InspectError(f"{path}: run directory without a complete checkpoint (no {LATEST} file)")
            name = done[-1]["name"]
        return path / name
    raise InspectError(f"{path}: not a megatron-rl checkpoint ({META} missing) nor a run directory "
                       f"({LATEST} and step_* directories missing)")


def reading(path: Path) -> leases.Lease:
    """`resolve_checkpoint(path)` with a lease on the step it names when it is a run's (`leases.py`): `with
    reading(path) as ckpt:` reads `ckpt`, which the run's retention keeps until the block ends. InspectError
    (one line) as `resolve_checkpoint`."""
    path = Path(path)
    root = path if is_run_root(path) else path.parent if STEP_DIR.match(path.name) else None
    if root is None or not is_run_root(root):
        return leases.Lease(resolve_checkpoint(path))
    return leases.take(root, lambda: resolve_checkpoint(path))


# ---- inspection --------------------------------------------------------------------------------------------------
def inspect_checkpoint(ckpt: Path) -> dict:
    """Everything `inspect` reports about one checkpoint directory (raises InspectError when unusable)."""
    ckpt = Path(ckpt)
    try:
        meta = read_meta(ckpt)
    except CheckpointError as e:
        raise InspectError(str(e)) from None
    tensors = dist_tensors(ckpt / MODEL_DIR, MODEL_DIR)
    fmt = meta.format
    optimizer = None
    if fmt == TRAIN_FORMAT:
        opt = dist_tensors(ckpt / OPTIMIZER_DIR, OPTIMIZER_DIR)
        optimizer = {"tensors": len(opt), "numel": sum(t["numel"] for t in opt),
                     "bytes": dir_bytes(ckpt / OPTIMIZER_DIR)}
    problems = manifest_problems(ckpt, meta.files)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InspectError(f"{ckpt}: corrupt checkpoint: {problems[0]}{more}")
    mismatches = checksum_mismatches(ckpt, meta)
    if mismatches:
        raise InspectError(mismatch_line(ckpt, mismatches))
    try:
        safe_load.check_checkpoint(ckpt)
    except CheckpointError as e:
        raise InspectError(str(e)) from None
    if meta.checksums:
        checksums = f"{len(meta.checksums)} files match their CRC-32"
    elif meta.files:
        checksums = "none (written before checkpoints carried checksums): file sizes checked only"
    elif fmt == CONVERT_FORMAT:
        checksums = "none recorded (converted before conversions carried checksums)"
    else:
        checksums = "none recorded"
    try:
        cfg = meta.model_config() if meta.model else None
    except CheckpointError as e:
        raise InspectError(str(e)) from None
    total = dir_bytes(ckpt)
    sizes = {"model": dir_bytes(ckpt / MODEL_DIR)}
    if optimizer is not None:
        sizes["optimizer"] = optimizer["bytes"]
    for part, rel in (("rl_state", RL_STATE), ("tokenizer", TOKENIZER_DIR), ("rng", RNG_DIR)):
        if (ckpt / rel).exists():
            sizes[part] = dir_bytes(ckpt / rel)
    sizes["other"] = total - sum(sizes.values())
    sizes["total"] = total
    info = {"kind": "checkpoint", "path": str(ckpt), "format": fmt, "step": meta.step,
            "weight_version": meta.weight_version, "layout": meta.layout, "dtype": meta.dtype,
            "model": dataclasses.asdict(cfg) if cfg else None, "tokenizer": meta.tokenizer, "source": meta.source,
            "parameters": sum(t["numel"] for t in tensors),
            "padded_vocab_size": next((t["shape"][0] for t in tensors
                                       if t["name"] == "embedding.word_embeddings.weight"), None),
            "tensors": tensors, "optimizer": optimizer, "size": sizes, "checksums": checksums}
    return info


def _inspect_held(ckpt: Path) -> dict:
    """`inspect_checkpoint`; a checkpoint removed by its run's retention while it was read (by a reader without a
    lease: a run directory it cannot write) is named as removed."""
    try:
        return inspect_checkpoint(ckpt)
    except Exception:
        removed = removed_line(ckpt)
        if removed is None:
            raise
        raise InspectError(removed) from None


def inspect_path(path: Path) -> dict:
    """`inspect` of a checkpoint, a run root (the latest checkpoint plus every step present) or a bare
    dist_checkpointing directory."""
    path = Path(path)
    if not path.exists():
        raise _missing(path)
    if (path / META).is_file():
        with reading(path) as ckpt:
            return _inspect_held(ckpt)
    if is_run_root(path):
        with reading(path) as shown:
            steps = list_run(path)
            latest = _latest_name(path)
            return {"kind": "run", "path": str(path), "latest": latest, "checkpoints": steps,
                    "checkpoint": _inspect_held(shown)}
    if path.is_dir() and (is_dist_checkpoint(path) or (path / "metadata.json").is_file()):
        tensors = dist_tensors(path, path.name)
        return {"kind": "dist_checkpointing", "path": str(path), "format": "torch_dist",
                "parameters": sum(t["numel"] for t in tensors), "tensors": tensors,
                "size": {"total": dir_bytes(path)}}
    raise InspectError(f"{path}: not a megatron-rl checkpoint ({META} missing) nor a run directory "
                       f"({LATEST} and step_* directories missing)")


# ---- text report -------------------------------------------------------------------------------------------------
def _table(rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return out


def _checkpoint_text(info: dict) -> list[str]:
    m = info.get("model") or {}
    lines = [f"checkpoint   {info['path']}", f"format       {info['format']}"]
    if info.get("step") is not None:
        wv = f", weight version {info['weight_version']}" if info.get("weight_version") is not None else ""
        lines.append(f"step         {info['step']}{wv}")
    layout = info.get("layout")
    lines.append("written at   " + (", ".join(f"{k}={v}" for k, v in layout.items()) if layout else "unknown layout")
                 + f"; dtype {info.get('dtype') or 'unknown'}")
    if not m and info["kind"] == "checkpoint":
        lines.append("model        shape not recorded")
    if m:
        pad = info.get("padded_vocab_size")
        lines.append(f"model        {m.get('name')}: {m.get('num_layers')} layers, hidden {m.get('hidden_size')}, "
                     f"ffn {m.get('ffn_hidden_size')}, heads {m.get('num_attention_heads')} "
                     f"(kv {m.get('num_query_groups')}), vocab {m.get('vocab_size')}"
                     + (f" (stored padded to {pad})" if pad and pad != m.get("vocab_size") else "")
                     + (", tied embeddings" if m.get("tie_word_embeddings") else "")
                     + (f", {m['num_moe_experts']} experts (top {m.get('moe_router_topk')}, ffn "
                        f"{m.get('moe_ffn_hidden_size')})" if m.get("num_moe_experts") else ""))
    lines.append(f"parameters   {info['parameters']:,} in {len(info['tensors'])} tensors")
    tok = info.get("tokenizer")
    if "tokenizer" in info:
        lines.append("tokenizer    " + (", ".join(f"{k} {v}" for k, v in tok.items()) if tok else "none recorded"))
    if info.get("source"):
        lines.append(f"converted    from {info['source']}")
    opt = info.get("optimizer")
    if opt:
        lines.append(f"optimizer    {opt['tensors']} tensors, {opt['numel']:,} elements, {human_bytes(opt['bytes'])}")
    lines.append("on disk      " + ", ".join(f"{k} {human_bytes(v)}" for k, v in info["size"].items() if v))
    if info.get("checksums"):
        lines.append(f"checksums    {info['checksums']}")
    lines.append("")
    rows = [["tensor", "global shape", "dtype", "size"]]
    for t in info["tensors"]:
        rows.append([t["name"], "[" + ", ".join(map(str, t["shape"])) + "]", t["dtype"], human_bytes(t["bytes"])])
    lines += _table(rows, right={3})
    if any(t["name"].startswith("decoder.layers.") for t in info["tensors"]):
        lines.append("(decoder.layers.* tensors are stacked over layers: the first dimension is the layer)")
    return lines


def format_text(info: dict) -> str:
    if info["kind"] == "run":
        lines = [f"run          {info['path']}",
                 f"latest       {info['latest'] or '(no latest file; showing the newest complete checkpoint)'}", ""]
        rows = [["step", "directory", "status", "size"]]
        for r in info["checkpoints"]:
            status = r["status"] + (" (latest)" if r["name"] == info["latest"] else "")
            rows.append([str(r["step"]), r["name"], status, human_bytes(r["bytes"])])
        lines += _table(rows, right={0, 3}) + [""] + _checkpoint_text(info["checkpoint"])
        return "\n".join(lines)
    if info["kind"] == "dist_checkpointing":
        info = dict(info, format="torch_dist (bare dist_checkpointing directory)")
    return "\n".join(_checkpoint_text(info))


def run(path: str | Path, as_json: bool = False, prog: str = "megatron-rl inspect") -> int:
    """Print the report (or one JSON object); 0 on success, 2 with one line on stderr for an unusable path."""
    try:
        info = inspect_path(Path(path))
    except InspectError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(info) if as_json else format_text(info))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="inspect_checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("path", help="a checkpoint directory or a run's checkpoint root")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = p.parse_args(argv)
    return run(args.path, args.json)

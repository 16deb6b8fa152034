"""The tokenizer that travels with a checkpoint.

`megatron_rl.json` records it as `"tokenizer": {"type": "hf", "path": "tokenizer"}` (Hugging Face tokenizer files
in `DIR/tokenizer/`; a relative path is relative to the checkpoint), `{"type": "byte"}` (the file-free byte
tokenizer), or `{"type": "sentencepiece", "path": ...}`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

from megatron_rl.checkpointing.inspect import resolve_checkpoint
from megatron_rl.checkpointing.layout import META, CheckpointError, CheckpointMeta, read_meta
from megatron_rl.tokenizers import ByteTokenizer, Tokenizer
from megatron_rl.tokenizers.hf import HFTokenizer
from megatron_rl.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer

# The model type of the source, beside the tokenizer files (`_keep_model_type`); not a tokenizer file itself.
MODEL_TYPE_FILE = "config.json"
# Files a Hugging Face tokenizer is made of (whichever of them a model directory has).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
                   "chat_template.json")


def save_tokenizer(src: Path, dst: Path) -> Optional[dict]:
    """Write the tokenizer of a HF model directory, a GGUF file or a sentencepiece .model into `dst` (created);
    return the `megatron_rl.json` entry, or None when a HF directory has no tokenizer files."""
    src = Path(src)
    if src.is_file() and src.suffix == ".model":  # sentencepiece
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / "tokenizer.model")
        return {"type": "sentencepiece", "path": f"{dst.name}/tokenizer.model"}
    if src.is_file() and src.suffix == ".gguf":
        dst.mkdir(parents=True, exist_ok=True)
        HFTokenizer.from_gguf(src).tok.save_pretrained(dst)  # with the file's special tokens
    else:
        found = [src / f for f in TOKENIZER_FILES if (src / f).is_file()]
        if not found:
            return None
        dst.mkdir(parents=True, exist_ok=True)
        for f in found:
            shutil.copy2(f, dst / f.name)
        _keep_model_type(src, dst)
    return {"type": "hf", "path": dst.name}


def _keep_model_type(src: Path, dst: Path) -> None:
    """Write `{"model_type": ...}` of the source's config.json beside the copied tokenizer files: transformers picks
    a tokenizer's class from the model type when `tokenizer_config.json` names only a generic one, and the class
    decides how ids decode (a Qwen2 tokenizer joins word pieces without spaces), so the checkpoint's tokenizer
    must load as the source directory's does."""
    try:
        model_type = json.loads((src / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return
    if isinstance(model_type, str):
        (dst / MODEL_TYPE_FILE).write_text(json.dumps({"model_type": model_type}))


# The one reader of the tokenizer's entry in a checkpoint's metadata (`CheckpointMeta.tokenizer`), whose form this
# module writes: {"type": "byte"} or {"type": "hf" | "sentencepiece", "path": files, relative to the checkpoint}.
def recorded_tokenizer_kind(meta: CheckpointMeta) -> Optional[str]:
    """The kind of tokenizer a checkpoint records ("byte", "hf", "sentencepiece"), None when it records none."""
    return (meta.tokenizer or {}).get("type")


def tokenizer_files(ckpt: Path, meta: CheckpointMeta) -> Optional[Path]:
    """The files (a directory or a `.model`) of the HF or sentencepiece tokenizer a checkpoint records, or None when
    it records another kind (or none)."""
    entry = meta.tokenizer or {}
    if entry.get("type") not in ("hf", "sentencepiece") or not entry.get("path"):
        return None
    p = Path(entry["path"])
    return p if p.is_absolute() else Path(ckpt) / p


def tokenizer_dir(ckpt: Path, meta: CheckpointMeta) -> Optional[Path]:
    """The directory of a checkpoint's HF tokenizer, or None when it records another kind (or none)."""
    return tokenizer_files(ckpt, meta) if recorded_tokenizer_kind(meta) == "hf" else None


def load_checkpoint_tokenizer(ckpt_dir: str | Path) -> Tokenizer:
    """The tokenizer recorded in a checkpoint's `megatron_rl.json` (a conversion or training checkpoint, or a
    run's checkpoint root, whose `latest` is used). Raises ValueError with a one-line message when the checkpoint
    records none or its files are missing."""
    ckpt = resolve_checkpoint(Path(ckpt_dir))
    try:
        meta = read_meta(ckpt, formats=None)
    except CheckpointError as e:
        raise ValueError(str(e)) from None
    entry = meta.tokenizer
    if not entry:
        raise ValueError(f"{ckpt}: {META} records no tokenizer (pass one explicitly, e.g. a HF directory or 'byte')")
    kind = recorded_tokenizer_kind(meta)
    if kind == "byte":
        return ByteTokenizer()
    if kind in ("hf", "sentencepiece"):
        p = tokenizer_files(ckpt, meta)
        if p is None:
            raise ValueError(f"{ckpt}: tokenizer entry {entry} has no path")
        if not p.exists():
            raise ValueError(f"{ckpt}: tokenizer {kind} at {p} is missing")
        return HFTokenizer(p) if kind == "hf" else SentencePieceTokenizer(p)
    raise ValueError(f"{ckpt}: unknown tokenizer type {kind!r} in {META} (expected hf, byte or sentencepiece)")

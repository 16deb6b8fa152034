"""Tokenizers: one interface over sentencepiece, Hugging Face (directory or GGUF) and a file-free byte tokenizer."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.tokenizers.base import Tokenizer
from megatron_rl.tokenizers.byte import ByteTokenizer


# What a process imports to load a Hugging Face tokenizer: transformers' tokenizer modules take about 2 s to import
# on the 2-core test machine, so a launcher whose ranks load one imports them once for all (`controller/train.py`).
HF_TOKENIZER_MODULES = ("megatron_rl.tokenizers.hf", "transformers.models.auto.tokenization_auto")


def tokenizer_kind(spec: str | Path) -> str | None:
    """What `load_tokenizer(spec)` loads, "byte", "sentencepiece" or "hf", without loading it; None for a spec it
    cannot load."""
    if str(spec) == "byte":
        return "byte"
    p = Path(spec)
    if p.is_file():
        return {".gguf": "hf", ".model": "sentencepiece"}.get(p.suffix)
    if p.is_dir():
        if (p / "tokenizer.json").exists() or (p / "tokenizer_config.json").exists():
            return "hf"
        if (p / "tokenizer.model").exists():
            return "sentencepiece"
    return None


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """"byte"; a sentencepiece `.model` file; a `.gguf` file; or a Hugging Face tokenizer directory."""
    kind, p = tokenizer_kind(spec), Path(spec)
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        from megatron_rl.tokenizers.hf import HFTokenizer

        return HFTokenizer.from_gguf(p) if p.is_file() else HFTokenizer(p)
    if kind == "sentencepiece":
        from megatron_rl.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer

        return SentencePieceTokenizer(p if p.is_file() else p / "tokenizer.model")
    raise ValueError(f"cannot load a tokenizer from {str(spec)!r}: expected 'byte', a sentencepiece .model "
                     f"file, a .gguf file, or a directory with tokenizer.json or tokenizer.model")


__all__ = ["Tokenizer", "ByteTokenizer", "load_tokenizer", "tokenizer_kind", "HF_TOKENIZER_MODULES"]

"""Tokenizers: one interface over sentencepiece, Hugging Face (directory or GGUF) and a file-free byte tokenizer."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.tokenizers.base import Tokenizer
from megatron_rl.tokenizers.byte import ByteTokenizer


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """"byte"; a sentencepiece `.model` file; a `.gguf` file; or a Hugging Face tokenizer directory."""
    if str(spec) == "byte":
        return ByteTokenizer()
    p = Path(spec)
    if p.is_file() and p.suffix == ".gguf":
        from megatron_rl.tokenizers.hf import HFTokenizer

        return HFTokenizer.from_gguf(p)
    if p.is_file() and p.suffix == ".model":
        from megatron_rl.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer

        return SentencePieceTokenizer(p)
    if p.is_dir():
        if (p / "tokenizer.json").exists() or (p / "tokenizer_config.json").exists():
            from megatron_rl.tokenizers.hf import HFTokenizer

            return HFTokenizer(p)
        if (p / "tokenizer.model").exists():
            from megatron_rl.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer

            return SentencePieceTokenizer(p / "tokenizer.model")
    raise ValueError(f"cannot load a tokenizer from {str(spec)!r}: expected 'byte', a sentencepiece .model "
                     f"file, a .gguf file, or a directory with tokenizer.json or tokenizer.model")


__all__ = ["Tokenizer", "ByteTokenizer", "load_tokenizer"]

"""File formats read without their libraries, below every component that reads them: `gguf.py`, a GGUF file's
header, metadata and tensors (the checkpoint conversion and the tokenizer of a GGUF file both read it)."""

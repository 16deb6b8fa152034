"""Checkpoint conversion: Hugging Face Llama, Qwen2/2.5, Qwen3, Mistral, Qwen3-MoE or Mixtral (a directory; Llama
also GGUF) <-> Megatron-Core distributed checkpoint (the families and what is refused: `megatron_rl.models.families`).

The Megatron side is a standard `dist_checkpointing` (torch_dist) checkpoint of a local-spec GPTModel in `DST/model/`,
so it loads at any TP/PP/DP (and EP) (`dist_checkpointing.load(model.sharded_state_dict(), DST/model)`);
`DST/megatron_rl.json` records the model shape, the layout it was written with and the tokenizer, whose files go to
`DST/tokenizer/`. The HF side is `config.json` plus safetensors shards with an index (and the tokenizer files, when
the checkpoint has them). Tensors are renamed and re-laid out exactly (QKV and its bias interleaved per KV group,
fc1 = [gate; up]), so HF -> Megatron -> HF reproduces every tensor bit for bit.

Mixture-of-experts layers (Qwen3-MoE, Mixtral): the router is `decoder.layers.mlp.router.weight` [layers, experts,
hidden], stacked over layers like every layer tensor; the experts are stored as Megatron-Core's SequentialMLP
writes them, under `decoder.layers.mlp.experts.experts.linear_fc1.weight` [layers, experts, 2 x moe_ffn, hidden]
(each expert's [gate; up], HF's gate_proj / up_proj or w1 / w3) and `...linear_fc2.weight` [layers, experts,
hidden, moe_ffn] (down_proj or w2), along a global expert axis: EP rank r writes its experts at their global
indices, so a checkpoint written at any EP (and expert-TP) loads at any other. `--ep N` writes with N times the
processes, each holding 1/N of the experts (EP over N DP ranks, as a trainer lays them out); the non-expert weights
those extra ranks replicate are filled and written by DP rank 0 only. In the HF files each expert is its own tensor
(`param_spec`'s names: `model.layers.{i}.mlp.experts.{j}.gate_proj.weight`, `...block_sparse_moe.experts.{j}.w1...`).

Both directions stream; neither holds two copies of the model (measured in docs/benchmarks.md):
- HF -> Megatron: `tp * pp * ep` local processes each build only their shard of the GPTModel (initializers
  skipped) and fill every parameter straight from the rows and columns of the safetensors tensors it is made of
  (an expert's: only this rank's experts), read lazily (`safetensors.safe_open(...).get_slice`) in pieces of at
  most READ_BYTES; then torch_dist files written by threads of each rank (`background.write_now`).
  The HF state dict is never built. A GGUF file is first dequantized tensor by tensor into a temporary
  safetensors file in Hugging Face names (`hf_sources.gguf_to_safetensors`, without transformers), read the same way.
- Megatron -> HF: no model is built. Each layer's tensors are read from the torch_dist files as slices of the
  stacked `decoder.layers.*` tensors (torch.distributed.checkpoint with a slice planner, no process group; a
  layer's experts in one box of the expert-stacked tensors), converted, and appended to safetensors shards whose
  headers were written up front (every name, dtype and shape follows from the model shape). One layer is in
  memory at a time.
A training checkpoint (format "megatron-rl/train", or a run root: its `latest`) converts to HF the same way, since
its `model/` is the same kind of directory.

Here: `convert`, the command, which checks its source and destination before any work; each direction in its own
module (`hf_to_megatron.py`, `megatron_to_hf.py`), the destination's checks (what --overwrite may replace) and the
memory accounting in `destination.py`; what a source holds before any weight is read (its kind, a HF directory's
shape and tensor files, a GGUF header, the GGUF dequantization) is `hf_sources.py`'s.
"""

from __future__ import annotations

from pathlib import Path

from megatron_rl.checkpointing.destination import check_destination
from megatron_rl.checkpointing.hf_sources import detect_format
from megatron_rl.checkpointing.hf_to_megatron import hf_to_megatron_checkpoint
from megatron_rl.checkpointing.layout import CONVERT_FORMAT, TRAIN_FORMAT, ConversionError
from megatron_rl.checkpointing.megatron_to_hf import SHARD_BYTES, megatron_to_hf_checkpoint


def convert(src: Path, dst: Path, to: str, dtype: str = "float32", overwrite: bool = False, tp: int = 1,
            pp: int = 1, shard_bytes: int = SHARD_BYTES, ep: int = 1) -> dict:
    """`megatron-rl convert`: `src` (HF directory, GGUF file, or megatron-rl checkpoint) into `dst` in the format
    `to` ("megatron" or "hf"); tp / pp / ep: the layout that writes a Megatron checkpoint (any loads it)."""
    src, dst = Path(src), Path(dst)
    if to not in ("megatron", "hf"):
        raise ConversionError(f"--to must be megatron or hf, got {to!r}")
    if not src.exists():
        raise ConversionError(f"{src}: does not exist")
    fmt = detect_format(src)
    if dst.resolve() == src.resolve():
        raise ConversionError(f"{dst}: the destination is the source")
    check_destination(dst, overwrite)  # before any work: what --overwrite may delete
    if to == "megatron":
        if fmt == "megatron":
            raise ConversionError(f"{src} is already a megatron-rl checkpoint")
        return hf_to_megatron_checkpoint(src, dst, dtype=dtype, overwrite=overwrite, tp=tp, pp=pp, ep=ep)
    if fmt != "megatron":
        raise ConversionError(f"{src} is a {fmt} source; --to hf converts megatron-rl checkpoints "
                              f"({CONVERT_FORMAT} or {TRAIN_FORMAT})")
    if (tp, pp, ep) != (1, 1, 1):
        raise ConversionError("--tp/--pp/--ep apply to --to megatron (reading a Megatron checkpoint needs no layout)")
    return megatron_to_hf_checkpoint(src, dst, overwrite=overwrite, shard_bytes=shard_bytes)

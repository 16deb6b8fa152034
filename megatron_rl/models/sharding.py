"""Where each parameter of a parallel GPTModel sits in the logical (TP=1, PP=1) model.

Megatron-Core marks tensor-parallel parameters with `tensor_model_parallel`, `partition_dim` and
`partition_stride` (the SwiGLU `linear_fc1` has stride 2: each TP rank holds `[gate_shard; up_shard]`), and every
transformer layer knows its global `layer_number`. From those we derive, for each local parameter, its canonical
name in the unsharded model and the slice of the full tensor it holds. Vocabulary rows are special: the logical
tensor has `vocab_size` rows, the local one a slice of the TP-dependent padded vocabulary (padding rows are 0).

Used to load and gather full state dicts (tests, conversion) and as the descriptor source for DDMA.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_rl.models.param_spec import expert_prefix, local_expert
from megatron_rl.models.presets import ModelConfig

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class ParamShard:
    """One local parameter and the part of the logical tensor it holds."""

    local_name: str
    global_name: str  # name in the TP=1, PP=1 model (global layer index)
    full_shape: tuple[int, ...]  # logical shape; vocabulary rows unpadded
    partition_dim: Optional[int]  # None: replicated over TP
    partition_stride: int
    tp_rank: int
    tp_size: int
    is_vocab: bool
    tied_copy: bool  # the last stage's copy of tied embeddings (same logical tensor as the embedding)
    is_expert: bool = False  # an expert's weight: `tp_rank`, `tp_size` are the expert-TP group's

    def slice_of(self, full: torch.Tensor, padded_rows: Optional[int] = None) -> torch.Tensor:
        """This rank's shard of `full` (the logical tensor), padded with zero rows for the vocabulary."""
        if self.is_vocab:
            if padded_rows is None:
                raise ValueError(f"{self.global_name}: padded_rows is needed for vocabulary tensors")
            pad = padded_rows - full.shape[0]
            if pad < 0:
                raise ValueError(f"{self.global_name}: {full.shape[0]} rows do not fit in {padded_rows}")
            full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])], dim=0)
        if self.partition_dim is None:
            return full
        return _strided_chunk(full, self.partition_dim, self.partition_stride, self.tp_size, self.tp_rank)

    def row_segments(self, local_rows: int) -> list[tuple[int, int, int]]:
        """(first local row, first logical row, rows) of this shard along dimension 0 (vocabulary rows past the
        logical size are padding, so segments may run past it)."""
        if self.partition_dim != 0:
            return [(0, 0, local_rows)]
        chunk = local_rows // self.partition_stride
        return [(s * chunk, (s * self.tp_size + self.tp_rank) * chunk, chunk) for s in range(self.partition_stride)]

    def col_range(self, local_cols: int) -> Optional[tuple[int, int]]:
        """The logical columns this shard holds (None: all of them)."""
        if self.partition_dim != 1:
            return None
        if self.partition_stride != 1:
            raise ValueError(f"{self.global_name}: column partition with stride {self.partition_stride}")
        return self.tp_rank * local_cols, (self.tp_rank + 1) * local_cols


def _strided_chunk(t: torch.Tensor, dim: int, stride: int, parts: int, index: int) -> torch.Tensor:
    """Megatron's strided partition: the dim is [stride, parts, chunk]; part `index` takes [:, index, :]."""
    size = t.shape[dim]
    if size % (stride * parts):
        raise ValueError(f"dimension of size {size} does not split into stride {stride} x {parts} parts")
    chunk = size // (stride * parts)
    pieces = [t.narrow(dim, (s * parts + index) * chunk, chunk) for s in range(stride)]
    return torch.cat(pieces, dim=dim) if stride > 1 else pieces[0]


def describe_params(model: torch.nn.Module, cfg: ModelConfig, tp_rank: int, tp_size: int) -> list[ParamShard]:
    """Descriptors of every parameter of one model chunk (a GPTModel stage)."""
    layer_numbers, first_expert, expert_tp = {}, {}, (tp_rank, tp_size)
    decoder = getattr(model, "decoder", None)
    if decoder is not None:
        for i, layer in enumerate(decoder.layers):
            layer_numbers[i] = layer.layer_number - 1
            # A mixture of experts: local expert j is global expert offset + j (expert parallelism), and its
            # weights are split over the expert-TP group (`ParallelLayout.etp`), not necessarily TP.
            first_expert[i] = getattr(layer.mlp, "local_expert_indices", [0])[0]
            if hasattr(layer.mlp, "experts"):
                expert_tp = (layer.mlp.experts.tp_group.rank(), layer.mlp.experts.tp_group.size())
    out = []
    for name, p in model.named_parameters():
        global_name = name
        m = _LAYER.match(name)
        rank, size, expert = tp_rank, tp_size, False
        if m:
            rest = name[m.end():]
            e = local_expert(rest)
            if e:
                expert = True
                rest = expert_prefix(first_expert[int(m.group(1))] + e[0]) + e[1]
                rank, size = expert_tp
            global_name = f"decoder.layers.{layer_numbers[int(m.group(1))]}." + rest
        is_vocab = name in VOCAB_PARAMS
        tied_copy = name == "output_layer.weight" and cfg.tie_word_embeddings
        if tied_copy:
            global_name = "embedding.word_embeddings.weight"
        sharded = bool(getattr(p, "tensor_model_parallel", False))
        dim = getattr(p, "partition_dim", None) if sharded else None
        stride = getattr(p, "partition_stride", 1) if sharded else 1
        shape = list(p.shape)
        if dim is not None:
            shape[dim] *= size
        if is_vocab:
            shape[0] = cfg.vocab_size
        out.append(ParamShard(name, global_name, tuple(shape), dim, stride, rank, size, is_vocab, tied_copy,
                              is_expert=expert))
    return out


@torch.no_grad()
def load_full_state_dict(model: torch.nn.Module, full: dict[str, torch.Tensor], cfg: ModelConfig, pgs) -> None:
    """Copy this rank's slices of a logical state dict into a parallel model (padding rows set to 0)."""
    tp_rank, tp_size = pgs.tp.rank(), pgs.tp.size()
    params = dict(model.named_parameters())
    for d in describe_params(model, cfg, tp_rank, tp_size):
        if d.global_name not in full:
            raise KeyError(f"state dict has no {d.global_name!r} (for local parameter {d.local_name!r})")
        p = params[d.local_name]
        src = full[d.global_name]
        if tuple(src.shape) != d.full_shape:
            raise ValueError(f"{d.global_name}: expected shape {d.full_shape}, got {tuple(src.shape)}")
        padded = p.shape[0] * tp_size if d.is_vocab else None
        p.copy_(d.slice_of(src.to(p.dtype), padded))


def model_sharded_state_dict(model: torch.nn.Module, dp_cp_group) -> dict:
    """`model.sharded_state_dict()` for `dist_checkpointing` save and load, with the executor's own DP group.

    Megatron-Core's `LanguageModule.tie_embeddings_and_output_weights_state_dict` (tied embeddings on a last
    pipeline stage that is not the first: Qwen2.5-0.5B or SmolLM2 at PP > 1) reads the DP rank from the global
    `parallel_state`, which our executors never initialize (each has its own process groups), and fails with "data
    parallel group with context parallel combined is not initialized". While the dict is built, that one call
    answers from `dp_cp_group`."""
    from megatron.core import parallel_state

    original = parallel_state.get_data_parallel_rank
    parallel_state.get_data_parallel_rank = lambda *args, **kwargs: dp_cp_group.rank()
    try:
        sharded = model.sharded_state_dict(metadata={"dp_cp_group": dp_cp_group})
    finally:
        parallel_state.get_data_parallel_rank = original
    merge_in_place(sharded)
    return sharded


def merge_in_place(sharded_state_dict: dict) -> None:
    """Let each ShardedTensorFactory of `sharded_state_dict` (SwiGLU's `linear_fc1`: its gate and up halves saved
    as two tensors) skip its merge after a load that wrote into the tensor itself.

    A load reads a factory's pieces into views of the tensor it was built from (`build_fn` chunks the parameter),
    and then Megatron-Core's `merge_fn` concatenates them into a new tensor, which `load_state_dict` copies back
    into the same parameter: every fc1 weight of the stage allocated again at once (on a GPU, 3.9 GB a rank for the
    405B recipe's trainer, computed in docs/benchmarks.md) and two passes over it (0.06-0.19 s a rank in a SmolLM2
    resume on a 2-core CPU). When every loaded piece is still exactly a view `build_fn` makes of the tensor (same
    address, shape, strides and dtype) and together they hold all its elements, the tensor already holds what the
    merge would build (a factory's merge is its build's inverse): the merge returns the tensor itself, and
    `load_state_dict`'s copy of a tensor onto itself is skipped by torch. Any other load (a piece read elsewhere)
    merges as Megatron-Core does."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    def in_place(factory):
        merge = factory.merge_fn

        def merge_fn(loaded):
            tensor = factory.data
            built = list(nested_values(factory.build())) if isinstance(tensor, torch.Tensor) else []
            got = list(nested_values(loaded))
            if (built and len(got) == len(built)
                    and all(isinstance(b, ShardedTensor) and _same_view(g, b.data) for g, b in zip(got, built))
                    and sum(b.data.numel() for b in built) == tensor.numel()):
                return tensor.detach()
            return merge(loaded)
        return merge_fn

    for factory in nested_values(sharded_state_dict):
        if isinstance(factory, ShardedTensorFactory):
            factory.merge_fn = in_place(factory)


def _same_view(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.stride() == b.stride())

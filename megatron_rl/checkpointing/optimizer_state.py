"""The distributed optimizer's state in model space, written by every rank in pieces: no gather, any layout.

Megatron-Core's distributed optimizer splits each model-parallel shard's flat parameter buffer over its DP group:
a DP rank owns a contiguous range of every bucket, which cuts parameters anywhere (mid-row). Megatron-Core 0.16
offers two ways to checkpoint that state, and neither is what a 405B run needs:

- `fully_reshardable` (model space: one tensor per parameter, the same keys and shapes as the model) gathers the
  state of a whole DP group onto its rank 0 before writing: that rank's host memory grows with DP (43 GB of fp32
  weights and Adam moments per DP-rank-0 for `configs/llama3-405b.yaml`) while the others wait.
- `dp_reshardable` writes each rank's flat bucket range as it is, without a gather, but the buckets are an
  internal layout: it loads only at the same TP and PP.
- `fully_sharded_model_space` (no gather, model space) relied on `ShardedTensor.flattened_range`, which 0.16
  refuses.

This module writes the `fully_reshardable` form without its gather. A DP rank's range of a parameter is a range
of that parameter's flattened local shard; a row-major range of an N-d block is a union of at most 2N-1 boxes,
each contiguous in memory. Each box becomes one ShardedTensor of the model-space tensor
(`optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`, the global shape of the model's own key) at its own
offset: uneven chunks, which Megatron-Core passes to torch DCP as they are (`axis_fragmentations=None`). So:

- every rank writes only the state it owns, from views of the optimizer's own tensors (no copy, no buffer);
- the checkpoint holds the same keys, shapes and values as a `fully_reshardable` one, and DCP reads any region of
  a tensor from whichever chunks cover it, so a load at any TP/PP/DP reads each rank's own range, and
  checkpoints written in the old format load through the same code;
- parameters whose model sharding is a factory (SwiGLU's `linear_fc1`, two halves sharded separately) are mapped
  through the factory itself: it is applied to the parameter's local flat indices, so each piece of the global
  tensor says which local elements it holds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import torch

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")  # fp32 main weights, Adam moments: Megatron-Core's own names
PREFIX = "optimizer.state"
FORMAT = "model_space_pieces"  # recorded in megatron_rl.json; checkpoints without it used "fully_reshardable"


def boxes(shape: tuple[int, ...], start: int, end: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The boxes covering the row-major flat range [start, end) of a tensor of `shape`: (offset, size, flat start)
    each, in order, every box contiguous in row-major order (so a flat range of a contiguous tensor views it).
    At most 2 * len(shape) - 1 boxes: a partial leading row, a block of whole rows, a partial trailing row, the
    partial rows recursively."""
    if start >= end:
        return
    if len(shape) == 1:
        yield (start,), (end - start,), start
        return
    inner = math.prod(shape[1:])
    zeros = (0,) * (len(shape) - 1)
    row, pos = divmod(start, inner)
    if pos:  # a partial first row
        stop = min(end, (row + 1) * inner)
        for off, size, flat in boxes(shape[1:], pos, stop - row * inner):
            yield (row, *off), (1, *size), row * inner + flat
        row, start = row + 1, stop
    whole = end // inner
    if whole > row and start < end:  # whole rows
        yield (row, *zeros), (whole - row, *shape[1:]), row * inner
        start = whole * inner
    if start < end:  # a partial last row
        for off, size, flat in boxes(shape[1:], 0, end - whole * inner):
            yield (whole, *off), (1, *size), whole * inner + flat


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One model-space tensor's part of a parameter's local shard: the elements [base, base + numel) of the local
    shard (flat), which sit at `sharded`'s place in the global tensor."""

    sharded: object  # megatron.core.dist_checkpointing.ShardedTensor (data: a meta tensor; only its metadata is used)
    base: int


def _pieces(meta) -> list[_Piece]:
    """The model-space tensors a parameter's local shard maps to (one, or one per factory output). A factory is
    applied to a meta tensor of the local shape: each output is a view of it, whose storage offset is where its
    elements start in the local shard (no memory, no copy)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    local = torch.empty(meta.data.shape, dtype=meta.data.dtype, device="meta")
    if not isinstance(meta, ShardedTensorFactory):
        return [_Piece(dataclasses.replace(meta, data=local), 0)]
    pieces = []
    for sh in nested_values(meta.build_fn(meta.key, local, meta.replica_id, None)):
        if sh.data._base is not local or not sh.data.is_contiguous():
            raise NotImplementedError(f"{sh.key}: the model's sharding of this parameter is not a contiguous "
                                      f"range of its local shard; its optimizer state cannot be saved in pieces")
        pieces.append(_Piece(sh, sh.data.storage_offset()))
    return pieces


def _owned_ranges(opt) -> Iterator[tuple[torch.nn.Parameter, int, int]]:
    """(model parameter, start, end): the flat range of each local parameter shard this DP rank's optimizer
    owns, in Megatron-Core's order."""
    for gbuf_range_maps in opt.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for bucket in per_bucket:
                for param, ranges in bucket["param_map"].items():
                    yield param, ranges["param"].start, ranges["param"].end


def _state_views(opt, param) -> dict[str, torch.Tensor]:
    """The optimizer's live tensors for the owned range of `param`: fp32 main weights and Adam moments (1-d)."""
    group_index, group_order = opt.model_param_group_index_map[param]
    main = opt.optimizer.param_groups[group_index]["params"][group_order]
    state = opt.optimizer.state[main]
    return {"param": main, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}


def sharded_param_state(opt, model_sharded_state_dict: dict) -> dict[str, list]:
    """This rank's optimizer state as model-space ShardedTensors, {state key: [ShardedTensor, ...]}: views of the
    live tensors, so the same dict serves a save (written from them) and a load (read into them, then `apply`).
    Needs the optimizer's state allocated (after a step, or Megatron-Core's dummy init)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    if getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
        raise NotImplementedError("the precision-aware optimizer's scaled state is not saved in pieces")
    tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    meta_of = {sh.data: sh for sh in nested_values(tensors) if isinstance(sh, (ShardedTensor, ShardedTensorFactory))}
    instance = getattr(opt, "distributed_optimizer_instance_id", 0)
    out: dict[str, list] = {k: [] for k in STATE_KEYS}
    for param, start, end in _owned_ranges(opt):
        meta = meta_of.get(param)
        if meta is None:
            raise ValueError("a parameter of the optimizer is missing from the model's sharded state dict")
        views = _state_views(opt, param)
        # Each DP rank owns a distinct range: the DP coordinate of the replica id is the optimizer instance's.
        replica = (*meta.replica_id[:2], instance) if isinstance(meta.replica_id, tuple) else meta.replica_id
        for sh, offset, shape, at in range_boxes(meta, start, end):
            n = math.prod(shape)
            for k in STATE_KEYS:
                data = views[k][at: at + n].view(shape)
                out[k].append(ShardedTensor(
                    f"{PREFIX}.{k}.{sh.key}", data, data.dtype, shape, tuple(sh.global_shape), offset,
                    None, replica, allow_shape_mismatch=sh.allow_shape_mismatch))
    return out


def range_boxes(meta, start: int, end: int) -> Iterator[tuple[object, tuple[int, ...], tuple[int, ...], int]]:
    """The model-space boxes of the flat range [start, end) of a parameter's local shard, whose model sharding is
    `meta` (a ShardedTensor or factory): (the model ShardedTensor the box lies in, the box's global offset, its
    shape, where it starts in the range), in order. What `sharded_param_state` writes, and `resume-check`
    rehearses on meta-device stages."""
    for piece in _pieces(meta):
        sh = piece.sharded
        lo, hi = max(start, piece.base), min(end, piece.base + sh.data.numel())
        pre = sh.prepend_axis_num
        for off, size, flat in boxes(tuple(sh.local_shape), lo - piece.base, hi - piece.base):
            offset = (*sh.global_offset[:pre], *(g + o for g, o in zip(sh.global_offset[pre:], off)))
            # Prepended axes (the layer index) become axes of size 1: DCP's uneven chunks have no prepending.
            yield sh, offset, (1,) * pre + tuple(size), piece.base + flat - start


def apply(state: dict[str, list], loaded: dict[str, list]) -> None:
    """Copy what a load returned into the live tensors the sharded dict views (a no-op where the load already
    wrote into them)."""
    for k, shards in state.items():
        for sh, got in zip(shards, loaded[k]):
            if got.data_ptr() != sh.data.data_ptr():
                sh.data.copy_(got)

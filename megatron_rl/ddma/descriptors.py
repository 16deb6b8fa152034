"""Where every parameter of a GPTModel lives in a parallel layout, computed from the config alone.

DDMA has to plan transfers between two executors before (and independently of) either model existing on a given
rank: a trainer rank does not build the generator's model, yet it must know which slices each generator rank
wants. So the layout of every parameter is derived here as a pure function of the model shape and the
`ParallelLayout`. Each parameter's name, shape and tensor-parallel split is `models.param_spec`'s table (the one
the Hugging Face conversion reads); from it and Megatron-Core's conventions for the local layer spec that
`build_gpt_model` uses:

- the logical (TP=1, PP=1) model has canonical names with global layer indices (`decoder.layers.{i}.*`);
- tensor-parallel weights are split along `partition_dim` with `partition_stride` blocks per rank (SwiGLU's
  `linear_fc1` is stride 2: each rank holds `[gate_shard; up_shard]`); QKV rows are grouped per query group, so a
  contiguous split hands each rank whole groups (hence TP must divide the group count); the QKV bias (Qwen2) is
  split the same way, and the per-head q/k norm weights (Qwen3) are replicated over TP;
- vocabulary tensors are padded to a multiple of `make_vocab_size_divisible_by * tp` rows; the padding is never a
  real token and depends on TP, so the logical tensor keeps `vocab_size` rows;
- pipeline stages take an even, contiguous share of the layers; the first stage holds the embedding, the last the
  final norm and the output layer. With tied embeddings and PP>1 the last stage holds its own copy of the embedding
  (Megatron's `output_layer.weight`, kept equal by the embedding group), which a sync must fill too;
- a mixture of experts' router is replicated like a norm; its experts are laid out by Megatron-Core's expert grid
  (`ParallelLayout.expert_coords`): the rank at EP rank e holds the global experts [e E/ep, (e+1) E/ep) as
  local experts 0.. (`param_spec.LOCAL_EXPERTS`; so the same local name means a different expert on another EP
  rank), each expert's `linear_fc1` / `linear_fc2` split over the expert-TP group (`etp` ranks) as the dense MLP's
  are over TP, and the expert-data-parallel ranks (those with the same expert coordinates) hold copies. Which
  experts a rank holds depends on its DP rank as well as its TP rank when EP runs over DP (a trainer's), so
  `stage_params` takes both.

`tests/test_ddma_descriptors.py` checks all of this against `describe_params` on real models.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from megatron_rl.models.param_spec import EMBEDDING, FINAL_NORM, OUTPUT, expert_prefix, layer_params, model_params
from megatron_rl.models.presets import ModelConfig, pad_vocab
from megatron_rl.parallel.layout import ParallelLayout, layout_problems


@dataclass(frozen=True)
class ModelShape:
    """The fields of a ModelConfig that decide parameter names and shapes (`param_spec.DecoderShape`), hashable so
    plans can be cached."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    tie_word_embeddings: bool
    make_vocab_size_divisible_by: int
    kv_channels: int
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    family: str = "llama"
    num_moe_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None

    @classmethod
    def of(cls, cfg: "ModelConfig | ModelShape") -> "ModelShape":
        if isinstance(cfg, ModelShape):
            return cfg
        return cls(cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads,
                   cfg.num_query_groups, cfg.vocab_size, cfg.tie_word_embeddings, cfg.make_vocab_size_divisible_by,
                   cfg.kv_channels, cfg.add_qkv_bias, cfg.qk_layernorm, cfg.family, cfg.num_moe_experts,
                   cfg.moe_ffn_hidden_size)

    def padded_vocab_size(self, tp: int) -> int:
        return pad_vocab(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    def architecture(self) -> tuple:
        """Everything but the vocabulary padding rule, which may differ between executors."""
        return dataclasses.astuple(dataclasses.replace(self, make_vocab_size_divisible_by=1))


@dataclass(frozen=True)
class LogicalParam:
    """A parameter of the logical (TP=1, PP=1) model."""

    name: str
    shape: tuple[int, ...]  # vocabulary rows unpadded
    partition_dim: Optional[int]  # None: replicated over TP
    partition_stride: int = 1
    is_vocab: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class LocalParam:
    """A parameter as one rank of an executor holds it."""

    local_name: str  # name in this rank's GPTModel stage (local layer index)
    param: LogicalParam
    tp_rank: int
    tp_size: int
    padded_rows: Optional[int]  # padded vocabulary rows over all TP ranks (vocabulary tensors only)
    tied_copy: bool = False  # the last stage's copy of tied embeddings

    @property
    def global_name(self) -> str:
        return self.param.name

    @property
    def partitioned_extent(self) -> int:
        """Extent of the partition dim in the (padded) full tensor."""
        p = self.param
        return self.padded_rows if p.is_vocab else p.shape[p.partition_dim]

    @property
    def local_shape(self) -> tuple[int, ...]:
        p = self.param
        shape = list(p.shape)
        if p.partition_dim is not None:
            shape[p.partition_dim] = self.partitioned_extent // self.tp_size
        return tuple(shape)

    def blocks(self) -> tuple[tuple[int, int, int], ...]:
        """Along the partition dim: (full_start, full_stop, local_start) of each contiguous block this rank holds.

        Megatron's strided split views the dim as [stride, tp, chunk]: rank t holds blocks (s, t) for every s,
        stored one after the other. Coordinates are in the padded full tensor (vocabulary rows >= vocab_size are
        padding); a replicated parameter is one block along dim 0 covering everything.
        """
        p = self.param
        if p.partition_dim is None:
            return ((0, p.shape[0], 0),)
        stride = p.partition_stride
        chunk = self.partitioned_extent // (stride * self.tp_size)
        return tuple(((s * self.tp_size + self.tp_rank) * chunk, (s * self.tp_size + self.tp_rank + 1) * chunk,
                      s * chunk) for s in range(stride))


# How `check_layout` words each model dimension of `parallel.layout.SPLIT_DIMS` (filled with its value).
_DIM_WORDS = {"num_attention_heads": "the attention heads ({})", "num_query_groups": "the query groups ({})",
              "ffn_hidden_size": "the FFN hidden size ({})", "num_layers": "the {} layers",
              "moe_ffn_hidden_size": "the experts' FFN hidden size ({})", "num_moe_experts": "the {} experts"}


def check_layout(cfg: "ModelConfig | ModelShape", layout: ParallelLayout, role: str = "executor") -> None:
    """Raise ValueError (one line) if `layout` cannot hold this model (`parallel.layout.layout_problems`, and query
    groups that do not divide the heads), before any process group or transfer: sizes below 1, a TP/PP/EP/ETP that
    does not divide what it splits, EP or ETP on a dense model, an expert grid (etp x ep) that does not tile a
    stage's tp x dp ranks."""
    m = ModelShape.of(cfg)
    problems = []
    if m.num_attention_heads % m.num_query_groups:
        problems.append(f"{m.num_attention_heads} heads are not divisible by {m.num_query_groups} query groups")
    for p in layout_problems(m, layout):
        if p.field == "tp x dp":  # the expert grid
            problems.append(layout.expert_grid_problem())
        else:
            problems.append(str(p) if p.field in (None, "dense")
                            else f"{p.dim}={p.size} does not divide {_DIM_WORDS[p.field].format(p.count)}")
    if problems:
        raise ValueError(f"{role} layout {layout} cannot hold the model: " + "; ".join(problems))


def check_same_architecture(src: "ModelConfig | ModelShape", dst: "ModelConfig | ModelShape") -> None:
    """Trainer and generator must be the same network; only the vocabulary padding rule may differ."""
    a, b = ModelShape.of(src), ModelShape.of(dst)
    if a.architecture() != b.architecture():
        diffs = [f"{f.name} {getattr(a, f.name)} vs {getattr(b, f.name)}" for f in dataclasses.fields(a)
                 if f.name != "make_vocab_size_divisible_by" and getattr(a, f.name) != getattr(b, f.name)]
        raise ValueError("trainer and generator models differ: " + ", ".join(diffs))


def layer_range(cfg: "ModelConfig | ModelShape", pp: int, pp_rank: int) -> range:
    """Global indices of the layers pipeline stage `pp_rank` of `pp` holds (Megatron's even split)."""
    m = ModelShape.of(cfg)
    if m.num_layers % pp:
        raise ValueError(f"pp={pp} does not divide the {m.num_layers} layers")
    per = m.num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def logical_params(cfg: "ModelConfig | ModelShape") -> tuple[LogicalParam, ...]:
    """Every parameter of the logical model (tied embeddings appear once), in a fixed canonical order."""
    return _logical_params(ModelShape.of(cfg))


@lru_cache(maxsize=64)
def _logical_params(m: ModelShape) -> tuple[LogicalParam, ...]:
    return tuple(LogicalParam(p.name, p.shape, p.partition_dim, p.partition_stride, p.is_vocab)
                 for p in model_params(m))


@lru_cache(maxsize=256)
def _stage_params(m: ModelShape, layout: ParallelLayout, pp_rank: int, tp_rank: int,
                  expert_coords: tuple[int, int] = (0, 0)) -> tuple[LocalParam, ...]:
    check_layout(m, layout)
    by_name = {p.name: p for p in logical_params(m)}
    padded = m.padded_vocab_size(layout.tp)
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    etp_rank, ep_rank = expert_coords
    per_rank = (m.num_moe_experts or 0) // layout.ep  # experts an EP rank holds: [ep_rank * per_rank, ...)

    def local(local_name: str, global_name: str, tied_copy: bool = False) -> LocalParam:
        p = by_name[global_name]
        return LocalParam(local_name, p, tp_rank, layout.tp, padded if p.is_vocab else None, tied_copy)

    out = []
    if first:
        out.append(local(EMBEDDING, EMBEDDING))
    layer = layer_params(m)
    for j, i in enumerate(layer_range(m, layout.pp, pp_rank)):
        for p in layer:
            if p.expert is None:
                out.append(local(f"decoder.layers.{j}.{p.name}", f"decoder.layers.{i}.{p.name}"))
            elif p.expert // per_rank == ep_rank:  # this rank's share of the experts, split over expert TP
                name = p.name.replace(expert_prefix(p.expert), expert_prefix(p.expert - ep_rank * per_rank))
                out.append(LocalParam(f"decoder.layers.{j}.{name}", by_name[f"decoder.layers.{i}.{p.name}"],
                                      etp_rank, layout.etp, None))
    if last:
        out.append(local(FINAL_NORM, FINAL_NORM))
        if not m.tie_word_embeddings:
            out.append(local(OUTPUT, OUTPUT))
        elif not first:
            out.append(local(OUTPUT, EMBEDDING, tied_copy=True))
    return tuple(out)


def stage_params(cfg: "ModelConfig | ModelShape", layout: ParallelLayout, pp_rank: int,
                 tp_rank: int, dp_rank: int = 0) -> tuple[LocalParam, ...]:
    """The parameters of the GPTModel stage at (pp_rank, tp_rank) of `layout`, in registration order; a mixture of
    experts holds the experts of its place in the expert grid, which depends on `dp_rank` too
    (`ParallelLayout.expert_coords`: EP rank e holds experts [e E/ep, (e+1) E/ep) as local experts 0.., each
    split over the expert-TP group)."""
    if not (0 <= pp_rank < layout.pp and 0 <= tp_rank < layout.tp and 0 <= dp_rank < layout.dp):
        raise ValueError(f"(pp_rank={pp_rank}, tp_rank={tp_rank}, dp_rank={dp_rank}) is outside layout {layout}")
    m = ModelShape.of(cfg)
    coords = layout.expert_coords(tp_rank, dp_rank) if m.num_moe_experts else (0, 0)
    return _stage_params(m, layout, pp_rank, tp_rank, coords)


def rank_params(cfg: "ModelConfig | ModelShape", layout: ParallelLayout, local_rank: int) -> tuple[LocalParam, ...]:
    """The parameters held by one rank of an executor (DP replicas hold the same ones, but for their experts)."""
    tp_rank, pp_rank, dp_rank = layout.coords(local_rank)
    return stage_params(cfg, layout, pp_rank, tp_rank, dp_rank)

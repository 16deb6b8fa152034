"""Every parameter of a decoder written down once: its Megatron name, the Hugging Face tensors it is made of, its
full shape and how tensor parallelism splits it, as a pure function of the model's shape.

The Hugging Face mapping (`hf_mapping`: names, shapes, conversions, the rows a rank reads), DDMA's descriptors
(`ddma.descriptors`) and the parameter count (`ModelConfig.num_parameters`) are all read from this table, so a new
kind of layer (a family's feature, a mixture of experts) is added here and nowhere else.

One transformer layer (`layer_params`), in the order Megatron-Core's local layer spec registers its parameters
(h hidden, f FFN, d head size, g query groups, q = heads x d, kv = g x d):

| Megatron (`decoder.layers.{i}.`)        | HF (`model.layers.{i}.`)              | shape      | TP split           |
| --------------------------------------- | ------------------------------------- | ---------- | ------------------ |
| `input_layernorm.weight`                | `input_layernorm.weight`              | [h]        | replicated         |
| `self_attention.linear_proj.weight`     | `self_attn.o_proj.weight`             | [h, q]     | columns            |
| `self_attention.linear_qkv.weight`      | `self_attn.{q,k,v}_proj.weight`       | [q+2kv, h] | rows, whole groups |
| `self_attention.linear_qkv.bias`        | `self_attn.{q,k,v}_proj.bias` (qwen2) | [q+2kv]    | rows, whole groups |
| `self_attention.{q,k}_layernorm.weight` | `self_attn.{q,k}_norm.weight` (qwen3) | [d]        | replicated         |
| `pre_mlp_layernorm.weight`              | `post_attention_layernorm.weight`     | [h]        | replicated         |
| `mlp.linear_fc1.weight`                 | `mlp.{gate,up}_proj.weight`           | [2f, h]    | rows, stride 2     |
| `mlp.linear_fc2.weight`                 | `mlp.down_proj.weight`                | [h, f]     | columns            |

A mixture-of-experts layer (`num_moe_experts` E, expert width F = `moe_ffn_hidden_size`) has, in place of the two
MLP rows, Megatron-Core's router and one SwiGLU MLP per expert (its `SequentialMLP`; HF names per family,
`families.ExpertNames`, here Qwen3-MoE's):

| Megatron (`decoder.layers.{i}.`)                  | HF (`model.layers.{i}.`)                | shape   | TP split       |
| ------------------------------------------------- | --------------------------------------- | ------- | -------------- |
| `mlp.router.weight`                               | `mlp.gate.weight`                       | [E, h]  | replicated     |
| `mlp.experts.local_experts.{j}.linear_fc1.weight` | `mlp.experts.{j}.{gate,up}_proj.weight` | [2F, h] | rows, stride 2 |
| `mlp.experts.local_experts.{j}.linear_fc2.weight` | `mlp.experts.{j}.down_proj.weight`      | [h, F]  | columns        |

Expert parallelism (EP) gives each rank E / EP whole experts, `local_experts.{j - rank x E/EP}` on its rank
(`ParamSpec.expert` is j); the logical names are EP=1's. Within an expert, TP splits as for a dense MLP.

A parameter made of several HF tensors stacks their rows in a fixed pattern (`ParamSpec.groups`, `pieces`): QKV is
[the group's q heads (q/g rows), k (d), v (d)] for each KV group, so a contiguous TP split hands each rank whole
groups (TP must divide g); `linear_fc1` is one [gate (f); up (f)], which TP splits with stride 2 (each rank holds
[gate shard; up shard]). Every conversion is a permutation of rows, so both directions are bit for bit.

Around the layers (`global_params`): the embedding and the output layer ([vocab, h], rows split over TP, padded in
the model to a multiple of `make_vocab_size_divisible_by` x TP; the logical tensors keep `vocab_size` rows) and the
final norm. With tied embeddings the output layer is the embedding (`model_params` leaves it out).

Pure Python on purpose: `presets` imports this, and the presets import nothing heavy.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, make_dataclass, replace
from functools import lru_cache
from typing import Optional, Protocol

from megatron_rl.models.families import family

EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"
ROUTER = "mlp.router.weight"  # a mixture-of-experts layer's router (its name inside a layer)
# A layer's expert j, as Megatron-Core's SequentialMLP names it inside the layer: f"{LOCAL_EXPERTS}{j}.linear_fc1..."
# (j local to the EP rank in a model; global in the checkpoint and in this table). The one place the name is spelled.
LOCAL_EXPERTS = "mlp.experts.local_experts."
_EXPERT = re.compile(rf"^{re.escape(LOCAL_EXPERTS)}(\d+)\.(.+)$")


def expert_prefix(j: int) -> str:
    """The start of expert j's names inside a layer."""
    return f"{LOCAL_EXPERTS}{j}."


def local_expert(name: str) -> Optional[tuple[int, str]]:
    """(j, the rest) of a name inside a layer that is expert j's (`linear_fc1.weight`, ...), else None."""
    m = _EXPERT.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def is_expert(name: str) -> bool:
    """Whether a parameter's name (a layer's, or a whole model's) is an expert's."""
    return name.startswith(LOCAL_EXPERTS) or f".{LOCAL_EXPERTS}" in name
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class DecoderShape(Protocol):
    """What decides a decoder's parameters (`ModelConfig` and `ddma.descriptors.ModelShape` have it)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    tie_word_embeddings: bool
    add_qkv_bias: bool
    qk_layernorm: bool
    family: str
    num_moe_experts: Optional[int]
    moe_ffn_hidden_size: Optional[int]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the logical (TP=1, PP=1) model and the Hugging Face tensors it is made of.

    name: Megatron's name (in `layer_params`, relative to `decoder.layers.{i}.`).
    hf: the HF tensors it is made of, in the order their rows are stacked (in `layer_params`, relative to
        `model.layers.{i}.`).
    shape: the full shape; vocabulary rows unpadded.
    partition_dim, partition_stride: Megatron-Core's tensor-parallel split (`partition_dim` None: replicated).
    groups, pieces: the rows are `groups` repetitions of [pieces[0] rows of hf[0]; pieces[1] rows of hf[1]; ...]
        (one HF tensor: one piece of all its rows).
    is_vocab: the rows are tokens (padded in the model, with a padding that depends on TP).
    expert: the global index of the expert this parameter belongs to (None: not an expert's); expert parallelism
        places it.
    """

    name: str
    hf: tuple[str, ...]
    shape: tuple[int, ...]
    partition_dim: Optional[int] = None
    partition_stride: int = 1
    groups: int = 1
    pieces: tuple[int, ...] = ()
    is_vocab: bool = False
    expert: Optional[int] = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def hf_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shape of each of the HF tensors, in the order of `hf`."""
        return tuple((self.groups * rows, *self.shape[1:]) for rows in self.pieces)

    def hf_row_blocks(self) -> list[tuple[int, str, int, int]]:
        """Where the rows come from: (first row, HF tensor, rows, first HF row) blocks, in row order."""
        out, row = [], 0
        for group in range(self.groups):
            for name, rows in zip(self.hf, self.pieces):
                out.append((row, name, rows, group * rows))
                row += rows
        return out

    def in_layer(self, i: int) -> "ParamSpec":
        """This layer parameter in layer `i`: Megatron and HF names with the layer's prefixes."""
        return replace(self, name=f"decoder.layers.{i}.{self.name}", hf=tuple(f"model.layers.{i}.{n}" for n in self.hf))


def _one(name: str, hf: str, shape: tuple[int, ...], partition_dim: Optional[int] = None,
         is_vocab: bool = False) -> ParamSpec:
    """A parameter that is one HF tensor as it is."""
    return ParamSpec(name, (hf,), shape, partition_dim, pieces=(shape[0],), is_vocab=is_vocab)


def _qkv(suffix: str, m: DecoderShape) -> ParamSpec:
    """`linear_qkv`'s weight or bias: q, k, v rows interleaved per KV group."""
    d, g = m.kv_channels, m.num_query_groups
    rest = (m.hidden_size,) if suffix == "weight" else ()
    hf = tuple(f"self_attn.{x}_proj.{suffix}" for x in "qkv")
    return ParamSpec(f"self_attention.linear_qkv.{suffix}", hf, ((m.num_attention_heads + 2 * g) * d, *rest),
                     partition_dim=0, groups=g, pieces=(m.num_attention_heads // g * d, d, d))


def _swiglu(prefix: str, hf_names: tuple[str, str, str], h: int, f: int,
            expert: Optional[int] = None) -> tuple[ParamSpec, ParamSpec]:
    """A SwiGLU MLP's `linear_fc1` ([gate; up]) and `linear_fc2` (down) from HF's gate, up and down tensors."""
    gate, up, down = hf_names
    return (ParamSpec(f"{prefix}linear_fc1.weight", (gate, up), (2 * f, h), partition_dim=0, partition_stride=2,
                      pieces=(f, f), expert=expert),
            replace(_one(f"{prefix}linear_fc2.weight", down, (h, f), partition_dim=1), expert=expert))


def _mlp(m: DecoderShape) -> tuple[ParamSpec, ...]:
    """The layer's MLP: dense, or a router and its experts (the module docstring's tables)."""
    h = m.hidden_size
    if m.num_moe_experts is None:
        return _swiglu("mlp.", ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"),
                       h, m.ffn_hidden_size)
    names = family(m.family).experts
    experts = (p for j in range(m.num_moe_experts) for p in _swiglu(
        expert_prefix(j), tuple(f"{names.prefix}.experts.{j}.{x}.weight"
                                                 for x in (names.gate, names.up, names.down)),
        h, m.moe_ffn_hidden_size, expert=j))
    return (_one(ROUTER, f"{names.prefix}.gate.weight", (m.num_moe_experts, h)), *experts)


def layer_params(m: DecoderShape) -> tuple[ParamSpec, ...]:
    """One transformer layer's parameters, in Megatron-Core's registration order (the module docstring's table).
    Built once per shape (`_layer_table`): a layer of 128 experts has 259 of them, and the planners ask per layer."""
    return tuple(_layer_table(tuple(getattr(m, f) for f in _SHAPE_FIELDS)).values())


def _build_layer_params(m: DecoderShape) -> tuple[ParamSpec, ...]:
    h, d = m.hidden_size, m.kv_channels
    attention = [_one("self_attention.linear_proj.weight", "self_attn.o_proj.weight",
                      (h, m.num_attention_heads * d), partition_dim=1),
                 _qkv("weight", m)]
    if m.add_qkv_bias:
        attention.append(_qkv("bias", m))
    if m.qk_layernorm:
        attention += [_one(f"self_attention.{x}_layernorm.weight", f"self_attn.{x}_norm.weight", (d,)) for x in "qk"]
    return (
        _one("input_layernorm.weight", "input_layernorm.weight", (h,)),
        *attention,
        _one("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", (h,)),
        *_mlp(m),
    )


def global_params(m: DecoderShape) -> tuple[ParamSpec, ParamSpec, ParamSpec]:
    """The embedding, the final norm and the output layer (present in the model only when embeddings are untied)."""
    vocab = (m.vocab_size, m.hidden_size)
    return (_one(EMBEDDING, "model.embed_tokens.weight", vocab, partition_dim=0, is_vocab=True),
            _one(FINAL_NORM, "model.norm.weight", (m.hidden_size,)),
            _one(OUTPUT, "lm_head.weight", vocab, partition_dim=0, is_vocab=True))


def model_params(m: DecoderShape, output_layer: Optional[bool] = None) -> list[ParamSpec]:
    """Every parameter of the logical model with global layer indices, in model order; the output layer when
    `output_layer` (by default: when embeddings are untied)."""
    embedding, final_norm, output = global_params(m)
    layer = layer_params(m)
    out = [embedding, *(p.in_layer(i) for i in range(m.num_layers) for p in layer), final_norm]
    if (not m.tie_word_embeddings) if output_layer is None else output_layer:
        out.append(output)
    return out


_SHAPE_FIELDS = tuple(DecoderShape.__annotations__)


@lru_cache(maxsize=16)
def _layer_table(shape: tuple) -> dict[str, ParamSpec]:
    """`layer_params` by name, for a shape given as the values of `_SHAPE_FIELDS` (a layer of 128 experts has 259
    parameters, and a conversion looks each of them up)."""
    m = _Shape(*shape)
    return {p.name: p for p in _build_layer_params(m)}


# A hashable stand-in for any DecoderShape (`_layer_table`'s cache key is its field values).
_Shape = make_dataclass("_Shape", _SHAPE_FIELDS, frozen=True)


def find_param(name: str, m: DecoderShape) -> ParamSpec:
    """The parameter of a logical Megatron name (global layer index; the output layer even when tied); KeyError
    (one line) for a name this model does not have."""
    match = _LAYER.match(name)
    if match and int(match.group(1)) < m.num_layers:
        p = _layer_table(tuple(getattr(m, f) for f in _SHAPE_FIELDS)).get(match.group(2))
        found = [p.in_layer(int(match.group(1)))] if p is not None else []
    else:
        found = [p for p in global_params(m) if p.name == name]
    if not found:
        raise KeyError(f"no parameter {name!r} in this model")
    return found[0]

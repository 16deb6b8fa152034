"""Build a Megatron-Core GPTModel for a model shape (any family of `megatron_rl.models.families`), a parallel layout
and a process-group collection."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from typing import Literal, Optional

import torch
import torch.nn.functional as F
import megatron_rl.compat.megatron_core  # noqa: F401 - first: Megatron-Core without wandb and Inductor
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl.compat import cuda_rules
from megatron_rl.models.attention import SDPAttention
from megatron_rl.models.fused import FusedRMSNorm, FusionSpec, register_rope_fusion, resolve_fusions
from megatron_rl.models.moe import TokenSplitMoELayer
from megatron_rl.models.param_spec import is_expert
from megatron_rl.models.presets import ModelConfig
from megatron_rl.parallel.layout import ParallelLayout

AttentionBackend = Literal["auto", "sdpa", "local", "te"]


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_attention_backend(backend: AttentionBackend) -> str:
    """"auto" is transformer-engine's spec when installed (and on a GPU), else our SDPA core attention."""
    if backend == "auto":
        return "te" if have_transformer_engine() and torch.cuda.is_available() else "sdpa"
    if backend == "te" and not have_transformer_engine():
        raise ValueError("attention backend 'te' needs transformer-engine, which is not installed")
    if backend not in ("sdpa", "local", "te"):
        raise ValueError(f"unknown attention backend {backend!r}; expected auto, sdpa, local or te")
    return backend


def layer_spec(backend: AttentionBackend = "auto", fusions: FusionSpec = "none",
               qk_layernorm: bool = False, num_experts: Optional[int] = None) -> ModuleSpec:
    """Transformer-layer spec: Megatron-Core's local modules with the chosen core attention, or TE's spec;
    `qk_layernorm` adds Megatron-Core's per-head RMSNorm of queries and keys (Qwen3); `num_experts` makes the MLP
    Megatron-Core's MoE layer (the local spec's `SequentialMLP`: one MLP per local expert, the parameter names
    `models.param_spec` writes down; TE's spec has its grouped GEMM).

    With the "rmsnorm" fusion the local spec's norms (torch.nn.RMSNorm) become `FusedRMSNorm` (TE's spec has its
    own fused norms)."""
    backend = resolve_attention_backend(backend)
    if backend == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, normalization="RMSNorm",
                                                          qk_layernorm=qk_layernorm)
    else:
        if num_experts is not None:
            moe_without_transformer_engine()
        spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm",
                                        qk_layernorm=qk_layernorm)
    if num_experts is not None:  # whole activations between layers: the layer splits its tokens over TP itself
        spec.submodules.mlp.module = TokenSplitMoELayer
    if backend == "te":
        return spec
    if backend == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    if "rmsnorm" in resolve_fusions(fusions):
        spec.submodules.input_layernorm = FusedRMSNorm
        spec.submodules.pre_mlp_layernorm = FusedRMSNorm
    return spec


@contextlib.contextmanager
def _unknown_mlp_quiet():
    """Drop TransformerLayer's "Unknown MLP type" warning while a model is built: our MoE layer
    (`TokenSplitMoELayer`) gets its process groups from its spec's params, which is what the warning's default
    kwargs then are."""
    logger = logging.getLogger("megatron.core.transformer.transformer_layer")
    drop = _DropUnknownMlp()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


class _DropUnknownMlp(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Unknown MLP type")


def moe_without_transformer_engine() -> None:
    """Megatron-Core 0.16's router calls `te_general_gemm` when it is not None, but without transformer-engine
    never defines it (a NameError at the first forward); define it as None, which takes its torch path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def moe_config(model: ModelConfig, layout: ParallelLayout) -> dict:
    """Megatron-Core's MoE options for a mixture-of-experts model (empty for a dense one).

    The token dispatcher is Megatron-Core's all-gather one: every rank of the TP x EP group gathers the group's
    tokens and keeps those routed to its experts. Its alternative, all-to-all, needs `all_to_all_single`, which
    gloo (the CPU backend) does not have. The router computes its logits and probabilities in fp32 (as
    transformers does its softmax). The load-balancing loss is the switch-transformer auxiliary loss computed by
    the MoE layer itself (`models.moe.TokenSplitMoELayer.route`, which says why), so Megatron-Core's own is off
    (`moe_router_load_balancing_type` "none"); its coefficient is `moe_aux_loss_coeff`, 0 here, which the trainer
    sets (`trainer.moe_aux_loss_coeff`)."""
    if model.num_moe_experts is None:
        return {}
    return dict(num_moe_experts=model.num_moe_experts, moe_ffn_hidden_size=model.moe_ffn_hidden_size,
                moe_router_topk=model.moe_router_topk, moe_router_pre_softmax=model.moe_router_pre_softmax,
                moe_router_score_function="softmax", moe_router_dtype="fp32", moe_token_dispatcher_type="allgather",
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
                expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp)


def transformer_config(
    model: ModelConfig,
    layout: ParallelLayout,
    params_dtype: torch.dtype = torch.float32,
    use_cpu_initialization: Optional[bool] = None,
    **overrides,
) -> TransformerConfig:
    """Megatron-Core TransformerConfig for a model shape in a given layout (its family's features are Megatron-Core
    options: `add_qkv_bias`, `qk_layernorm`; a head size other than hidden/heads is `kv_channels`)."""
    if use_cpu_initialization is None:
        use_cpu_initialization = not torch.cuda.is_available()
    kwargs = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        init_method_std=model.init_method_std,
        layernorm_epsilon=model.norm_epsilon,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=use_cpu_initialization,
        # SwiGLU fusion is Megatron-Core's torch.compile'd kernel: on GPUs it saves time and 8 GB at 16K tokens
        # for a 1B model (docs/benchmarks.md); on CPUs compiling costs more than it saves. RMSNorm and RoPE
        # fusions are `build_gpt_model(fusions=...)` (megatron_rl.models.fused); the rest need apex or TE.
        bias_activation_fusion=torch.cuda.is_available(),
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        cuda_graph_scope=[],  # the whole layer, in the current spelling (the default "full" warns as deprecated)
        **moe_config(model, layout),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def seed_rng_tracker(seed: int, tp_rank: int) -> None:
    """Seed Megatron-Core's model-parallel RNG tracker for this rank (needed by GPU weight initialization)."""
    mcore_random.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0,
                                                force_reset_rng=True)


def _leave_as_is(tensor: torch.Tensor) -> torch.Tensor:
    """The init method of `build_gpt_model(initialize=False)`: the tensor stays as allocated."""
    return tensor


def _no_init_overrides() -> dict:
    """The config of a model whose every weight is filled next: allocated in place and left uninitialized, but for
    the norms' ones and the zeroed vocabulary padding. Megatron-Core still runs its initializer, with an init
    method that does nothing, because it sets a weight's tensor-parallel attributes there; its device path is
    taken, with no full-size master weight as on its CPU path. Random initialization is 1.2-1.8 s of building
    SmolLM2-135M on the 2-core test machine, and grows with the model."""
    init_methods = ("init_method", "output_layer_init_method", "embedding_init_method")
    return dict({k: _leave_as_is for k in init_methods}, use_cpu_initialization=False)


def _stage_spec(model: ModelConfig, config: TransformerConfig, backend: str, fused: set, pgs):
    """The layer spec of one pipeline stage (`layer_spec`), with the MoE layer's process groups and, with the
    "rmsnorm" fusion, the block's final norm."""
    spec = layer_spec(backend, fused, qk_layernorm=model.qk_layernorm, num_experts=model.num_moe_experts)
    if model.is_moe:  # TransformerLayer passes the groups to Megatron-Core's own MoE classes only
        spec.submodules.mlp.params = {"pg_collection": pgs}
    if "rmsnorm" in fused:
        # The block's final norm comes from Megatron-Core's default (WrappedTorchNorm without apex): pass the
        # block's submodules explicitly, as `_get_block_submodules` builds them, with our norm.
        spec = TransformerBlockSubmodules(
            layer_specs=[spec] * get_num_layers_to_build(config, vp_stage=None, pp_rank=pgs.pp.rank()),
            layer_norm=FusedRMSNorm,
        )
    return spec


def build_gpt_model(
    model: ModelConfig,
    layout: ParallelLayout,
    pgs: ProcessGroupCollection,
    *,
    attention: AttentionBackend = "auto",
    params_dtype: torch.dtype = torch.float32,
    seed: int = 1234,
    config_overrides: Optional[dict] = None,
    fusions: FusionSpec = "auto",
    initialize: bool = True,
) -> GPTModel:
    """One pipeline stage of the model's GPTModel on this rank.

    The stage, tensor shards and vocabulary padding (to `make_vocab_size_divisible_by * tp`) follow from `layout`
    and the ranks of `pgs`. Initialization is deterministic in `seed`; on the CPU, Megatron-Core initializes each
    full weight and slices it, so every layout starts from the same logical weights.

    `initialize=False` (for a caller that fills every parameter next: a checkpoint load, a DDMA push, the
    converter) leaves the weights uninitialized (`_no_init_overrides`).

    `fusions` ("auto": all on GPUs, none on CPUs; "none"; or a comma list of "rmsnorm", "rope") picks the fused
    RMSNorm and RoPE of `megatron_rl.models.fused`. They change no parameter and no result beyond bf16 rounding
    (CPU tensors take the unfused arithmetic even when asked); the set chosen is kept on the model as
    `megatron_rl_fusions` (the generator's incremental forward reads it). Megatron-Core's SwiGLU fusion is its own
    config flag, `bias_activation_fusion`.
    """
    if pgs.tp.size() != layout.tp or pgs.pp.size() != layout.pp:
        raise ValueError(
            f"process groups (tp={pgs.tp.size()}, pp={pgs.pp.size()}) do not match the layout {layout}"
        )
    pp_rank = pgs.pp.rank()
    backend = resolve_attention_backend(attention)
    fused = resolve_fusions(fusions)
    if backend == "te":  # transformer-engine's spec brings its own fused norms (and its own RoPE kernel)
        fused -= {"rmsnorm", "rope"}
    overrides = dict(config_overrides or {}, **({} if initialize else _no_init_overrides()))
    if "rope" in fused:
        # Megatron-Core's own RoPE switch; without transformer-engine its kernel slot is filled with ours.
        register_rope_fusion(cuda_rules.enabled())
        overrides.setdefault("apply_rope_fusion", True)
    config = transformer_config(model, layout, params_dtype=params_dtype, **overrides)
    if not config.apply_rope_fusion:
        fused -= {"rope"}
    spec = _stage_spec(model, config, backend, fused, pgs)
    # The local spec's DotProductAttention takes scratch space from Megatron-Core's global memory buffer.
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
    torch.manual_seed(seed)
    seed_rng_tracker(seed, tp_rank=pgs.tp.rank())
    with _unknown_mlp_quiet():
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=model.padded_vocab_size(layout.tp),
            max_sequence_length=model.max_position_embeddings,
            pre_process=pp_rank == 0,
            post_process=pp_rank == layout.pp - 1,
            share_embeddings_and_output_weights=model.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(model.rotary_base),
            rope_scaling=model.rope_scaling,
            rope_scaling_factor=model.rope_scaling_factor,
            pg_collection=pgs,
        )
    gpt.megatron_rl_fusions = frozenset(fused)
    if model.is_moe:
        mark_experts_expert_parallel(gpt)
    zero_vocab_padding(gpt, model.vocab_size, pgs.tp.rank())
    if torch.cuda.is_available() or cuda_rules.enabled():  # (a no-op on the CPU, but for CUDA's refusals)
        # Weights left on the meta device (an 8-bit generator's, built without them) have nothing to copy: they
        # stay there until they are quantized or allocated in place.
        device = torch.cuda.current_device()
        gpt._apply(lambda t: t if t.is_meta else t.cuda(device))
    return gpt


def mark_experts_expert_parallel(gpt: GPTModel) -> None:
    """Megatron-Core marks expert weights as expert-parallel (their own DDP buffers and optimizer, over the
    expert-data-parallel group) only when EP > 1; marked at every EP, the optimizer is the same two-part chain
    whatever the EP, so a checkpoint resumes at another EP, EP 1 included (at EP 1 the expert-DP group is the DP
    group: the same reduction)."""
    for name, p in gpt.named_parameters():
        if is_expert(name):
            p.allreduce = False


@torch.no_grad()
def zero_vocab_padding(gpt: GPTModel, vocab_size: int, tp_rank: int) -> None:
    """Zero the rows of the padded vocabulary (they are never real tokens), so every layout agrees on them."""
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        p = gpt.get_parameter(name) if any(n == name for n, _ in gpt.named_parameters()) else None
        if p is None:
            continue
        start = tp_rank * p.shape[0]
        first_pad = max(vocab_size - start, 0)
        if first_pad < p.shape[0]:
            p[first_pad:].zero_()

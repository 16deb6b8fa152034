"""A lean incremental forward pass over a Megatron-Core GPTModel's own modules, with a slot-based KV cache (or a
paged one, `PagedKVCache`).

Megatron-Core's inference engines are CUDA-only and its static inference context gives every sequence of a
batch the same length offset, which rules out continuous batching. This module reuses the model's modules
(parallel embedding, layer norms, tensor-parallel QKV / projection / MLP linears with their QKV bias, the per-head
q/k norms applied before RoPE, the output layer, its RoPE frequencies and `_apply_rotary_pos_emb_bshd`) and only
replaces the attention bookkeeping: each cache slot holds one sequence with its own length, every token carries its
own position, and attention masks each slot to its own prefix. The arithmetic is the training forward's (tested
against it and against transformers).

A mixture-of-experts layer (Qwen3-MoE, Mixtral) runs as the model's own MoE module (`models/moe.py:
TokenSplitMoELayer` over Megatron-Core's router, all-gather dispatcher and experts): the trainer's routing math on
the same [s, b, h] activations, whether a prefill chunk or a decode step (s = 1). No expert capacity is set, so no
token is dropped and a token's output does not depend on the others in the batch (padding and free slots included).
Its dispatch selects each expert's tokens (`masked_select`: a data-dependent shape) and splits them by counts read
on the host, so the generator never captures an MoE model's decode step in a CUDA graph (`generator.py`).

With the model's GPU fusions (`build_gpt_model(fusions=...)`, kept as `model.megatron_rl_fusions`) the norms are
the model's `FusedRMSNorm`s and RoPE is the compiled `megatron_rl.models.fused.apply_rope`. (Attention stays
SDPA with GQA and a mask: inside the decode graph on an H100 it beat both folding each group's query heads into
the query length and two batched matmuls around a compiled masked softmax; `benchmarks/fused_kernels.py`.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
import megatron_rl.compat.megatron_core  # noqa: F401 - first: Megatron-Core without wandb and Inductor
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe.moe_layer import BaseMoELayer

from megatron_rl.compat import cuda_rules
from megatron_rl.compat.cpu import redirected
from megatron_rl.inference.settings import KV_BLOCK_SIZE
from megatron_rl.models.fused import apply_rope
from megatron_rl.models.precision import native_bf16


def _rotate_half_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [s, b, heads, d] with precomputed cos/sin [s, b, 1, d] (the non-interleaved layout Megatron-Core's
    `_apply_rotary_pos_emb_bshd` uses: the two halves of each head are rotated as pairs)."""
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# The most rows (tokens x sequences) for which `_cpu_linear` takes the transposed product.
SMALL_BATCH_ROWS = 64
# The fewest rows for which `_cpu_linear` computes a bf16 product in fp32 on a CPU without native bf16 (more for a
# large weight: `_bf16_in_fp32_min_rows`).
BF16_IN_FP32_MIN_ROWS = 16


def _bf16_in_fp32_min_rows(weight: torch.Tensor) -> int:
    """BF16_IN_FP32_MIN_ROWS, or one row per 2^19 elements of a larger weight: converting a weight too large for the
    caches to fp32 takes a fresh allocation's page faults every call, as long as about 36 rows of its bf16 product
    for SmolLM2's 28M-element output layer on the 2-core machine (16 rows: 62 ms in bf16, 128 ms converted; 48 rows:
    204 against 168 ms), where a 0.9M-element layer's conversion already paid for itself at 16 rows."""
    return max(BF16_IN_FP32_MIN_ROWS, weight.numel() >> 19)


def _cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """`F.linear(x, weight, bias)` on a CPU. For a decode-sized fp32 batch (at most SMALL_BATCH_ROWS rows) it is
    computed as `weight @ x^T`: MKL's fp32 GEMM with a handful of rows against a weight streamed from memory ran
    up to 2.5x slower than the transposed product on the 2-core test machine (SmolLM2-135M's layer shapes, 2 to 64
    rows, docs/benchmarks.md). Longer fp32 chunks (prefill) keep `F.linear`, which was as fast or faster there.

    bf16 keeps `F.linear` where the CPU multiplies bf16 natively (`models/precision.py: native_bf16`: AVX-512 BF16
    or AMX). Elsewhere torch's fallback bf16 GEMM ran 4.5-6x slower than fp32 (the 2-core AVX2 test machine,
    docs/benchmarks.md), so from BF16_IN_FP32_MIN_ROWS rows on (prefill, a batch's forward; more for a large
    weight) the product is taken in fp32 and rounded to bf16 once: what a GPU's bf16 GEMM computes (bf16 inputs,
    fp32 accumulation, one rounding, the bias included, where torch's CPU fallback rounds before adding the bias
    too). Fewer rows keep the bf16 kernel, which beats converting the weight every call."""
    rows = x.numel() // x.shape[-1]
    if x.dtype == torch.bfloat16 and not native_bf16() and rows >= _bf16_in_fp32_min_rows(weight):
        return _cpu_linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)
    if x.dtype != torch.float32 or rows > SMALL_BATCH_ROWS:
        return F.linear(x, weight, bias)
    # contiguous: the next product reads it as a row-major matrix (strided, fc2 after SwiGLU ran 2.5x slower)
    out = torch.mm(weight, x.reshape(rows, -1).t()).t().contiguous().view(*x.shape[:-1], weight.shape[0])
    return out + bias if bias is not None else out


@dataclass
class KVCache:
    """keys/values [layers, slots, groups_per_rank, max_len, head_dim] for one pipeline stage on one TP rank."""

    keys: torch.Tensor
    values: torch.Tensor

    @classmethod
    def allocate(cls, num_layers: int, slots: int, groups: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device) -> "KVCache":
        shape = (num_layers, slots, groups, max_len, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def max_len(self) -> int:
        return self.keys.shape[3]

    @property
    def slots(self) -> int:
        return self.keys.shape[1]

    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2


@dataclass
class PagedKVCache:
    """A KV cache sized by tokens in use: blocks of `block_size` positions, keys/values [layers, blocks, block_size,
    groups_per_rank, head_dim], and a block table [slots, max_len / block_size] mapping each slot's positions to
    blocks.

    The generator (`inference/generator.py: BlockPool`) gives a slot blocks as its sequence grows and takes them back
    when it ends, so the memory follows the tokens held, not slots x `max_len`, and more sequences decode at once in
    the same memory. Block 0 is scratch: every table entry not given to a sequence points there, so the writes of
    free slots and of positions past a sequence's end (the fixed-shape decode step computes every slot) land in it,
    and nothing reads them unmasked. Reading a slot's keys gathers its positions (one copy per layer, where the slot
    cache reads in place: the price of the memory on this path, which has no paged attention kernel); a position's
    groups and head dimension are contiguous, so the gather moves whole rows and its result feeds the attention's
    matmuls as a strided view."""

    keys: torch.Tensor
    values: torch.Tensor
    table: torch.Tensor  # [slots, max_len // block_size] block ids, on the model's device

    @classmethod
    def allocate(cls, num_layers: int, slots: int, groups: int, max_len: int, head_dim: int, dtype: torch.dtype,
                 device, tokens: int, block_size: int) -> "PagedKVCache":
        if max_len % block_size:
            raise ValueError(f"max_len={max_len} is not a multiple of the block size {block_size}")
        blocks = 1 + -(-tokens // block_size)  # and the scratch block
        shape = (num_layers, blocks, block_size, groups, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(slots, max_len // block_size, dtype=torch.long, device=device))

    @property
    def block_size(self) -> int:
        return self.keys.shape[2]

    @property
    def blocks(self) -> int:
        """Blocks sequences can hold (the scratch block aside)."""
        return self.keys.shape[1] - 1

    @property
    def max_len(self) -> int:
        return self.table.shape[1] * self.block_size

    @property
    def slots(self) -> int:
        return self.table.shape[0]

    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2

    def rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Where positions [b, s] of `slots` [b] are among all the cache's positions (blocks x block_size)."""
        block = self.table[slots[:, None], positions // self.block_size]
        return block * self.block_size + positions % self.block_size

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [b, s, groups, d] at `rows` [b, s] (`rows`)."""
        g, d = self.keys.shape[-2:]
        self.keys[layer].view(-1, g, d)[rows] = k.to(self.keys.dtype)
        self.values[layer].view(-1, g, d)[rows] = v.to(self.values.dtype)

    def read(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `rows` [b, kv] (each slot's positions 0..kv-1): [b, groups, kv, d] each."""
        g, d = self.keys.shape[-2:]
        return tuple(store[layer].view(-1, g, d)[rows].transpose(1, 2) for store in (self.keys, self.values))


class IncrementalForward:
    """Runs chunks of tokens for chosen cache slots through the model (one pipeline stage of it) and returns
    vocab-parallel logits (last stage) or the stage's output activations (the other stages). `cuda_rules_on`: CPU
    tensors take the GPU paths (the CUDA-rules test mode, `compat/cuda_rules.py`, read by whoever builds this)."""

    def __init__(self, model: torch.nn.Module, tp_group, cuda_rules_on: bool = False):
        self.model = model
        self.tp_group = tp_group
        self.cuda_rules_on = cuda_rules_on
        cfg = model.config
        tp = tp_group.size()
        self.heads = cfg.num_attention_heads // tp
        self.groups = cfg.num_query_groups // tp
        self.head_dim = cfg.kv_channels
        self.scale = 1.0 / self.head_dim ** 0.5
        self.layers = list(model.decoder.layers)
        # The residual stream's and the KV cache's dtype: the stage's matrices' (a bf16 model keeps fp32 norms; a
        # middle stage with 8-bit matrices has no full-precision matrix left, and computes in params_dtype).
        matrices = [p.dtype for p in model.parameters() if p.dim() >= 2]
        self.dtype = matrices[0] if matrices else model.config.params_dtype
        self._rope = None
        # The lean path needs Megatron-Core's own linears (the 8-bit generator's subclasses only change where the
        # weight comes from); transformer-engine's fold the norms into them.
        # (A mixture-of-experts layer's MLP is the model's own MoE module, whatever the path: `_mlp`.)
        local = (ColumnParallelLinear, RowParallelLinear)
        self.moe = any(isinstance(m.mlp, BaseMoELayer) for m in self.layers)
        self._lean = all(isinstance(lin, local) for m in self.layers
                         for lin in (m.self_attention.linear_qkv, m.self_attention.linear_proj)
                         + (() if isinstance(m.mlp, BaseMoELayer) else (m.mlp.linear_fc1, m.mlp.linear_fc2)))
        fusions = getattr(model, "megatron_rl_fusions", frozenset())
        self._rotate = self._fused_rope if "rope" in fusions else _apply_rotary_pos_emb_bshd
        self._qk_norm = bool(cfg.qk_layernorm)

    def _fused_rope(self, t: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """The model's RoPE fusion (`models/fused.py: apply_rope`), compiled on the GPU path."""
        return apply_rope(t, angles, compiled=cuda_rules.gpu_path(t, self.cuda_rules_on))

    def allocate_cache(self, slots: int, max_len: int, tokens: Optional[int] = None,
                       block_size: int = KV_BLOCK_SIZE) -> "KVCache | PagedKVCache":
        """The slot cache (slots x max_len), or with `tokens` a paged one holding that many tokens in all."""
        device = next(self.model.parameters()).device
        if tokens is not None:
            return PagedKVCache.allocate(len(self.layers), slots, self.groups, max_len, self.head_dim, self.dtype,
                                         device, tokens, block_size)
        return KVCache.allocate(len(self.layers), slots, self.groups, max_len, self.head_dim, self.dtype, device)

    def prepare(self, max_len: int) -> None:
        """Build what the loop needs outside it (the RoPE table for `max_len` positions)."""
        self._rope_angles(max_len)

    def _rope_angles(self, max_len: int) -> torch.Tensor:
        if self._rope is None or self._rope.shape[0] < max_len:
            self._rope = self.model.rotary_pos_emb(max_len)  # [max_len, 1, 1, head_dim] angles
        return self._rope

    def _linear(self, module, x: torch.Tensor) -> torch.Tensor:
        """A tensor-parallel linear's output (full for a row-parallel one, this rank's columns for a
        column-parallel one). On CPUs, Megatron-Core's local linears are called as the matmul they are plus the
        row-parallel all-reduce: their autograd-function wrapper is a cost comparable to a decode-sized matmul's
        (docs/benchmarks.md, "A real LLM learns on a CPU")."""
        if not self._lean or cuda_rules.gpu_path(x, self.cuda_rules_on) or getattr(module, "gather_output", False):
            return module(x)[0]
        out = _cpu_linear(x, module.weight, module.bias if not module.skip_bias_add else None)
        if isinstance(module, RowParallelLinear) and self.tp_group.size() > 1:
            dist.all_reduce(out, group=self.tp_group)
        return out

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The model's embedding of tokens [b, s] as [s, b, h].

        On the GPU path at TP > 1 the vocabulary-parallel lookup is written out: Megatron-Core's zeroes the tokens
        of other shards with boolean-mask writes (`x[mask] = 0`), which a CUDA graph capture refuses (the decode
        step then fell back to eager decoding); `masked_fill` does the same arithmetic without a host sync."""
        emb = self.model.embedding
        words, config = emb.word_embeddings, emb.config
        if (self.tp_group.size() == 1 or not cuda_rules.gpu_path(tokens, self.cuda_rules_on)
                or emb.add_position_embedding or config.sequence_parallel or config.fp32_residual_connection):
            return emb(input_ids=tokens, position_ids=positions)
        local = tokens - words.vocab_start_index
        outside = (local < 0) | (local >= words.num_embeddings_per_partition)
        out = F.embedding(local.masked_fill(outside, 0), words.weight).masked_fill_(outside[..., None], 0.0)
        dist.all_reduce(out, group=self.tp_group)
        return out.transpose(0, 1).contiguous()  # embedding dropout: none in inference

    def _mlp(self, mlp, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU MLP: through `_linear` on CPUs (Megatron-Core's gated MLP: silu(first half) * second half). A
        mixture-of-experts layer is called as it is (x [s, b, h] -> its output [s, b, h]; the module docstring)."""
        if isinstance(mlp, BaseMoELayer):  # its router needs the CPU layer's device redirect, which the loop suspends
            with redirected():
                return mlp(x)[0]
        if not self._lean or cuda_rules.gpu_path(x, self.cuda_rules_on) or not mlp.config.gated_linear_unit:
            return mlp(x)[0]
        gate, up = torch.chunk(self._linear(mlp.linear_fc1, x), 2, dim=-1)
        return self._linear(mlp.linear_fc2, F.silu(gate) * up)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                attend: torch.Tensor) -> torch.Tensor:
        """q [b, heads, s, d], keys/values [b, groups, kv, d], attend [b, 1, s, kv] -> context [s, b, heads * d].

        On GPUs, SDPA. On CPUs, SDPA's masked kernel is built for long queries and is much slower than two batched
        matmuls around a softmax at decode shapes (docs/benchmarks.md), so each group's query heads are folded into
        the query length and attention is written out (softmax in fp32)."""
        b, heads, s, d = q.shape
        g = keys.shape[1]
        if cuda_rules.gpu_path(q, self.cuda_rules_on):
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attend, scale=self.scale,
                                                 enable_gqa=g != heads)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        per = heads // g
        scores = torch.matmul(q.reshape(b, g, per * s, d), keys.transpose(-1, -2)).float() * self.scale
        scores = scores.view(b, g, per, s, -1).masked_fill_(~attend[:, :, None], float("-inf"))
        probs = torch.softmax(scores, -1).to(values.dtype).view(b, g, per * s, -1)
        out = torch.matmul(probs, values).view(b, heads, s, d)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    @torch.no_grad()
    def __call__(self, tokens: Optional[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor,
                 cache: KVCache, kv_len: Optional[int] = None, all_slots: bool = False,
                 logits: bool = True, hidden: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """tokens, positions [b, s] (right-padded chunks are fine: padding positions write cache entries that are
        overwritten before they are attended to); slots [b]. Returns logits [b, s, vocab / tp].

        A pipeline stage other than the first takes the previous stage's output `hidden` [s, b, h] instead of
        `tokens`; a stage other than the last returns its own output [s, b, h] (with or without `logits`).

        `kv_len` bounds the cache prefix attention reads (default: the largest position + 1, which costs a
        device-to-host sync; CUDA-graph decoding passes the cache length instead). `all_slots` says that `slots`
        is every slot in order (the decode step), so attention reads the cache in place. `logits=False` only
        fills the cache (a prefill, whose logits nobody reads) and skips the output layer."""
        b, s = positions.shape
        angles = self._rope_angles(cache.max_len)[positions.T.reshape(-1)].view(s, b, 1, -1)
        # Keys a query may attend to: the cache prefix of its own slot up to its own position.
        if kv_len is None:
            kv_len = int(positions.max()) + 1
        cols = torch.arange(kv_len, device=positions.device)
        attend = cols[None, None, :] <= positions[:, :, None]  # [b, s, kv_len]
        attend = attend[:, None]  # [b, 1, s, kv_len]
        if self.model.pre_process:
            hidden = self._embed(tokens, positions)  # [s, b, h]
        elif hidden is None:
            raise ValueError("a pipeline stage after the first needs the previous stage's output (hidden)")
        # On CPUs the rotation's cos/sin are computed once per forward, not twice per layer.
        gpu = cuda_rules.gpu_path(positions, self.cuda_rules_on)
        rope = None
        if self._lean and not gpu and self._rotate is _apply_rotary_pos_emb_bshd:
            rope = (angles.cos().to(hidden.dtype), angles.sin().to(hidden.dtype))
        g, per, d = self.groups, self.heads // self.groups, self.head_dim
        if isinstance(cache, PagedKVCache):  # where this chunk writes, and what it reads, once for every layer
            written = cache.rows(slots, positions)
            attended = cache.rows(slots, cols[None, :].expand(b, kv_len))
        for i, layer in enumerate(self.layers):
            attn = layer.self_attention
            x = layer.input_layernorm(hidden)
            qkv = self._linear(attn.linear_qkv, x)
            qkv = qkv.view(s, b, g, (per + 2) * d)
            q, k, v = torch.split(qkv, [per * d, d, d], dim=3)
            q = q.reshape(s, b, g * per, d)
            if self._qk_norm:  # per-head RMSNorm of queries and keys, before RoPE (Qwen3)
                q, k = attn.q_layernorm(q), attn.k_layernorm(k)
            if rope is not None:
                q, k = _rotate_half_pairs(q, *rope), _rotate_half_pairs(k, *rope)
            else:
                q, k = self._rotate(q, angles), self._rotate(k, angles)
            # Write this chunk's keys/values into each sequence's slot at its positions.
            if isinstance(cache, PagedKVCache):
                cache.write(i, written, k.permute(1, 0, 2, 3), v.permute(1, 0, 2, 3))
                keys, values = cache.read(i, attended)
            else:
                kc, vc = cache.keys[i], cache.values[i]
                slot_idx = slots[:, None].expand(b, s)
                kc[slot_idx, :, positions] = k.permute(1, 0, 2, 3).to(kc.dtype)
                vc[slot_idx, :, positions] = v.permute(1, 0, 2, 3).to(vc.dtype)
                if all_slots:  # decoding every slot in order: attend straight from the cache, no gather copy
                    keys, values = kc[:, :, :kv_len], vc[:, :, :kv_len]
                else:
                    keys, values = kc[slots, :, :kv_len], vc[slots, :, :kv_len]
            context = self._attend(q.permute(1, 2, 0, 3), keys, values, attend)
            hidden = hidden + self._linear(attn.linear_proj, context)
            hidden = hidden + self._mlp(layer.mlp, layer.pre_mlp_layernorm(hidden))
        if not self.model.post_process:
            return hidden
        if not logits:
            return None
        hidden = self.model.decoder.final_layernorm(hidden)
        weight = self.model.shared_embedding_or_output_weight() if self.model.share_embeddings_and_output_weights \
            else None
        output = self.model.output_layer
        if self._lean and not gpu and type(output) is ColumnParallelLinear and not output.gather_output:
            # this rank's vocabulary columns, as Megatron-Core's layer computes them (no bias), without its wrapper
            logits = _cpu_linear(hidden, output.weight if weight is None else weight, None)
        else:
            logits, _ = output(hidden, weight=weight)
        return logits.transpose(0, 1)  # [b, s, vocab / tp]

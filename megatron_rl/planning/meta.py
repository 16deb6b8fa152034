"""One rank's modules, built on the meta device through the job's own builders, and the optimizer's view of them.

The planner must know the bytes every rank will hold without any rank existing. It gets them from the real code:

1. `build_gpt_model` (and, for an int8 or fp8 generator, `build_gpt_model` under the quantized builder's meta hook
   followed by `quantize_generator`, the two steps `build_quantized_generator` takes) builds the stage a rank would
   build, with `perform_initialization=False` and every tensor on the meta device: shapes, dtypes and Megatron's
   parameter attributes are real, no storage is allocated, so a 405B stage costs nothing.
2. The builder reads its process groups only through `size()` and `rank()` (`pgs.tp`, `pgs.pp`, and Megatron-Core's
   `get_pg_size` / `get_pg_rank`, which also need `torch.distributed` to be initialized). A TP8 stage therefore
   needs no group of 8 processes: `StandInGroup(size, rank)` answers those two questions for the rank being
   planned, and a one-process gloo world (an in-memory store, no network) is started for the duration of the build
   if none exists. `pgs.embd` is None: the embedding group is only used to copy initial weights between the first
   and last stage, which a meta model has none of.
3. Megatron-Core's own `_ParamAndGradBuffer` (what its DDP allocates: one buffer per (param dtype, grad dtype),
   parameters in reverse order, 64-element alignment and DP padding with the distributed optimizer) is constructed
   over these meta parameters, and its `DistributedOptimizer._build_gbuf_range_map` says which elements every DP
   rank owns, hence its fp32 main weights and Adam moments. Nothing is re-derived by formula.

The result is plain data (`RankModules`); no module outlives the call.
"""

from __future__ import annotations

import math
import contextlib
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

from megatron_rl.models.presets import ModelConfig
from megatron_rl.parallel.layout import ParallelLayout


class StandInGroup:
    """A process group as the model builders use it: only its size and this rank's place in it."""

    def __init__(self, size: int, rank: int = 0):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside a group of {size}")
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def __repr__(self) -> str:
        return f"StandInGroup(size={self._size}, rank={self._rank})"


def stand_in_groups(layout: ParallelLayout, tp_rank: int, pp_rank: int, dp_rank: int = 0):
    """A `ProcessGroupCollection` of stand-in groups for one rank of `layout`, with the same members as
    `megatron_rl.parallel.topology` builds (no context parallelism: that group has size 1; the expert groups from
    the layout's expert grid, `ParallelLayout.expert_coords`)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    tp, pp, dp = layout.tp, layout.pp, layout.dp
    etp, ep = layout.etp, layout.ep
    etp_rank, ep_rank = layout.expert_coords(tp_rank, dp_rank)
    g = StandInGroup
    pgs = ProcessGroupCollection()
    pgs.tp = pgs.tp_cp = g(tp, tp_rank)
    pgs.expt_tp, pgs.ep = g(etp, etp_rank), g(ep, ep_rank)
    pgs.tp_ep = g(etp * ep, etp_rank + etp * ep_rank)
    pgs.tp_ep_pp = g(etp * ep * pp, etp_rank + etp * ep_rank + etp * ep * pp_rank)
    pgs.pp = g(pp, pp_rank)
    pgs.dp = pgs.dp_cp = pgs.intra_dp_cp = g(dp, dp_rank)
    pgs.expt_dp = pgs.intra_expt_dp = g(layout.expert_dp, layout.expert_dp_rank(tp_rank, dp_rank))
    pgs.cp = g(1, 0)
    pgs.mp = g(tp * pp, tp_rank + tp * pp_rank)
    pgs.tp_dp_cp = g(tp * dp, tp_rank + tp * dp_rank)
    pgs.intra_dist_opt = g(layout.size, layout.local_rank(tp_rank, pp_rank, dp_rank))
    pgs.inter_dist_opt = None
    pgs.embd = None
    pgs.pos_embd = None
    return pgs


class _OnMeta(TorchFunctionMode):
    """Every tensor made under it lives on the meta device: explicit devices are rewritten, `.cuda()` / `.to(dev)`
    of a meta tensor stay on meta (the builder moves its model to the GPU where one exists)."""

    _META = torch.device("meta")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.pin_memory) and args[0].is_meta:
            return args[0]
        if func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            rest = [a for a in args[1:] if not isinstance(a, (str, torch.device, int))]
            kwargs.pop("device", None)
            kwargs.pop("non_blocking", None)
            return func(args[0], *rest, **kwargs) if rest or kwargs else args[0]
        if "device" in kwargs:
            kwargs["device"] = self._META
        kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _one_process_world() -> Iterator[None]:
    """Megatron-Core treats every group as size 1 unless torch.distributed is initialized: start a one-process
    gloo world on an in-memory store if there is none, and end it afterwards."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def meta_building() -> Iterator[None]:
    """The context the planner builds modules in: CPU redirections where CUDA is absent (as every job has), a
    one-process world, and the meta device."""
    from megatron_rl import compat

    compat.activate()
    with _one_process_world(), torch.device("meta"), _OnMeta():
        yield


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of a rank's module, as built."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = True
    partition_dim: Optional[int] = None  # None: replicated over TP
    shared_embedding: bool = False  # the tied embedding's copies on the first and last stage (own DDP bucket)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class OptimizerShard:
    """What one DP rank's distributed optimizer (or a whole non-distributed one) holds for a stage.

    param_buffer_bytes / grad_buffer_bytes: Megatron-Core DDP's contiguous buffers, padding included (with the
    distributed optimizer, parameters are re-mapped into the param buffer; without it they stay where the module
    put them and param_buffer_bytes is the parameters' own bytes).
    main_elements: fp32 main-weight elements the optimizer allocates (shards of the 16-bit parameters; fp32
    parameters are their own main weights). state_elements: elements each Adam moment covers (exp_avg and exp_avg_sq
    each have this many fp32 elements). step_tensors: torch Adam's per-parameter `step` scalars (fp32).
    """

    param_buffer_bytes: int
    grad_buffer_bytes: int
    main_elements: int
    state_elements: int
    step_tensors: int

    @property
    def main_bytes(self) -> int:
        return 4 * self.main_elements

    @property
    def optimizer_state_bytes(self) -> int:
        return 2 * 4 * self.state_elements + 4 * self.step_tensors


@dataclass(frozen=True)
class RankModules:
    """The modules one rank builds for an executor: its parameters (and 8-bit weights), plus whatever the planner
    measured on them while they existed."""

    params: tuple[ParamInfo, ...]
    quantized_bytes: int = 0  # int8/fp8 weights and their fp32 row scales (a quantized generator's projections)
    kv_cache_bytes: Optional[int] = None  # generator: the slot KV cache for the planned batch and context
    optimizer: tuple[OptimizerShard, ...] = ()  # trainer: one entry per DP rank
    checkpoint_keys: dict = field(default_factory=dict)  # stacked dist-checkpoint key -> (local name, layers)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def weight_bytes(self) -> int:
        return sum(p.nbytes for p in self.params) + self.quantized_bytes


def _param_infos(model: torch.nn.Module) -> tuple[ParamInfo, ...]:
    out = []
    for name, p in model.named_parameters():
        sharded = bool(getattr(p, "tensor_model_parallel", False))
        out.append(ParamInfo(name, tuple(p.shape), p.dtype, p.requires_grad,
                             getattr(p, "partition_dim", None) if sharded else None,
                             bool(getattr(p, "shared_embedding", False))))
    return tuple(out)


def _is_expert(p: torch.nn.Parameter) -> bool:
    """Megatron-Core's mark of an expert's weight: its DDP reduces it over the expert-data-parallel group."""
    return not getattr(p, "allreduce", True)


def _ddp_buffers(model: torch.nn.Module, dp_group: StandInGroup, distributed: bool, experts: bool = False) -> list:
    """Megatron-Core DDP's buffers over `model`'s dense parameters (`experts`: its experts' instead), grouped as
    its DDP groups them (the trainer's settings: fp32 gradient reduction, no overlap, hence one bucket per
    buffer), over the DP group `dp_group` (for experts: the expert-data-parallel group)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
    from megatron.core.process_groups_config import ProcessGroupCollection

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=distributed)
    groups: dict[tuple, list] = {}
    names = {}
    for name, p in model.named_parameters():
        if p.requires_grad and _is_expert(p) == experts:
            groups.setdefault((p.dtype, torch.float32), []).append(p)
            names[p] = name
    pgs = ProcessGroupCollection()
    pgs.tp, pgs.dp_cp = StandInGroup(1, 0), dp_group
    return [_ParamAndGradBuffer(ddp_config, pdt, gdt, params, dp_group, None, names, 1.0,
                                list(range(len(params))), False, pgs)
            for (pdt, gdt), params in groups.items()]


def _owned(buf, distributed: bool) -> list[tuple[torch.nn.Parameter, int, int]]:
    """(parameter, start, end): the flat range of each of `buf`'s parameters that the optimizer of its DP group's
    current rank owns, in Megatron-Core's order (without the distributed optimizer: every parameter whole)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not distributed:
        return [(p, 0, p.numel()) for p in buf.params]
    ranges = DistributedOptimizer._build_gbuf_range_map(buf)[(buf.param_dtype, buf.grad_dtype)]
    return [(p, m["param"].start, m["param"].end) for bucket in ranges for p, m in bucket["param_map"].items()]


def _optimizer_shards(model: torch.nn.Module, layout: ParallelLayout,
                      distributed: bool) -> tuple[OptimizerShard, ...]:
    """Megatron-Core DDP's buffers over `model`'s parameters and what each DP rank's optimizer holds: dense
    parameters over the DP group, a mixture of experts' over the expert-data-parallel group (the DP rank's place in
    it from the layout's expert grid, for TP rank 0)."""
    dp = layout.dp
    dp_group, expert_group = StandInGroup(dp, 0), StandInGroup(layout.expert_dp, 0)
    buffers = (_ddp_buffers(model, dp_group, distributed)
               + _ddp_buffers(model, expert_group, distributed, experts=True))
    shards = []
    for r in range(dp if distributed else 1):
        dp_group._rank = r
        expert_group._rank = layout.expert_dp_rank(0, r)
        param_bytes = grad_bytes = main = state = steps = 0
        for buf in buffers:
            grad_bytes += buf.numel * buf.grad_dtype.itemsize
            param_bytes += (buf.numel * buf.param_dtype.itemsize if distributed
                            else sum(p.numel() * p.dtype.itemsize for p in buf.params))
            for p, start, end in _owned(buf, distributed):
                if p.dtype != torch.float32:
                    main += end - start
                state += end - start
                steps += 1
        shards.append(OptimizerShard(param_bytes, grad_bytes, main, state, steps))
    return tuple(shards)


def owned_ranges(model: torch.nn.Module, dp: int) -> list[list[tuple[torch.nn.Parameter, int, int]]]:
    """For each rank of a `dp`-way data-parallel group, what its distributed optimizer owns of `model` (a meta
    stage, `stage_model`): (parameter, start, end) flat ranges of the local parameters, in Megatron-Core's order.
    A mixture of experts' expert weights are not among them (`owned_expert_ranges`)."""
    with meta_building():
        dp_group = StandInGroup(dp, 0)
        buffers = _ddp_buffers(model, dp_group, True)
        out = []
        for r in range(dp):
            dp_group._rank = r
            out.append([owned for buf in buffers for owned in _owned(buf, True)])
    return out


def owned_expert_ranges(model: torch.nn.Module, layout: ParallelLayout, tp_rank: int, pp_rank: int,
                        dp_rank: int) -> list[tuple[torch.nn.Parameter, int, int]]:
    """What the distributed optimizer of rank (tp_rank, pp_rank, dp_rank) of `layout` owns of its experts' weights
    (`model`: that rank's meta stage, `stage_model(dp_rank=...)`): Megatron-Core's range map over the experts' DDP
    buffer, split over the rank's expert-data-parallel group (`stand_in_groups`); (parameter, start, end)."""
    with meta_building():
        group = stand_in_groups(layout, tp_rank, pp_rank, dp_rank).expt_dp
        return [owned for buf in _ddp_buffers(model, group, True, experts=True) for owned in _owned(buf, True)]


def _checkpoint_keys(model: torch.nn.Module) -> dict:
    """Stacked dist-checkpoint key of every parameter (Megatron's layer-spec key map applied, layer index dropped):
    {key: (local parameter name, stacked over layers?)}."""
    keys = {}
    layer_maps = {}
    decoder = getattr(model, "decoder", None)
    for i, layer in enumerate(getattr(decoder, "layers", [])):
        layer_maps[i] = getattr(getattr(layer, "submodules_config", None), "sharded_state_dict_keys_map", {}) or {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        if name.startswith("decoder.layers.") and parts[2].isdigit():
            suffix = ".".join(parts[3:])
            for old, new in layer_maps.get(int(parts[2]), {}).items():
                if suffix.startswith(old):
                    suffix = new + suffix[len(old):]
                    break
            keys.setdefault(f"decoder.layers.{suffix}", (name, True))
        else:
            keys[name] = (name, False)
    return keys


def build_rank_modules(model_cfg: ModelConfig, layout: ParallelLayout, *, tp_rank: int = 0, pp_rank: int = 0,
                       params_dtype: torch.dtype = torch.float32, attention: str = "auto",
                       quantization: str = "none", optimizer: Optional[bool] = None,
                       kv_cache: Optional[tuple[int, int]] = None) -> RankModules:
    """Build the stage at (tp_rank, pp_rank) of `layout` on the meta device, as the job builds it.

    optimizer: None (no optimizer), True / False: Megatron-Core DDP buffers and the (distributed when True)
    optimizer's shards for every DP rank. quantization: "none", or a generator's "int8" / "fp8" weights. kv_cache:
    (slots, max_len) to size the generator's slot KV cache with its own allocator
    (`IncrementalForward.allocate_cache`). Cached: the same arguments return the same result.
    """
    return _build_cached(dataclasses.astuple(model_cfg), layout, tp_rank, pp_rank, params_dtype, attention,
                         quantization, optimizer, kv_cache)


def stage_model(model_cfg: ModelConfig, layout: ParallelLayout, *, tp_rank: int = 0, pp_rank: int = 0,
                params_dtype: torch.dtype = torch.float32, attention: str = "auto",
                dp_rank: int = 0) -> torch.nn.Module:
    """The meta-device GPTModel stage at (tp_rank, pp_rank) of `layout` that `build_rank_modules` measures (the
    same cached object: read it, and hand it to `owned_ranges`, which only re-points its parameters). `dp_rank`
    matters to a mixture of experts only: the experts a rank holds follow its place in the expert grid."""
    return _stage_cached(dataclasses.astuple(model_cfg), layout.tp, layout.pp, layout.ep, layout.etp, tp_rank,
                         pp_rank, params_dtype, attention, "none", None, dp_rank % _least_dp(layout))[0]


def _least_dp(layout: ParallelLayout) -> int:
    """The least DP that holds `layout`'s expert grid (1 for a dense layout): a stage's modules are the same at every
    DP, and DP ranks congruent modulo it hold the same experts (`ParallelLayout.expert_coords`)."""
    return math.lcm(layout.tp, layout.etp * layout.ep) // layout.tp


@functools.lru_cache(maxsize=64)
def _build_cached(model_fields: tuple, layout: ParallelLayout, tp_rank: int, pp_rank: int,
                  params_dtype: torch.dtype, attention: str, quantization: str, optimizer: Optional[bool],
                  kv_cache: Optional[tuple[int, int]]) -> RankModules:
    model, quantized_bytes, kv_bytes, params, keys = _stage_cached(
        model_fields, layout.tp, layout.pp, layout.ep, layout.etp, tp_rank, pp_rank, params_dtype, attention,
        quantization, kv_cache)
    with meta_building():  # DDP's buffers over the stage's parameters, on the meta device (each DP its own)
        shards = () if optimizer is None else _optimizer_shards(model, layout, optimizer)
    return RankModules(params, quantized_bytes, kv_bytes, shards, keys)


@functools.lru_cache(maxsize=16)
def _stage_cached(model_fields: tuple, tp: int, pp: int, ep: int, etp: int, tp_rank: int, pp_rank: int,
                  params_dtype: torch.dtype, attention: str, quantization: str,
                  kv_cache: Optional[tuple[int, int]], dp_rank: int = 0) -> tuple:
    """One pipeline stage's meta modules, which do not depend on the data-parallel degree: built once for every DP
    that `_build_cached` asks of it (the plan's synchronous baseline takes the trainer's TP x PP at another DP,
    and rebuilt every stage: 2.7 of the 20 s that the four recipes' plans took on the 2-core test machine).
    Reusing the model is safe: `_optimizer_shards` only re-points its parameters into each DP's meta buffers (the
    plans of all 8 recipes came out identical). Built as `build_gpt_model(initialize=False)` builds, so that
    Megatron-Core's initializer still sets each weight's tensor-parallel split (`perform_initialization=False`
    skipped it, and every `ParamInfo.partition_dim` was None). Returns (model, quantized bytes, KV-cache bytes,
    parameter infos, checkpoint keys)."""
    from megatron_rl.models.builder import build_gpt_model

    model_cfg = ModelConfig(*model_fields)
    # The least DP that holds the expert grid (the stage is the same at every DP; `dp_rank` names the experts).
    layout = ParallelLayout(tp, pp, 1, ep=ep, etp=etp)
    layout = dataclasses.replace(layout, dp=_least_dp(layout))
    build = dict(attention=attention, params_dtype=params_dtype, fusions="none", initialize=False)
    pgs = stand_in_groups(layout, tp_rank, pp_rank, dp_rank)
    with meta_building():
        if quantization != "none":
            from megatron_rl.inference.quantized import _linear_weights_on_meta, quantize_generator

            with _linear_weights_on_meta():
                model = build_gpt_model(model_cfg, layout, pgs, **build)
            targets = quantize_generator(model, model_cfg, layout, pp_rank, tp_rank, device=torch.device("meta"),
                                         fmt=quantization)
            quantized_bytes = sum(w.nbytes for w in targets.values())
        else:
            model = build_gpt_model(model_cfg, layout, pgs, **build)
            quantized_bytes = 0
        kv_bytes = None
        if kv_cache is not None:
            from megatron_rl.inference.kv_forward import IncrementalForward

            kv_bytes = IncrementalForward(model, pgs.tp).allocate_cache(*kv_cache).nbytes()
        return model, quantized_bytes, kv_bytes, _param_infos(model), _checkpoint_keys(model)

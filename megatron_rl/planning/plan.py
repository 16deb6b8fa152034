"""`megatron-rl plan`: what the job `megatron-rl train` would start needs, before it starts.

    plan = make_plan(cfg, model, load_calibration())      # cfg, model: load_config + validate, as `train` does
    plan.to_dict()                                          # the JSON object; report.format_text(plan) the table

For the configured layouts it builds every distinct rank's modules on the meta device (`planning.meta`), adds the
memory model (`planning.memory`), plans the DDMA sync with the job's own planner (`ddma.planner`) and predicts the
step time of both modes (`planning.steptime`) from a calibration (`planning.calibration`). With a checkpoint it
says, from metadata alone (`checkpointing.inspect`), whether the trainer layout can load it and what each rank reads.

The synchronous baseline is the paper's colocated one: the same GPUs (trainer and generator together) train with
the trainer's TP x PP, and generate with that same layout in the generator's dtype, in the memory the trainer's
resident state leaves. Ranks beyond a whole number of trainer replicas stay idle there.

A reward model on ranks of its own (`reward.executor.dp` >= 1) adds its tp x dp GPUs to the job's count and a
third executor to the memory report: each rank's GPTModel shard built on the meta device as
`rewards.sequence_classifier.ParallelRewardModel` builds it (tied embeddings, no output layer, the generator's
dtype) plus its replicated fp32 head, a scoring workspace (`_scoring_workspace_bytes`) and the reserve. It is in
neither step time: it scores each batch as it arrives, overlapping generation and training, and the synchronous
baseline is the trainer's and generator's GPUs, as in the paper.

Where the plan depends on a rule of the job, it calls the job's own function, so that the two cannot drift apart:
the trainer's padding and packing (`training.rl_trainer.padded_seq_len`, `micro_batch_rows`), the generator's
attention (`inference.settings.GeneratorSettings.model_attention`), the reward model's body and scoring batch
(`rewards.sequence_classifier.body_config`, `BODY_ATTENTION`, `SCORING_BATCH_SIZE`, `scoring_max_length`), the
modules themselves (built by the job's builders, `planning.meta`) and the DDMA plan (`ddma.planner`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from megatron_rl.config import JobConfig
from megatron_rl.inference.settings import KV_BLOCK_SIZE
from megatron_rl.models.presets import ModelConfig
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.planning.calibration import Calibration
from megatron_rl.planning.checkpoint import ReshardError, checkpoint_cost, checkpoint_report
from megatron_rl.planning.memory import RankMemory, activation_bytes, prefill_workspace_bytes
from megatron_rl.planning.meta import RankModules, build_rank_modules
from megatron_rl.planning.steptime import (GeneratorShape, ModelCost, StepTimes, TrainerShape, Workload,
                                          generation_time, group_link_gbps, training_time, weight_sync_time)

GIB = 1 << 30


class PlanError(ValueError):
    """An input `plan` cannot work with; the message is one line naming it."""


@dataclass(frozen=True)
class ExecutorMemory:
    """Every distinct rank of one executor (the worst DP rank of each pipeline stage) against the device."""

    name: str
    layout: str
    ranks: tuple[RankMemory, ...]
    device_bytes: int

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)

    @property
    def fits(self) -> bool:
        return self.worst.total <= self.device_bytes

    def to_dict(self) -> dict:
        w = self.worst
        return {"layout": self.layout, "fits": self.fits, "peak_bytes": w.total, "peak_rank": w.rank,
                "margin_bytes": w.margin(self.device_bytes),
                "ranks": [{"rank": r.rank, "total_bytes": r.total, **{f"{k}_bytes": v for k, v in r.parts.items()}}
                          for r in self.ranks]}


@dataclass(frozen=True)
class SyncEstimate:
    """The DDMA plan for this layout pair: the busiest rank's bytes and the time at each link."""

    senders: int
    copies: int
    network_bytes: int
    max_sent_bytes: int
    max_received_bytes: int
    seconds: dict  # link name -> seconds

    @property
    def busiest_bytes(self) -> int:
        return max(self.max_sent_bytes, self.max_received_bytes)

    def to_dict(self) -> dict:
        return {"senders": self.senders, "copies": self.copies, "network_bytes": self.network_bytes,
                "max_sent_bytes": self.max_sent_bytes, "max_received_bytes": self.max_received_bytes,
                "busiest_rank_bytes": self.busiest_bytes, "seconds": self.seconds}


@dataclass(frozen=True)
class Plan:
    """Everything `megatron-rl plan` reports."""

    model: str
    parameters: int
    trainer: ExecutorMemory
    generator: ExecutorMemory
    colocated: bool
    sync: SyncEstimate
    steps: StepTimes
    assumptions: dict
    calibration: Calibration
    checkpoint: Optional[dict] = None
    notes: list = field(default_factory=list)
    reward_model: Optional[ExecutorMemory] = None  # the reward model's own ranks (reward.executor.dp >= 1)
    checkpointing: Optional[dict] = None  # what a save and a load cost (`planning.checkpoint.checkpoint_cost`)

    @property
    def fits(self) -> bool:
        return self.trainer.fits and self.generator.fits and (self.reward_model is None or self.reward_model.fits)

    def to_dict(self) -> dict:
        cal = self.calibration
        return {"model": self.model, "parameters": self.parameters, "fits": self.fits,
                "gpu_memory_bytes": self.trainer.device_bytes, "colocated": self.colocated,
                "memory": {"trainer": self.trainer.to_dict(), "generator": self.generator.to_dict(),
                           **({"reward_model": self.reward_model.to_dict()} if self.reward_model else {})},
                "weight_sync": self.sync.to_dict(), "step_time": self.steps.to_dict(),
                "assumptions": self.assumptions, "checkpoint": self.checkpoint,
                "checkpointing": self.checkpointing, "notes": list(self.notes),
                "calibration": {"device": cal.device, **{k: {"value": getattr(cal, k), "source": s}
                                                         for k, s in cal.sources.items()}}}


def executor_dtype(name: str, cal: Calibration) -> torch.dtype:
    """An executor's parameter dtype. "auto" is resolved for the machine the job runs on: the calibrated GPU
    (bf16 on every GPU the calibration files describe), or this machine when planning a CPU job."""
    from megatron_rl.models.precision import DTYPES, resolve_dtype

    return DTYPES["bf16"] if name == "auto" and cal.fused_kernels else resolve_dtype(name)


def model_cost(model: ModelConfig) -> ModelCost:
    """Matmul weights per token from the logical parameters (every 2-D weight; the embedding counts once more as the
    output layer when tied, since the logits multiply it). A mixture of experts runs `moe_router_topk` experts
    per token: the FLOPs follow its active weights (as many as its first top-k experts have), not all of them."""
    from megatron_rl.models.param_spec import EMBEDDING, model_params

    n = sum(p.numel for p in model_params(model) if len(p.shape) == 2 and p.name != EMBEDDING
            and (p.expert is None or p.expert < model.moe_router_topk))
    if model.tie_word_embeddings:
        n += model.vocab_size * model.hidden_size
    return ModelCost(n, model.num_layers, model.hidden_size, model.num_attention_heads * model.kv_channels)


def workload(cfg: JobConfig) -> Workload:
    """Every sequence at its longest: a response of `rollout.max_new_tokens`, or an episode (`env.cls`) of
    `env.max_tokens` after its prompt (the model's tokens and the environments' together)."""
    r = cfg.rollout
    return Workload(r.prompts_per_step * r.samples_per_prompt, r.max_prompt_length, cfg.response_budget)


def _trainer_batch(cfg: JobConfig, dp: int) -> tuple[int, int, int]:
    """(sequence length, sequences per micro-batch, micro-batches) of one trainer DP rank, every sequence at its
    longest, as `RLTrainer.step` pads or packs them. Packed (`training.packing`), a micro-batch holds as many
    longest sequences as its token budget does (by default as many as a padded one: at the longest, packing
    changes nothing; its gain is at a spread of lengths, benchmarks/long_sequences.py)."""
    from megatron_rl.training.rl_trainer import micro_batch_rows, padded_seq_len

    w = workload(cfg)
    seq = padded_seq_len(w.seq_len)
    per_dp = -(-w.sequences // dp)
    t = cfg.trainer
    limit = max(t.max_tokens_per_micro_batch // w.seq_len, 1) if t.packing and t.max_tokens_per_micro_batch \
        else t.micro_batch_size
    rows = micro_batch_rows(per_dp, limit)
    return seq, rows, -(-per_dp // rows)


def _trainer_memory(cfg: JobConfig, model: ModelConfig, layout: ParallelLayout, cal: Calibration,
                    stages: list[RankModules], staging: int) -> tuple[RankMemory, ...]:
    dtype = executor_dtype(cfg.trainer.dtype, cal)
    seq, rows, m = _trainer_batch(cfg, layout.dp)
    ranks = []
    for pp_rank, mods in enumerate(stages):
        act = activation_bytes(model, layout.tp, layout.pp, pp_rank, rows, seq, m, dtype.itemsize,
                               cal.fused_kernels)
        worst = max(range(len(mods.optimizer)), key=lambda d: (mods.optimizer[d].main_bytes
                                                               + mods.optimizer[d].optimizer_state_bytes))
        o = mods.optimizer[worst]
        ranks.append(RankMemory("trainer", f"pp {pp_rank}, dp {worst}", {
            "parameters": o.param_buffer_bytes, "gradients": o.grad_buffer_bytes, "main_weights": o.main_bytes,
            "optimizer_state": o.optimizer_state_bytes, "activations": act, "ddma_staging": staging,
            "reserve": int(cal.reserve_gib * GIB)}))
    return tuple(ranks)


def _generator_slots(cfg: JobConfig, replicas: int) -> int:
    """The KV-cache slots a replica's generator allocates for a step, as the job's `Generator` does: its samples,
    at most `generator.max_batch_size`."""
    return min(cfg.generator.max_batch_size, cfg.rollout.samples_per_replica(replicas))


def _generator_memory(cfg: JobConfig, model: ModelConfig, layout: ParallelLayout, cal: Calibration,
                      mods: RankModules, staging: int, pp_rank: int = 0) -> RankMemory:
    """One generator rank of stage `pp_rank` (every DP and TP rank of a stage holds the same bytes). Each stage
    holds its layers and their KV cache for every slot; the prefill workspace is counted for a whole batch of
    prompts, as on a one-stage generator (an upper bound: a stage prefills one lane of slots at a time)."""
    quantized = cfg.generator.quantization != "none"
    work = prefill_workspace_bytes(model, layout.tp, cfg.generator.max_batch_size, cfg.rollout.max_prompt_length,
                                   executor_dtype(cfg.generator.dtype, cal).itemsize, quantized)
    return RankMemory("generator", "every rank" if layout.pp == 1 else f"pp {pp_rank}", {
        "weights": mods.weight_bytes, "kv_cache": _kv_cache_bytes(cfg, mods), "prefill_workspace": work,
        "ddma_staging": staging, "reserve": int(cal.reserve_gib * GIB)})


def _kv_cache_bytes(cfg: JobConfig, mods: RankModules) -> int:
    """A generator rank's KV cache: its slot cache as built (`max_batch_size` x the longest sequence), or a paged
    one of `generator.kv_cache_tokens` (in blocks of KV_BLOCK_SIZE, and the scratch block:
    `kv_forward.PagedKVCache`)."""
    tokens = cfg.generator.kv_cache_tokens
    if not tokens:
        return mods.kv_cache_bytes
    per_token = mods.kv_cache_bytes / (cfg.generator.max_batch_size * cfg.episode_length)
    return int(per_token * KV_BLOCK_SIZE * (1 + -(-tokens // KV_BLOCK_SIZE)))


def _what_fits(cfg: JobConfig, model: ModelConfig, cal: Calibration, stages: list[RankModules],
               gen_stages: list[RankModules], staging: int, device_bytes: int) -> list[str]:
    """For an executor on ranks of its own that does not fit: the largest batch that does, everything else as
    configured (one note each): the trainer's micro-batch (`trainer.micro_batch_size`, or the packed budget
    `trainer.max_tokens_per_micro_batch` where it is set), the generator's slots (`generator.max_batch_size`, whose
    KV cache and prefill workspace scale with it); or that none does, and what else to change."""
    import dataclasses

    notes, t, g = [], cfg.trainer, cfg.generator
    tl, gl = t.layout, g.layout
    peak = lambda ranks: max(r.total for r in ranks)  # noqa: E731
    if peak(_trainer_memory(cfg, model, tl, cal, stages, staging)) > device_bytes:
        seq = workload(cfg).seq_len
        budget = t.packing and t.max_tokens_per_micro_batch
        for rows in range(max(budget // seq, 1) if budget else t.micro_batch_size, 0, -1):
            fix = {"max_tokens_per_micro_batch": rows * seq} if budget else {"micro_batch_size": rows}
            c = dataclasses.replace(cfg, trainer=dataclasses.replace(t, **fix))
            top = peak(_trainer_memory(c, model, tl, cal, stages, staging))
            if top <= device_bytes:
                (name, value), = fix.items()
                notes.append(f"the trainer fits with trainer.{name}={value} (peak {top / GIB:.1f} GiB)")
                break
        else:
            notes.append(f"the trainer does not fit even one sequence of {seq} tokens a micro-batch: raise trainer.tp "
                         f"or trainer.pp, or shorten the sequences")
    gen_peak = max(_generator_memory(cfg, model, gl, cal, m, staging, p).total for p, m in enumerate(gen_stages))
    if not g.colocated and gen_peak > device_bytes and g.kv_cache_tokens:
        worst = max(gen_stages, key=lambda m: m.kv_cache_bytes or 0)
        per_token = (worst.kv_cache_bytes or 0) / (g.max_batch_size * cfg.episode_length)
        room = (device_bytes - gen_peak + _kv_cache_bytes(cfg, worst)) // per_token - KV_BLOCK_SIZE if per_token else 0
        tokens = int(room) // KV_BLOCK_SIZE * KV_BLOCK_SIZE
        notes.append(f"the generator fits with generator.kv_cache_tokens={tokens}" if tokens >= cfg.episode_length
                     else f"the generator does not fit one sequence of {cfg.episode_length} tokens: raise "
                          f"generator.tp or generator.pp, or quantize its weights (generator.quantization)")
    elif not g.colocated and gen_peak > device_bytes:
        for slots in range(g.max_batch_size - 1, 0, -1):
            c = dataclasses.replace(cfg, generator=dataclasses.replace(g, max_batch_size=slots))
            scaled = [dataclasses.replace(m, kv_cache_bytes=(m.kv_cache_bytes or 0) * slots // g.max_batch_size)
                      for m in gen_stages]
            top = max(_generator_memory(c, model, gl, cal, m, staging, p).total for p, m in enumerate(scaled))
            if top <= device_bytes:
                notes.append(f"the generator fits with generator.max_batch_size={slots} (peak {top / GIB:.1f} GiB; "
                             f"each slot's KV cache holds {cfg.episode_length} tokens)")
                break
        else:
            notes.append(f"the generator does not fit one sequence of {cfg.episode_length} tokens: raise generator.tp "
                         f"or generator.pp, or quantize its weights (generator.quantization)")
    return notes


def _sync_estimate(model: ModelConfig, trainer: ParallelLayout, generator: ParallelLayout, colocated: bool,
                   stages: list[RankModules], cal: Calibration) -> SyncEstimate:
    """Bytes per rank of the job's DDMA plan; every slice travels in its source parameter's dtype (the job's
    TransportSettings: no wire dtype)."""
    from megatron_rl.ddma.planner import plan_reshard

    try:
        plan = plan_reshard(model, trainer, generator, src_first_rank=0,
                            dst_first_rank=0 if colocated else trainer.size)
    except ValueError as e:
        raise PlanError(str(e)) from None
    itemsize = [{p.name: p.dtype.itemsize for p in mods.params} for mods in stages]
    stage_of = {r: plan.src.coords(r)[1] for r in plan.src.ranks}
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    network = 0
    for c in plan.copies:
        if c.is_local:
            continue
        nbytes = c.numel * itemsize[stage_of[c.src_rank]][c.src_param]
        sent[c.src_rank] = sent.get(c.src_rank, 0) + nbytes
        received[c.dst_rank] = received.get(c.dst_rank, 0) + nbytes
        network += nbytes
    busiest = max(max(sent.values(), default=0), max(received.values(), default=0))
    seconds = {"nvlink": weight_sync_time(busiest, cal.nvlink_gbps),
               "infiniband": weight_sync_time(busiest, cal.infiniband_gbps)}
    return SyncEstimate(len(sent), len(plan.copies), network, max(sent.values(), default=0),
                        max(received.values(), default=0), seconds)


def _build_trainer(cfg: JobConfig, model: ModelConfig, layout: ParallelLayout, cal: Calibration) -> list[RankModules]:
    return [build_rank_modules(model, layout, pp_rank=p, params_dtype=executor_dtype(cfg.trainer.dtype, cal),
                               attention=cfg.trainer.attention,
                               optimizer=cfg.trainer.use_distributed_optimizer) for p in range(layout.pp)]


def _build_generator(cfg: JobConfig, model: ModelConfig, layout: ParallelLayout, cal: Calibration,
                     pp_rank: int = 0) -> RankModules:
    max_len = cfg.episode_length
    return build_rank_modules(model, layout, pp_rank=pp_rank, params_dtype=executor_dtype(cfg.generator.dtype, cal),
                              attention=cfg.generator.model_attention, quantization=cfg.generator.quantization,
                              kv_cache=(cfg.generator.max_batch_size, max_len))


def _scoring_workspace_bytes(model: ModelConfig, tp: int, batch: int, context: int, itemsize: int) -> int:
    """Transient bytes of the reward model scoring `batch` sequences of `context` tokens at once (no gradients): one
    layer's activations for those tokens as `prefill_workspace_bytes` models a prefill (the layer's input and
    output, QKV, the attention output, the MLP's three f-sized tensors; no s x s scores), and no logits (no LM
    head; the fp32 head reads one hidden state per sequence)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    q, kv = model.num_attention_heads * model.kv_channels, model.num_query_groups * model.kv_channels
    return batch * context * itemsize * (2 * h + (q + 2 * kv) // tp + q // tp + 3 * f // tp)


def _reward_model_memory(cfg: JobConfig, cal: Calibration, device_bytes: int) -> tuple[ExecutorMemory, dict]:
    """The reward-model executor's ranks (every TP and DP rank holds the same bytes) and what the numbers rest on.

    Weights: this TP rank's GPTModel as `ParallelRewardModel` builds it (tied embeddings, hence no output-layer
    weight, and its output layer dropped), on the meta device in the generator's dtype, plus the replicated fp32
    head [1, hidden]. Workspace: `_scoring_workspace_bytes` for one batch of the executor's `SCORING_BATCH_SIZE`
    sequences of rollout.max_prompt_length + rollout.max_new_tokens tokens (at most `scoring_max_length`, by
    default the reward model's max_position_embeddings)."""
    from megatron_rl.rewards.sequence_classifier import (BODY_ATTENTION, SCORING_BATCH_SIZE, SCORING_MAX_LENGTH,
                                                         body_config, reward_model_config, scoring_max_length)

    e = cfg.reward.executor
    try:
        rm = body_config(reward_model_config(cfg.reward.model, e.tp))
    except ValueError as err:
        raise PlanError(str(err).splitlines()[0]) from None
    dtype = executor_dtype(cfg.generator.dtype, cal)
    mods = build_rank_modules(rm, e.layout, params_dtype=dtype, attention=BODY_ATTENTION)
    head = 4 * rm.hidden_size
    weights = sum(p.nbytes for p in mods.params if not p.name.startswith("output_layer.")) + head
    batch, max_length = SCORING_BATCH_SIZE, scoring_max_length(rm, SCORING_MAX_LENGTH)
    context = min(cfg.rollout.context_length, max_length)
    work = _scoring_workspace_bytes(rm, e.tp, batch, context, dtype.itemsize)
    rank = RankMemory("reward model", "every rank", {"weights": weights, "scoring_workspace": work,
                                                     "reserve": int(cal.reserve_gib * GIB)})
    info = {"path": cfg.reward.model, "parameters": rm.num_parameters() + rm.hidden_size, "gpus": e.tp * e.dp,
            "weight_bytes_per_rank": weights,
            "scoring_workspace": {"batch_size": batch, "context_tokens": context,
                                  "model": "one layer's activations for batch_size x context tokens (no s x s "
                                           "scores, no logits)"},
            "step_time": "not modelled: it scores each batch as it arrives, overlapping generation and training"}
    return ExecutorMemory("reward model", f"tp={e.tp},dp={e.dp}", (rank,), device_bytes), info


def _trainer_shape(cfg: JobConfig, layout: ParallelLayout, stages: list[RankModules], rows: int,
                   cal: Calibration) -> TrainerShape:
    """The trainer as the step model sees it: its busiest stage's DDP buffers and each group's link."""
    opt = [o for s in stages for o in s.optimizer]
    tp, dp = layout.tp, layout.dp
    return TrainerShape(tp, layout.pp, dp, rows, executor_dtype(cfg.trainer.dtype, cal).itemsize,
                        grad_buffer_bytes=max(o.grad_buffer_bytes for o in opt),
                        param_buffer_bytes=max(o.param_buffer_bytes for o in opt),
                        distributed_optimizer=cfg.trainer.use_distributed_optimizer,
                        tp_link_gbps=group_link_gbps(1, tp, cal), dp_link_gbps=group_link_gbps(tp, dp, cal),
                        pp_link_gbps=group_link_gbps(tp * dp, layout.pp, cal))


def _colocated_baseline(cfg: JobConfig, model: ModelConfig, trainer: ParallelLayout, gpus: int,
                        cal: Calibration, device_bytes: int, cost: ModelCost, w: Workload):
    """The synchronous baseline on `gpus` GPUs: the trainer's TP x PP, as many DP replicas as fit, generating with
    the same layout in the memory the trainer's state leaves (module docstring)."""
    dp = gpus // (trainer.tp * trainer.pp)
    if dp < 1:
        raise PlanError(f"the synchronous baseline needs at least trainer.tp*pp={trainer.tp * trainer.pp} GPUs")
    layout = ParallelLayout(trainer.tp, trainer.pp, dp, ep=trainer.ep if dp % trainer.ep == 0 else 1)
    stages = _build_trainer(cfg, model, layout, cal)
    resident = max(max(o.param_buffer_bytes + o.grad_buffer_bytes + o.main_bytes + o.optimizer_state_bytes
                       for o in s.optimizer) for s in stages)
    gen = _build_generator(cfg, model, ParallelLayout(trainer.tp, 1, dp), cal)
    weights = gen.weight_bytes / trainer.pp  # the stage's share of the layers (embedding/output: an average)
    kv_token = gen.kv_cache_bytes / (cfg.generator.max_batch_size * w.seq_len) / trainer.pp
    free = device_bytes - int(cal.reserve_gib * GIB) - resident - weights
    memory_slots = int(free // (kv_token * w.seq_len)) if free > 0 else 0
    if memory_slots < 1:
        raise PlanError(f"the synchronous baseline cannot generate: the trainer's state leaves no room for a KV "
                        f"cache on a {device_bytes / GIB:.0f} GiB GPU")
    slots = min(_generator_slots(cfg, dp), memory_slots)  # the job's batch setting, where memory allows
    seq, rows, _ = _trainer_batch(cfg, dp)
    g = GeneratorShape(trainer.tp, trainer.pp, dp, slots, int(weights), kv_token,
                       sequences_per_replica=cfg.rollout.samples_per_replica(dp))
    t = _trainer_shape(cfg, layout, stages, rows, cal)
    detail = {"layout": str(layout), "gpus_used": layout.size, "resident_trainer_bytes": resident,
              "kv_slots_memory_allows": memory_slots}
    return (generation_time(w, cost, g, cal, cal.baseline_decode_efficiency), training_time(w, cost, t, cal),
            detail)


def predict_steps(cfg: JobConfig, model: ModelConfig, cal: Calibration, device_bytes: int, gen: RankModules,
                  sync: SyncEstimate, stages: list[RankModules]) -> tuple[StepTimes, dict, list]:
    """Step times of both modes for the job `cfg`, given its generator's modules (its heaviest pipeline stage's)
    and its DDMA estimate; returns (times, the assumptions they rest on, notes)."""
    tl = cfg.trainer.layout
    gl = cfg.generator.layout
    colocated = cfg.generator.colocated
    w, cost = workload(cfg), model_cost(model)
    gpus = tl.size if colocated else tl.size + gl.size
    sync_gen, sync_train, baseline = _colocated_baseline(cfg, model, tl, gpus, cal, device_bytes, cost, w)
    seq, rows, _ = _trainer_batch(cfg, tl.dp)
    max_len = cfg.episode_length
    kv_token = gen.kv_cache_bytes / (cfg.generator.max_batch_size * max_len)
    gshape = GeneratorShape(gl.tp, gl.pp, gl.dp, _generator_slots(cfg, gl.dp), gen.weight_bytes, kv_token,
                            micro_batches=gl.pp, sequences_per_replica=cfg.rollout.samples_per_replica(gl.dp))
    async_gen = generation_time(w, cost, gshape, cal, cal.decode_efficiency)
    async_train = training_time(w, cost, _trainer_shape(cfg, tl, stages, rows, cal), cal)
    notes = []
    if colocated:
        # Executors on the same GPUs cannot overlap: the configured job's step is the sum of its phases.
        link_s = sync.seconds["nvlink"]
        async_gen = type(async_gen)(async_gen.seconds + async_train.seconds, async_gen.detail)
        notes.append("colocated executors share their GPUs: the asynchronous step does not overlap generation "
                     "and training")
    else:
        link_s = sync.seconds["infiniband"] if gpus > cal.gpus_per_node else sync.seconds["nvlink"]
    steps = StepTimes(sync_gen, sync_train, async_gen, async_train, link_s)
    assumptions = {
        "workload": {"sequences": w.sequences, "prompt_tokens": w.prompt_tokens, "response_tokens": w.response_tokens,
                     "responses": "every response runs to rollout.max_new_tokens"},
        "gpus": gpus, "sync_baseline": baseline,
        "weight_sync_link": "nvlink" if colocated or gpus <= cal.gpus_per_node else "infiniband",
        "trainer_micro_batch": {"rows": rows, "seq_len": seq},
        "activation_model": "fused" if cal.fused_kernels else "unfused",
    }
    return steps, assumptions, notes


def make_plan(cfg: JobConfig, model: ModelConfig, calibration: Calibration, *,
              gpu_memory_gib: Optional[float] = None, checkpoint: Optional[Path] = None) -> Plan:
    """Plan the job `cfg` (already validated into `model`) on devices described by `calibration`."""
    from megatron_rl.ddma.transport import TransportSettings

    cal = calibration
    gib = cal.gpu_memory_gib if gpu_memory_gib is None else gpu_memory_gib
    if not (isinstance(gib, (int, float)) and math.isfinite(gib) and gib > 0):
        raise PlanError(f"--gpu-memory {gib!r} is not a device memory size: give GiB per GPU, e.g. 80")
    device_bytes = int(gib * GIB)
    tl = cfg.trainer.layout
    gl = cfg.generator.layout
    colocated = cfg.generator.colocated
    staging = TransportSettings().bucket_bytes
    stages = _build_trainer(cfg, model, tl, cal)
    gen_stages = [_build_generator(cfg, model, gl, cal, pp_rank=p) for p in range(gl.pp)]
    trainer_ranks = _trainer_memory(cfg, model, tl, cal, stages, staging)
    gen_ranks = tuple(_generator_memory(cfg, model, gl, cal, mods, staging, pp_rank=p)
                      for p, mods in enumerate(gen_stages))
    gen_worst = max(range(gl.pp), key=lambda p: gen_ranks[p].total)
    if colocated:  # the same ranks hold both executors: each rank carries the generator's bytes too (its worst stage)
        shared = {f"generator_{k}": v for k, v in gen_ranks[gen_worst].parts.items() if k != "reserve"}
        trainer_ranks = tuple(RankMemory("trainer+generator", r.rank, {**r.parts, **shared})
                              for r in trainer_ranks)
    trainer_mem = ExecutorMemory("trainer", str(tl), trainer_ranks, device_bytes)
    gen_mem = ExecutorMemory("generator", str(gl), gen_ranks, device_bytes)
    sync = _sync_estimate(model, tl, gl, colocated, stages, cal)

    steps, assumptions, notes = predict_steps(cfg, model, cal, device_bytes, gen_stages[gen_worst], sync, stages)
    if not colocated:
        notes = _what_fits(cfg, model, cal, stages, gen_stages, staging, device_bytes) + notes
    reward_mem = None
    if cfg.reward.model_executor:  # its GPUs are the job's; both step times leave it out (module docstring)
        reward_mem, assumptions["reward_model"] = _reward_model_memory(cfg, cal, device_bytes)
        n = assumptions["reward_model"]["gpus"]
        notes.append(f"the reward model's {n} GPU{'s are' if n > 1 else ' is'} in neither step time (it scores "
                     f"each batch as it arrives, overlapping generation and training); the sync baseline runs on the "
                     f"trainer's and generator's {assumptions['gpus']} GPUs")
        assumptions["gpus"] += n
    ckpt = None
    if checkpoint is not None:
        try:
            ckpt = checkpoint_report(Path(checkpoint), model, tl, stages)
        except ReshardError as e:
            raise PlanError(str(e)) from None
    return Plan(model.name, model.num_parameters(), trainer_mem, gen_mem, colocated, sync, steps, assumptions,
                cal, ckpt, notes, reward_mem, checkpoint_cost(cfg, model, stages, cal))

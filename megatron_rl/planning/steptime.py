"""Time of one RL step, synchronous and asynchronous, from the workload, the model's FLOPs and bytes, and rates.

The model (every rate comes from a `Calibration`, every size from the planned layout's real modules):

generation, per generator replica (all replicas run in parallel; the busiest sets the time):
    seqs     = the busiest replica's sequences: the job gives each replica whole prompts, ceil(prompts /
               replicas) x samples (`RolloutSettings.samples_per_replica`; without it, ceil(sequences / replicas)),
    slots    = min(slots the batch and memory allow, seqs)
    decode   = ceil(seqs / slots) x response_tokens steps; each step reads every weight of a GPU once and the KV
               cache of its slots at the mean context (prompt + response / 2), at hbm_bandwidth x decode_efficiency
               (baseline_decode_efficiency for the synchronous baseline's engine);
               a replica with pp stages runs them one after another for every token (x pp)
    prefill  = 2 x matmul parameters x prompt tokens (+ attention) at prefill_mfu of the replica's tp GPUs
    Every response is taken to run to `response_tokens` (the cap), so a wave lasts as long as its longest member.
training, per trainer DP replica (the replicas run in parallel on equal shares of the step's sequences):
    FLOPs    = 3 x (2 x matmul parameters + 2 x layers x hidden x seq) per token (forward + backward; causal
               attention at its mean length) over sequences x (prompt + response) tokens
    compute  = FLOPs / (trainer GPUs x peak x train_mfu)   (train_mfu is measured on one GPU: no communication)
    tp       = per micro-batch and layer, 4 all-reduces of the micro-batch's activations (rows x seq x hidden in
               the trainer's dtype): the outputs of the attention and MLP blocks forward, the input gradients of
               their column-parallel linears backward. A ring all-reduce moves 2 (tp - 1) / tp of those bytes per
               GPU. Exposed: Megatron-Core overlaps TP communication only through transformer-engine, which the
               job does not use, and without sequence parallelism nothing shrinks them.
    p2p      = per micro-batch and stage, one activation-sized transfer forward (activations) and one backward
               (their gradients) between neighbouring stages, blocking in Megatron-Core's 1F1B schedule (every TP
               rank sends the whole tensor: no sequence parallelism)
    time     = (m + pp - 1) x (compute + tp + p2p per micro-batch and stage)      (1F1B, m micro-batches)
    dp       = after the last micro-batch: the gradient buffer reduce-scattered (fp32, `grad_reduce_in_fp32`,
               not overlapped: training/engine.py) and, after the optimizer step, the parameter buffer all-gathered,
               (dp - 1) / dp of each per GPU (distributed optimizer; without it, an all-reduce of the gradients)
    Each group's link: NVLink when its ranks fit in one node (TP fastest, then DP, then PP: Megatron-Core's rank
    order), InfiniBand per GPU otherwise.
weight sync: the DDMA plan's busiest rank bytes (sent or received) over the link between the executors
    (InfiniBand per GPU when they sit on different nodes, none when colocated on the same ranks).

synchronous (the paper's DeepSpeed-Chat-like baseline): one set of GPUs generates, then trains:
    step = generation + training, with the colocated generator's layout and the KV cache the trainer's
    resident state leaves room for.
asynchronous (LlamaRL): dedicated executors overlap batch k's training with batch k+1's generation:
    step = max(generation, training) + weight sync (the generator waits for the new weights once per step).

Left out: reward computation, the controller's host work, data movement of rollouts, stragglers across replicas,
the optimizer step's own time, per-message latency of the collectives (only their bandwidth is counted), TP
communication in decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megatron_rl.planning.calibration import Calibration


@dataclass(frozen=True)
class Workload:
    """One RL step's work: `sequences` = prompts x samples, each prompt_tokens + response_tokens long."""

    sequences: int
    prompt_tokens: int
    response_tokens: int

    @property
    def seq_len(self) -> int:
        return self.prompt_tokens + self.response_tokens


@dataclass(frozen=True)
class ModelCost:
    """What one token costs: matmul weights it multiplies (every 2-D weight but the embedding lookup, i.e. the
    linear layers and the output layer), and the shape attention FLOPs depend on."""

    matmul_params: int
    num_layers: int
    hidden_size: int
    attention_width: Optional[int] = None  # heads x head size, when not the hidden size (Qwen3)

    def forward_flops_per_token(self, context: float) -> float:
        """2 FLOPs per weight, plus QK^T and AV against `context` earlier tokens."""
        width = self.attention_width or self.hidden_size
        return 2.0 * self.matmul_params + 4.0 * self.num_layers * width * context


@dataclass(frozen=True)
class GeneratorShape:
    """A generator executor as the step model sees it."""

    tp: int
    pp: int
    replicas: int
    slots: int  # sequences decoded together per replica (the KV cache slots)
    weight_bytes_per_gpu: int  # one pipeline stage's (the heaviest)
    kv_bytes_per_token_per_gpu: float  # one stage's
    # Micro-batches of slots in flight through the stages: 1, the stages run one after another for all slots; pp,
    # our pipelined generator (`inference/pipeline.py`), every stage busy with one micro-batch at a time.
    micro_batches: int = 1
    # The busiest replica's sequences, as the job splits a step (the planner passes
    # `RolloutSettings.samples_per_replica`); 0: an equal share of the workload's, ceil(sequences / replicas).
    sequences_per_replica: int = 0


@dataclass(frozen=True)
class TrainerShape:
    """A trainer executor as the step model sees it; bytes are one GPU's, link rates in GB/s per GPU."""

    tp: int
    pp: int
    dp: int
    micro_batch_rows: int  # sequences per micro-batch
    activation_itemsize: int = 2  # bytes per activation element (the trainer's dtype)
    grad_buffer_bytes: int = 0  # the DDP gradient buffer of one GPU (reduced over DP once per step)
    param_buffer_bytes: int = 0  # the DDP parameter buffer of one GPU (gathered over DP after the optimizer step)
    distributed_optimizer: bool = True
    tp_link_gbps: float = 0.0  # 0: no communication counted for that group
    pp_link_gbps: float = 0.0
    dp_link_gbps: float = 0.0

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


def group_link_gbps(stride: int, size: int, cal: Calibration) -> float:
    """The link a group of `size` ranks, `stride` apart, communicates over: NVLink when they sit in one node."""
    return cal.nvlink_gbps if stride * size <= cal.gpus_per_node else cal.infiniband_gbps


@dataclass(frozen=True)
class Phase:
    """Seconds of one phase and what they are made of."""

    seconds: float
    detail: dict


def generation_time(w: Workload, cost: ModelCost, g: GeneratorShape, cal: Calibration,
                    decode_efficiency: float) -> Phase:
    seqs = g.sequences_per_replica or math.ceil(w.sequences / g.replicas)
    slots = max(1, min(g.slots, seqs))
    waves = math.ceil(seqs / slots)
    steps = waves * w.response_tokens
    context = w.prompt_tokens + w.response_tokens / 2
    # One decode step (a token for every slot) is pp lock-step ticks; in each, every stage reads its weights and
    # the KV cache of one micro-batch of slots. Not counted: the activations handed between stages (slots x hidden
    # values per tick, megabytes against a stage's gigabytes of weights). Prefill is counted as if the stages ran one
    # after another (stages overlapping their prefills would only shorten it).
    lanes = max(1, min(g.micro_batches, slots))
    step_bytes = g.weight_bytes_per_gpu + slots / lanes * context * g.kv_bytes_per_token_per_gpu
    decode = steps * step_bytes / (cal.hbm_bandwidth_gbps * 1e9 * decode_efficiency) * g.pp
    prefill_flops = seqs * w.prompt_tokens * cost.forward_flops_per_token(w.prompt_tokens / 2)
    prefill = prefill_flops / (g.tp * cal.peak_tflops * 1e12 * cal.prefill_mfu)
    return Phase(decode + prefill, {"decode_s": decode, "prefill_s": prefill, "sequences_per_replica": seqs,
                                    "slots": slots, "waves": waves, "decode_steps": steps,
                                    "bytes_per_decode_step": step_bytes})


def training_time(w: Workload, cost: ModelCost, t: TrainerShape, cal: Calibration) -> Phase:
    tokens = w.sequences * w.seq_len
    flops = 3.0 * tokens * cost.forward_flops_per_token(w.seq_len / 2)
    per_dp = math.ceil(w.sequences / t.dp)
    m = math.ceil(per_dp / max(t.micro_batch_rows, 1))
    compute = flops / (t.gpus * cal.peak_tflops * 1e12 * cal.train_mfu) / m  # per micro-batch and stage
    act_bytes = t.micro_batch_rows * w.seq_len * cost.hidden_size * t.activation_itemsize
    tp = 0.0
    if t.tp > 1 and t.tp_link_gbps:
        tp = 4 * cost.num_layers / t.pp * 2 * (t.tp - 1) / t.tp * act_bytes / (t.tp_link_gbps * 1e9)
    p2p = 2 * act_bytes / (t.pp_link_gbps * 1e9) if t.pp > 1 and t.pp_link_gbps else 0.0
    dp = 0.0
    if t.dp > 1 and t.dp_link_gbps:
        share = (t.dp - 1) / t.dp
        moved = (t.grad_buffer_bytes + t.param_buffer_bytes if t.distributed_optimizer
                 else 2 * t.grad_buffer_bytes)
        dp = share * moved / (t.dp_link_gbps * 1e9)
    slots = m + t.pp - 1
    seconds = slots * (compute + tp + p2p) + dp
    return Phase(seconds, {"flops": flops, "micro_batches": m, "pipeline_bubble": slots / m,
                           "compute_s": slots * compute, "tp_comm_s": slots * tp, "pp_p2p_s": slots * p2p,
                           "dp_comm_s": dp})


def weight_sync_time(busiest_rank_bytes: int, link_gbps: float) -> float:
    return busiest_rank_bytes / (link_gbps * 1e9) if busiest_rank_bytes else 0.0


@dataclass(frozen=True)
class StepTimes:
    """Predicted seconds per RL step in both modes, with their parts."""

    sync_generation: Phase
    sync_training: Phase
    async_generation: Phase
    async_training: Phase
    async_weight_sync_s: float
    sync_weight_sync_s: float = 0.0  # 0 for the paper's colocated baseline (its generator uses the trainer's weights)

    @property
    def sync_s(self) -> float:
        return self.sync_generation.seconds + self.sync_training.seconds + self.sync_weight_sync_s

    @property
    def async_s(self) -> float:
        return max(self.async_generation.seconds, self.async_training.seconds) + self.async_weight_sync_s

    @property
    def speedup(self) -> float:
        return self.sync_s / self.async_s

    def to_dict(self) -> dict:
        return {"sync_s": self.sync_s, "async_s": self.async_s, "speedup": self.speedup,
                "sync": {"generation_s": self.sync_generation.seconds, "training_s": self.sync_training.seconds,
                         "weight_sync_s": self.sync_weight_sync_s,
                         "generation": self.sync_generation.detail, "training": self.sync_training.detail},
                "async": {"generation_s": self.async_generation.seconds,
                          "training_s": self.async_training.seconds, "weight_sync_s": self.async_weight_sync_s,
                          "generation": self.async_generation.detail, "training": self.async_training.detail}}


@dataclass(frozen=True)
class ExecutorRates:
    """Measured seconds per RL step of each executor working alone: what `step_times_from_rates` composes."""

    generation_s: float  # one batch on the generator (its replicas in parallel: the slowest)
    reward_s: float  # scoring that batch (on the generator's side, before it is sent)
    training_s: float  # one trainer step
    weight_sync_s: float  # one DDMA push, trainer to generator


def step_times_from_rates(r: ExecutorRates) -> StepTimes:
    """Both modes of a job with separate executors, composed from measured rates as the planner composes its
    predicted ones: synchronous = generation + reward + training + weight sync (one after the other, every step
    pushes weights), asynchronous = max(generation + reward, training) + weight sync."""
    gen = Phase(r.generation_s + r.reward_s, {"generation_s": r.generation_s, "reward_s": r.reward_s})
    train = Phase(r.training_s, {})
    return StepTimes(gen, train, gen, train, r.weight_sync_s, sync_weight_sync_s=r.weight_sync_s)

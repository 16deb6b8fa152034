"""Megatron-Core's MoE layer on a model whose activations are whole over tensor parallelism.

Megatron-Core's token dispatchers take their input split over the TP ranks along the tokens (sequence
parallelism), and its MoE layer refuses to train with TP > 1 without it: every TP rank would route and compute
the same tokens again. This project does not use sequence parallelism: the trainer's packed rows, the
generator's incremental forward and the pipeline stages all hand whole activations between layers.
`TokenSplitMoELayer` keeps that contract and gives the dispatcher what it expects, within the layer: each TP rank
takes its 1/TP of the layer's tokens (flattened over sequence and batch, padded with masked tokens to a multiple
of TP), runs Megatron-Core's layer on them, and the outputs are all-gathered back. The backward of the split is
the all-gather of the token gradients, that of the gather a split (the activations after the layer are the same
on every TP rank, so are their gradients); the router's weight, whole on every TP rank, has its gradient summed
over TP. The arithmetic per token is Megatron-Core's (a test checks it against
transformers at TP2 x EP2); the duplicated work is gone.

Routing replay (R3, "rollout routing replay"): the generator and the trainer can route a token to different experts
(another batch, other kernels, another precision), and then their log-probs of the same token disagree far more than
a dense model's do, which destabilizes RL (Megatron-LM #4168). Each layer can record the experts its router chose in
a forward (`record`, then `take_recorded`: [s, b, k] in the layer's token order, gathered over TP, the padding
dropped) and replay given ones in the next forward (`replay`: [s, b, k], each TP rank taking its chunk): the router
then computes its probabilities at those experts (Megatron-Core's `RouterReplay` gathers the scores there, which is
normal routing whenever the routes are the router's own). Each layer's router holds its own `LayerReplay`, never
Megatron-Core's global registry (a process can hold a trainer's and a generator's model at once), and the targets
are cleared after the forward that uses them, so nothing accumulates. `record_routes`, `recorded_routes` and
`replaying` do the same for a whole model (one pipeline stage), the routes indexed by the model's layer number.

The load-balancing loss is the switch-transformer one, per layer and micro-batch (`switch_balancing_loss`):
E / k * sum_i f_i P_i over the micro-batch's real tokens, f_i the fraction of its token-expert assignments that went
to expert i (the routes the layer dispatched: under replay, the generator's), P_i the mean router probability of
expert i (softmax over all experts); 1 when perfectly balanced, up to E / k. The layer computes it itself rather
than through Megatron-Core's router (whose own is turned off, `builder.moe_config`), because Megatron-Core's: is
only computed when its coefficient is > 0 (the trainer reports it at 0 too); weights each rank's share by the
rank's own token count, so with the tokens split over TP inside the layer its gradient would shrink with TP; and
reads the padding mask the other way round from the MoE layer's docstring. Within `balancing` (one training forward
of a micro-batch: its real tokens and its weight, the micro-batch's share of the step's loss count) each layer
adds `config.moe_aux_loss_coeff` x weight x its loss to the backward (Megatron-Core's `MoEAuxLossAutoScaler`;
the engine divides every gradient by the step's loss count, so the step's term is the coefficient times each
layer's loss averaged over micro-batches as the policy loss is) and keeps weight x loss and the weight for the
trainer's metric (`take_balance_stats`). Each TP rank holds the loss of its share of the tokens (the counts f
summed over TP): the shares add up to the micro-batch's, and the router's gradient is summed over TP.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
import megatron_rl.compat.megatron_core  # noqa: F401 - first: Megatron-Core without wandb and Inductor
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction


class LayerReplay(RouterReplay):
    """Megatron-Core's per-router replay state without its class-level registry (`RouterReplay.__init__` appends
    every instance to a global list, which would keep every model ever built alive and mix the routers of models
    that share a process). Its `get_replay_topk` is Megatron-Core's, which the router calls."""

    def __init__(self):  # no super().__init__: that registers the instance globally
        self.target_topk_idx: Optional[torch.Tensor] = None
        self.recorded_topk_idx: Optional[torch.Tensor] = None
        self.router_replay_action: Optional[RouterReplayAction] = None
        self.replay_backward_list: list = []


def _summed_over(grad: torch.Tensor, group) -> torch.Tensor:
    """A gradient hook: the sum of `grad` over `group`'s ranks."""
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def switch_balancing_loss(logits: torch.Tensor, routing_map: torch.Tensor, valid: torch.Tensor, topk: int,
                          group=None) -> torch.Tensor:
    """The switch-transformer load-balancing loss of a layer's tokens, E / (k T^2) * sum_i c_i S_i: over the real
    tokens (`valid` [n] bool) of `logits` [n, E] (the router's) and `routing_map` [n, E] (the experts each was sent
    to), c_i the tokens sent to expert i, S_i the sum of their softmax probabilities of expert i, T the real
    tokens. With `group` (the TP ranks each holding a share of the tokens), c and T are summed over it and the
    result is this rank's share of the whole loss (the shares sum to it). 0 without real tokens."""
    keep = valid.unsqueeze(1)
    probs = torch.softmax(logits.float(), dim=-1) * keep
    counts = torch.cat([(routing_map.bool() & keep).sum(0), valid.sum().reshape(1)]).float()
    if group is not None and group.size() > 1:
        dist.all_reduce(counts, group=group)
    c, t = counts[:-1], counts[-1].clamp(min=1.0)
    return logits.shape[-1] * (c * probs.sum(0)).sum() / (topk * t * t)


def route_dtype(num_experts: int) -> torch.dtype:
    """The compact dtype that holds expert ids below `num_experts` (routes cross processes and checkpoints)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


class TokenSplitMoELayer(MoELayer):
    """Megatron-Core's MoELayer taking whole [s, b, h] activations: each TP rank routes 1/TP of the tokens (see
    the module docstring)."""

    def __init__(self, config, submodules=None, layer_number: Optional[int] = None, pg_collection=None):
        super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection)
        # The layer's own check against duplicated tokens (training at TP > 1 without sequence parallelism) reads
        # this group's size; the tokens are split here, so it sees a group of one (CP, which this project keeps
        # at 1).
        self.attn_tp_group = pg_collection.cp
        # The router's weight is whole on every TP rank but each rank routes only its share of the tokens, so its
        # gradient is that share's: summed over TP in the backward (Megatron-Core's gradient finalization sums such
        # weights only under sequence parallelism, which this model does not use).
        if self.tp_group.size() > 1:
            for p in self.router.parameters():
                p.register_hook(functools.partial(_summed_over, group=self.tp_group))
        self.router.router_replay = LayerReplay()
        self._recording = False
        self._recorded: Optional[torch.Tensor] = None
        self._replay: Optional[torch.Tensor] = None
        # The load-balancing loss (module docstring): the next forward's real tokens [s, b] and weight (`balance`);
        # this forward's real tokens among those the router sees; [sum of weight x loss, sum of weight] so far.
        self._balance: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._balance_now: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.balance_stats: Optional[torch.Tensor] = None

    def record(self, on: bool = True) -> None:
        """Record the routes of every forward from now on (`take_recorded` hands out the last one's), or stop."""
        self._recording = on
        self._recorded = None

    def take_recorded(self) -> Optional[torch.Tensor]:
        """The experts the last recorded forward chose, [s, b, k] int64 in its [s, b] token order, once."""
        out, self._recorded = self._recorded, None
        return out

    def replay(self, routes: Optional[torch.Tensor]) -> None:
        """Route the next forward's tokens to `routes` [s, b, k] (expert ids; the probabilities are the router's at
        those experts) instead of the router's top-k; None cancels. Used by that forward only."""
        self._replay = routes

    def balance(self, real: Optional[torch.Tensor], weight: Optional[torch.Tensor]) -> None:
        """Compute the load-balancing loss in the next forward (if it trains: with gradients, in training mode)
        over its real tokens `real` [s, b] bool, weighting it by `weight` (module docstring); None cancels."""
        self._balance = None if real is None or weight is None else (real, weight)

    def take_balance_stats(self) -> Optional[torch.Tensor]:
        """[sum of weight x loss, sum of weight] (float64) over the forwards since the last call (this rank's
        shares of the losses), once; None when none computed it."""
        out, self.balance_stats = self.balance_stats, None
        return out

    def _arm_balance(self, n_tokens: int, lo: int, hi: int) -> None:
        """This forward's real tokens among tokens lo..hi of the n_tokens flattened (padding past n_tokens)."""
        balance, self._balance = self._balance, None
        self._balance_now = None
        if balance is None or not (self.training and torch.is_grad_enabled()):
            return
        real, weight = balance
        flat = real.reshape(-1).bool()
        if flat.shape[0] != n_tokens:
            raise ValueError(f"the real-token mask holds {flat.shape[0]} tokens, the layer's input {n_tokens}")
        if hi > n_tokens:
            flat = F.pad(flat, (0, hi - n_tokens), value=False)
        self._balance_now = (flat[lo:hi], weight)

    def route(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """Megatron-Core's routing; in a forward that computes the load-balancing loss (`balance`), the loss of
        these tokens from the router's logits (computed again: a [tokens, hidden] x [hidden, experts] product) and
        the experts they were sent to, attached to the backward with its coefficient and kept for the metric."""
        probs, routing_map = super().route(hidden_states, padding_mask)
        balance, self._balance_now = self._balance_now, None
        if balance is None:
            return probs, routing_map
        valid, weight = balance
        logits = self.router.gating(hidden_states).reshape(-1, self.config.num_moe_experts)
        loss = switch_balancing_loss(logits, routing_map, valid.to(logits.device), self.config.moe_router_topk,
                                     self.tp_group)
        weight = weight.to(device=loss.device, dtype=torch.float32)
        stats = torch.stack([weight * loss.detach(), weight]).double()
        self.balance_stats = stats if self.balance_stats is None else self.balance_stats + stats
        coeff = self.config.moe_aux_loss_coeff
        if coeff:
            probs = MoEAuxLossAutoScaler.apply(probs, loss * (coeff * weight))
        return probs, routing_map

    def _set_action(self, n_tokens: int, lo: int, hi: int) -> None:
        """Arm the router for this forward's tokens lo..hi of the n_tokens flattened (padding past n_tokens)."""
        replay = self.router.router_replay
        replay.clear_indices()
        routes, self._replay = self._replay, None
        if routes is not None:
            k = routes.shape[-1]
            flat = routes.reshape(-1, k).long()
            if flat.shape[0] != n_tokens:
                raise ValueError(f"replayed routes hold {flat.shape[0]} tokens, the layer's input {n_tokens}")
            if hi > n_tokens:  # padding tokens (masked): any k distinct experts
                filler = torch.arange(k, dtype=torch.long, device=flat.device).expand(hi - n_tokens, k)
                flat = torch.cat([flat, filler])
            replay.set_target_indices(flat[lo:hi].to(self.router.weight.device))
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        elif self._recording:
            replay.set_router_replay_action(RouterReplayAction.RECORD)
        else:
            replay.clear_router_replay_action()

    def _keep_recorded(self, s: int, b: int) -> None:
        """After a forward: keep the routes it chose (gathered over TP, [s, b, k]) when recording; clear the
        router's replay state either way."""
        replay = self.router.router_replay
        mine = replay.recorded_topk_idx if replay.router_replay_action == RouterReplayAction.RECORD else None
        if replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD and self._recording:
            mine = replay.target_topk_idx  # replayed while recording: the routes it used
        replay.clear_indices()
        replay.clear_router_replay_action()
        if mine is None or not self._recording:
            return
        tp = self.tp_group.size()
        if tp > 1:
            parts = [torch.empty_like(mine) for _ in range(tp)]
            dist.all_gather(parts, mine.contiguous(), group=self.tp_group)
            mine = torch.cat(parts)
        self._recorded = mine[: s * b].reshape(s, b, -1)

    def forward(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        tp = self.tp_group.size()
        s, b, h = hidden_states.shape
        if tp == 1:
            self._set_action(s * b, 0, s * b)
            self._arm_balance(s * b, 0, s * b)
            try:
                return super().forward(hidden_states, padding_mask=padding_mask)
            finally:
                self._keep_recorded(s, b)
        tokens = hidden_states.reshape(s * b, 1, h)
        # [b, s] with True for real tokens -> [1, s * b] in the flattened order (padding_mask is batch-first).
        valid = (torch.ones(s * b, dtype=torch.bool, device=tokens.device) if padding_mask is None
                 else padding_mask.transpose(0, 1).reshape(s * b).bool())
        pad = -(s * b) % tp
        if pad:
            tokens = F.pad(tokens, (0, 0, 0, 0, 0, pad))
            valid = F.pad(valid, (0, pad), value=False)
        mine = scatter_to_sequence_parallel_region(tokens, group=self.tp_group)
        chunk = mine.shape[0]
        rank = self.tp_group.rank()
        my_mask = valid[rank * chunk:(rank + 1) * chunk].reshape(1, chunk)
        self._set_action(s * b, rank * chunk, (rank + 1) * chunk)
        self._arm_balance(s * b, rank * chunk, (rank + 1) * chunk)
        try:
            out, bias = super().forward(mine, padding_mask=None if padding_mask is None and not pad else my_mask)
        finally:
            self._keep_recorded(s, b)
        out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False, group=self.tp_group)
        return out[: s * b].reshape(s, b, h), bias


def moe_layers(model: torch.nn.Module) -> list[tuple[int, TokenSplitMoELayer]]:
    """This stage's MoE layers with their 0-based layer index in the whole model (wrappers looked through). Found
    once per model and kept on it: the engine asks before every micro-batch's forward, and Qwen3-30B-A3B's 128
    experts a layer make tens of thousands of modules to walk."""
    found = getattr(model, "_megatron_rl_moe_layers", None)
    if found is None:
        found = [(m.layer_number - 1, m) for m in model.modules() if isinstance(m, TokenSplitMoELayer)]
        model._megatron_rl_moe_layers = found
    return found


def record_routes(model: torch.nn.Module, on: bool = True) -> None:
    """Every MoE layer of `model` records its routes (`TokenSplitMoELayer.record`), or stops."""
    for _, layer in moe_layers(model):
        layer.record(on)


def recorded_routes(model: torch.nn.Module) -> Optional[torch.Tensor]:
    """The routes of the last recorded forward, [s, b, layers, k] over this stage's MoE layers in layer order
    (None when it has none or nothing was recorded)."""
    taken = [layer.take_recorded() for _, layer in sorted(moe_layers(model), key=lambda x: x[0])]
    if not taken or any(t is None for t in taken):
        return None
    return torch.stack(taken, dim=2)


@contextlib.contextmanager
def replaying(model: torch.nn.Module, routes: Optional[torch.Tensor]) -> Iterator[None]:
    """Within the block, the next forward of `model` (one pipeline stage) routes its tokens to `routes`
    [b, s, num_layers, k] (batch-first, as micro-batches are; indexed by the whole model's layer: each stage takes
    its own layers'). None: the router's own routing. Whatever was not used is cleared on exit."""
    layers = moe_layers(model) if routes is not None else []
    for index, layer in layers:
        layer.replay(routes[:, :, index].transpose(0, 1))
    try:
        yield
    finally:
        for _, layer in layers:
            layer.replay(None)


@contextlib.contextmanager
def balancing(model: torch.nn.Module, real: Optional[torch.Tensor], weight: Optional[torch.Tensor]) -> Iterator[None]:
    """Within the block, the next training forward of `model` (one pipeline stage) computes every MoE layer's
    load-balancing loss over the real tokens `real` [b, s] bool (batch-first, as micro-batches are) with the
    micro-batch's `weight` (0-d; module docstring). None: none. Whatever was not used is cleared on exit."""
    layers = moe_layers(model) if real is not None and weight is not None else []
    for _, layer in layers:
        layer.balance(real.transpose(0, 1), weight)
    try:
        yield
    finally:
        for _, layer in layers:
            layer.balance(None, None)


def take_balance_stats(model: torch.nn.Module, num_layers: int) -> torch.Tensor:
    """[2, num_layers] float64: per layer of the whole model, this stage's [sum of weight x load-balancing loss
    (this rank's share), sum of weight] since the last call (zeros for other stages' layers and layers that
    computed none); reset."""
    out = torch.zeros(2, num_layers, dtype=torch.float64)
    for index, layer in moe_layers(model):
        stats = layer.take_balance_stats()
        if stats is not None:
            out[:, index] = stats.cpu()
    return out

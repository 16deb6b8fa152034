"""One decode step for every cache slot of the one-stage generator, optionally captured in a CUDA graph, and the
host-to-device copy that never waits on the device's queue."""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from megatron_rl.compat import cuda_rules
from megatron_rl.inference.kv_forward import IncrementalForward, PagedKVCache
from megatron_rl.inference.routes import RouteRecorder
from megatron_rl.inference.sampling import sample

logger = logging.getLogger(__name__)


def to_device(t: torch.Tensor, device: torch.device, cuda_rules_on: bool) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device's queued work (a pageable copy to a GPU
    synchronizes the stream, which would stall behind a step launched ahead).

    The pinned copy has `t`'s strides, so `t` is made contiguous first: CUDA refuses to pin a tensor whose elements
    share memory, such as the expanded position grid of a prefill. In the CUDA-rules mode (`cuda_rules_on`) the same
    path runs on the CPU, with `cuda_rules.pin_memory` refusing what CUDA refuses."""
    if device.type != "cuda" and not cuda_rules_on:
        return t.to(device)
    return cuda_rules.pin_memory(t.contiguous()).to(device, non_blocking=True)


class DecodeStep:
    """One decode step for every cache slot (static shapes), optionally captured in a CUDA graph.

    Inputs live in fixed buffers (token, position, sampling parameters per slot); the step runs the model for
    one token per slot, gathers the vocabulary over TP and samples on the device. Free slots compute too (their
    results are ignored): a fixed batch is what makes the step capturable, and replaying a graph removes the
    per-kernel launch cost that dominates decoding small and medium models.

    The step also advances its own inputs on the device (the sampled token becomes the next input, positions and
    step counters move on; positions stop at the cache's end, where only finished or free slots get), so the
    next step can start before the host has read this one's tokens: the host only writes the slots it admits.
    """

    def __init__(self, forward: IncrementalForward, full_logits: Callable[[torch.Tensor], torch.Tensor],
                 routes: RouteRecorder, cache, device, filtering: bool, noise: bool, use_graph: bool,
                 cuda_rules_on: bool):
        b = cache.slots
        self.forward, self.full_logits, self.routes = forward, full_logits, routes  # full_logits: the TP gather
        self.cache, self.filtering, self.noise, self.cuda_rules_on = cache, filtering, noise, cuda_rules_on
        z = lambda dtype: torch.zeros(b, dtype=dtype, device=device)  # noqa: E731
        self.tokens, self.positions = z(torch.long), z(torch.long)
        self.temperature, self.top_p, self.top_k = z(torch.float32), z(torch.float32), z(torch.long)
        self.seeds, self.steps = z(torch.long), z(torch.long)
        self.slots = torch.arange(b, device=device)
        self.graph = None
        self.out = None
        if use_graph:
            try:
                self._capture()
            except cuda_rules.CaptureError:
                raise
            except Exception as e:  # pragma: no cover - depends on the GPU stack
                logger.warning("CUDA graph capture failed (%s); decoding eagerly", e)
                self.graph = None

    def _body(self, active: Optional[list[int]] = None):
        # A captured graph needs a fixed shape: the whole cache. Eagerly, attention reads up to the furthest
        # position of a running slot (on a CPU reading it back costs nothing): never further because of what a free
        # slot last held, so that a step's results depend on its running sequences alone (a restored engine's free
        # slots hold nothing).
        gpu = cuda_rules.gpu_path(self.positions, self.cuda_rules_on)
        if gpu:
            kv_len = self.cache.max_len
        else:
            live = self.positions if not active else self.positions[torch.tensor(active, device=self.positions.device)]
            kv_len = int(live.max()) + 1
        logits = self.forward(self.tokens[:, None], self.positions[:, None], self.slots, self.cache,
                                  kv_len=kv_len, all_slots=True)
        routes = self.routes.take()
        full = self.full_logits(logits[:, 0])
        tokens, logprobs = sample(full, self.temperature, self.top_p, self.top_k, self.seeds, self.steps,
                                  self.filtering, self.noise)
        self.tokens.copy_(tokens)
        self.positions.add_(1).clamp_(max=self.cache.max_len - 1)
        self.steps.add_(1)
        return tokens, logprobs, None if routes is None else routes[0]

    def _running(self, active: list[int]):
        """The eager step for the `active` slots only (a CPU without the CUDA-rules mode): free slots and episodes
        waiting for their environments cost nothing, and attention reads up to the furthest running position. The
        tokens and log-probs come back per slot, as `_body`'s do (the other slots' are unread; their inputs stay as
        they were, and admitting a sequence there sets them); so do the routes, when recorded."""
        idx = torch.tensor(active, device=self.tokens.device)
        positions = self.positions[idx]
        logits = self.forward(self.tokens[idx][:, None], positions[:, None], idx, self.cache,
                                  kv_len=int(positions.max()) + 1)
        routes = self.routes.take()
        if routes is not None:
            out_r = routes.new_zeros((self.tokens.shape[0],) + tuple(routes.shape[2:]))
            out_r[idx] = routes[0]
            routes = out_r
        full = self.full_logits(logits[:, 0])
        tokens, logprobs = sample(full, self.temperature[idx], self.top_p[idx], self.top_k[idx], self.seeds[idx],
                                  self.steps[idx], self.filtering, self.noise)
        self.tokens[idx] = tokens
        self.positions[idx] = (positions + 1).clamp_(max=self.cache.max_len - 1)
        self.steps[idx] += 1
        out_t, out_lp = torch.zeros_like(self.tokens), torch.zeros(self.tokens.shape, device=self.tokens.device)
        out_t[idx], out_lp[idx] = tokens, logprobs.float()
        return out_t, out_lp, routes

    def admit(self, seqs: list) -> None:
        """Point the given slots at newly admitted sequences (their last token, its position, their parameters, and
        their sampling stream's counter: 0, or where an episode's last turn left it)."""
        if not seqs:
            return
        dev, rules = self.tokens.device, self.cuda_rules_on
        idx = to_device(torch.tensor([s.slot for s in seqs]), dev, rules)
        for buf, values in ((self.tokens, [s.last for s in seqs]),
                            (self.positions, [len(s.prompt) + len(s.tokens) - 1 for s in seqs]),
                            (self.steps, [s.sampled for s in seqs]), (self.seeds, [s.seed for s in seqs]),
                            (self.temperature, [s.params.temperature for s in seqs]),
                            (self.top_p, [s.params.top_p for s in seqs]), (self.top_k, [s.params.top_k for s in seqs])):
            buf.index_copy_(0, idx, to_device(torch.tensor(values, dtype=buf.dtype), dev, rules))

    def _capture(self):
        self.top_p.fill_(1.0)
        if not self.tokens.is_cuda:  # the CUDA-rules mode: warm up and "capture" as below, refusing what capture does
            for _ in range(2):
                self._body()
            with cuda_rules.CaptureChecker("the generator's decode step"):
                self._body()
            for buf in (self.tokens, self.positions, self.steps):
                buf.zero_()
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._body()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._body()
        for buf in (self.tokens, self.positions, self.steps):  # the warm-up and capture advanced them
            buf.zero_()

    def __call__(self, active: Optional[list[int]] = None):
        """One step; `active` (the running slots) lets an eager CPU step run those alone: always with a paged
        cache, which gathers what it reads anyway; with a slot cache when they are under half of the slots (the
        step over every slot reads the cache in place, where a subset's keys are gathered, a copy)."""
        if self.graph is not None:
            self.graph.replay()
            return self.out
        subset = active is not None and (isinstance(self.cache, PagedKVCache) or 2 * len(active) < self.cache.slots)
        if subset and not cuda_rules.gpu_path(self.tokens, self.cuda_rules_on):
            return self._running(active)
        return self._body(active)

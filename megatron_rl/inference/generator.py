"""The generator executor's sampling loop: continuous batching over a slot KV cache, behaviour log-probs.

With `kv_cache_tokens` the cache is paged (`kv_forward.PagedKVCache`, `inference/paging.py`): a sequence holds blocks
of positions as it grows, a sequence waits for a slot and for blocks, and when the running sequences outgrow the
cache the one admitted last is preempted and prefilled again later. Its memory follows the tokens in use, so more
sequences decode at once in the same memory where lengths vary. The host then decides between steps which sequence
holds which block, so nothing runs ahead (no lookahead); a CUDA graph still replays the decode step, which reads the
block table and gathers each slot's blocks (one pipeline stage only).

Requests are expanded into sequences (n per request), which wait for a free cache slot. Each step prefills the
sequences that just got a slot (one batched chunk, right-padded) and decodes one token for every running one;
a finished sequence frees its slot at once, so a long tail does not idle the batch. Every tensor-parallel rank
of a replica runs the same loop on the same requests (the vocabulary is gathered for the sampled positions
only) and draws the same tokens from the same per-sequence seeds: sample k of a request seeded s is seeded
stream_seed(s, k).

With `turns` (`inference/episodes.py`), a sequence is an episode: when a turn ends, the sequence keeps its slot and
its cache while its environment answers and the other sequences decode; the observation's token ids are appended
(no loss: `SampledResponse.policy_mask`), only they are prefilled into the slot, and decoding resumes, with the
sequence's sampling stream continuing where the last turn left it. A pipelined generator plays episodes the same
way, a lane's round standing for a decode iteration (`inference/pipeline.py`), with this module's bookkeeping
(`_append`, `_observe`) and prefill rule (`Prefill`): its episodes are the one-stage generator's.

With `record_routes` (a mixture-of-experts model; routing replay, `models/moe.py`), every forward records the experts
each MoE layer chose for each token it fed (`_Routes`): a prefill its chunk's tokens, a decode step each sequence's
input token; a sequence prefilled again (preempted from a paged cache, or resuming an episode) records again from
where its cache starts. Each output then carries `routes` [prompt + response tokens, layers, k] (uint8 up to 256
experts): the trainer replays them, so it routes every token as the generator did. The last token is never fed (it
was sampled last), so its routes are k placeholder experts; its hidden state only makes the logits after the
sequence, which no loss reads. A pipelined generator (pp > 1) does not record (refused).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.compat import cuda_rules
from megatron_rl.inference.episodes import EndedTurn, Turns
from megatron_rl.inference.kv_forward import IncrementalForward, PagedKVCache
from megatron_rl.inference.paging import BlockPool
from megatron_rl.inference.pipeline import PipelinedDecode, Prefill
from megatron_rl.inference.sampling import SamplingParams, sample, stream_seed
from megatron_rl.models.moe import record_routes, recorded_routes, route_dtype

logger = logging.getLogger(__name__)


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: Optional[str] = None


@dataclass
class SampledResponse:
    request_id: Optional[str]
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # log mu(token) under softmax(logits / T), T = 1 for greedy
    finish_reason: str  # "stop" (stop token or string), "length", or "error"; an episode's: "done", "turns" too
    text: Optional[str] = None
    error: Optional[str] = None
    policy_mask: Optional[list[bool]] = None  # an episode's: True at sampled tokens, False at observations
    turns: int = 1  # an episode's model turns
    # With `Generator(record_routes=True)`: each token's experts [len(prompt_ids + token_ids), layers, k] (module
    # docstring); None otherwise.
    routes: Optional[torch.Tensor] = None


@dataclass
class _Seq:
    req: int
    sample: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    request_id: Optional[str] = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    slot: int = -1
    finish: Optional[str] = None
    # Episodes (`inference/episodes.py`): False where `tokens` holds an observation's ids; where this turn's tokens
    # start; model turns so far; tokens sampled so far (the sampling stream's counter); cache positions filled
    # before the slot was (re)admitted.
    policy: list[bool] = field(default_factory=list)
    turn_start: int = 0
    turns: int = 0
    sampled: int = 0
    cached: int = 0
    budget: Optional[int] = None  # an episode's most tokens after its prompt (`Turns.max_tokens`)
    admitted_at: int = 0  # when it last got a slot (a paged cache preempts the latest first)
    routes: "RouteLog" = field(default_factory=lambda: RouteLog())  # recorded routes of positions 0, 1, ...

    @property
    def history(self) -> list[int]:
        return self.prompt + self.tokens

    @property
    def last(self) -> int:
        """The last token of `history`, without building it."""
        return self.tokens[-1] if self.tokens else self.prompt[-1]

    def ended_turn(self) -> EndedTurn:
        """The turn that has just ended, for `Turns.start`."""
        return EndedTurn(self.req, self.sample, tuple(self.tokens[self.turn_start:]), self.finish)


def _to_device(t: torch.Tensor, device: torch.device, cuda_rules_on: bool) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device's queued work (a pageable copy to a GPU
    synchronizes the stream, which would stall behind a step launched ahead).

    The pinned copy has `t`'s strides, so `t` is made contiguous first: CUDA refuses to pin a tensor whose elements
    share memory, such as the expanded position grid of a prefill. In the CUDA-rules mode (`cuda_rules_on`) the same
    path runs on the CPU, with `cuda_rules.pin_memory` refusing what CUDA refuses."""
    if device.type != "cuda" and not cuda_rules_on:
        return t.to(device)
    return cuda_rules.pin_memory(t.contiguous()).to(device, non_blocking=True)


class RouteLog:
    """One sequence's recorded routes [n, layers, k] on the host, in one buffer that doubles as it grows: a decode
    step appends one position, and a long response's thousands of positions stay one tensor (not one small tensor
    each, which hundreds of sequences would make millions of Python objects)."""

    __slots__ = ("_buf", "_n")

    def __init__(self):
        self._buf: Optional[torch.Tensor] = None
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def append(self, rows: torch.Tensor) -> None:
        """Add the routes of the next positions, [m, layers, k] (copied: `rows` may be a reused buffer)."""
        m = rows.shape[0]
        if self._buf is None or self._n + m > self._buf.shape[0]:
            grown = torch.empty((max(2 * (self._n + m), 16), *rows.shape[1:]), dtype=rows.dtype)
            if self._n:
                grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n: self._n + m] = rows
        self._n += m

    def truncate(self, n: int) -> None:
        """Keep the first n positions (those a sequence's cache still holds)."""
        self._n = min(self._n, n)

    def recorded(self) -> Optional[torch.Tensor]:
        """The positions recorded so far, [n, layers, k] (a view; None before the first)."""
        return None if self._buf is None else self._buf[: self._n]


class _Routes:
    """The routes a generator records (module docstring): taken from the model after each forward, kept per
    sequence on the host, in the compact dtype."""

    def __init__(self, model: torch.nn.Module, on: bool):
        self.model, self.on = model, on
        self.dtype = route_dtype(model.config.num_moe_experts) if on else None
        self._host: list = [None, None]

    def take(self) -> Optional[torch.Tensor]:
        """The last forward's routes [s, b, layers, k] on the device (None when not recording)."""
        if not self.on:
            return None
        return recorded_routes(self.model).to(self.dtype)

    def prefilled(self, admitted: list, routes: torch.Tensor) -> None:
        """A prefill's routes [width, rows, layers, k] to the sequences it fed (`Prefill.of`'s rows), after the
        positions each one's cache still held (a preempted sequence's are recorded again)."""
        rows = [q for q in admitted if len(q.prompt) + len(q.tokens) - 1 > q.cached]
        host = routes.transpose(0, 1).cpu()
        for j, q in enumerate(rows):
            q.routes.truncate(q.cached)
            q.routes.append(host[j, : len(q.prompt) + len(q.tokens) - 1 - q.cached])

    def to_host(self, routes: Optional[torch.Tensor], parity: int, pin: bool) -> Optional[torch.Tensor]:
        """A decode step's routes [slots, layers, k] copied (without waiting) into one of two host buffers."""
        if routes is None:
            return None
        buf = self._host[parity]
        if buf is None or buf.shape != routes.shape:
            buf = self._host[parity] = torch.empty(routes.shape, dtype=routes.dtype, pin_memory=pin)
        return buf.copy_(routes, non_blocking=True)

    def output(self, seq: "_Seq") -> Optional[torch.Tensor]:
        """[len(history), layers, k]: the recorded positions, then placeholders (experts 0..k-1) for the last."""
        if not self.on:
            return None
        seq.routes.truncate(len(seq.prompt) + len(seq.tokens) - 1)
        layers, k = self.model.config.num_layers, self.model.config.moe_router_topk
        have = seq.routes.recorded()
        if have is None:
            have = torch.zeros(0, layers, k, dtype=self.dtype)
        fill = torch.arange(k, dtype=self.dtype).expand(len(seq.prompt) + len(seq.tokens) - have.shape[0], layers, k)
        return torch.cat([have, fill])


class _DecodeStep:
    """One decode step for every cache slot (static shapes), optionally captured in a CUDA graph.

    Inputs live in fixed buffers (token, position, sampling parameters per slot); the step runs the model for
    one token per slot, gathers the vocabulary over TP and samples on the device. Free slots compute too (their
    results are ignored): a fixed batch is what makes the step capturable, and replaying a graph removes the
    per-kernel launch cost that dominates decoding small and medium models.

    The step also advances its own inputs on the device (the sampled token becomes the next input, positions and
    step counters move on; positions stop at the cache's end, where only finished or free slots get), so the
    next step can start before the host has read this one's tokens: the host only writes the slots it admits.
    """

    def __init__(self, gen: "Generator", cache, device, filtering: bool, noise: bool, use_graph: bool):
        b = cache.slots
        self.gen, self.cache, self.filtering, self.noise = gen, cache, filtering, noise
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

    def _body(self):
        # A captured graph needs a fixed shape: the whole cache. Eagerly, attention reads up to the furthest
        # position of any slot (on a CPU reading it back costs nothing).
        gpu = cuda_rules.gpu_path(self.positions, self.gen.cuda_rules_on)
        kv_len = self.cache.max_len if gpu else int(self.positions.max()) + 1
        logits = self.gen.forward(self.tokens[:, None], self.positions[:, None], self.slots, self.cache,
                                  kv_len=kv_len, all_slots=True)
        routes = self.gen.routes.take()
        full = self.gen._full_logits(logits[:, 0])
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
        logits = self.gen.forward(self.tokens[idx][:, None], positions[:, None], idx, self.cache,
                                  kv_len=int(positions.max()) + 1)
        routes = self.gen.routes.take()
        if routes is not None:
            out_r = routes.new_zeros((self.tokens.shape[0],) + tuple(routes.shape[2:]))
            out_r[idx] = routes[0]
            routes = out_r
        full = self.gen._full_logits(logits[:, 0])
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
        dev, rules = self.tokens.device, self.gen.cuda_rules_on
        idx = _to_device(torch.tensor([s.slot for s in seqs]), dev, rules)
        for buf, values in ((self.tokens, [s.last for s in seqs]),
                            (self.positions, [len(s.prompt) + len(s.tokens) - 1 for s in seqs]),
                            (self.steps, [s.sampled for s in seqs]), (self.seeds, [s.seed for s in seqs]),
                            (self.temperature, [s.params.temperature for s in seqs]),
                            (self.top_p, [s.params.top_p for s in seqs]), (self.top_k, [s.params.top_k for s in seqs])):
            buf.index_copy_(0, idx, _to_device(torch.tensor(values, dtype=buf.dtype), dev, rules))

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
        if subset and not cuda_rules.gpu_path(self.tokens, self.gen.cuda_rules_on):
            return self._running(active)
        return self._body()


class Generator:
    """Batched sampling for one generator replica (all of its ranks call `generate` with the same requests).

    With a `pp_group` of more than one stage, `model` is this rank's stage and decoding is pipelined
    (`megatron_rl.inference.pipeline`); every rank returns the outputs. The CUDA-rules test mode
    (`compat/cuda_rules.py`) is read once, here, and kept as `cuda_rules_on`. A mixture-of-experts model never
    captures its decode step in a CUDA graph (`cuda_graphs` is off, and True refused): its expert dispatch has
    data-dependent shapes and host syncs (`kv_forward.py`); lookahead still launches a step before the last is read."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, tp_group, max_batch_size: int = 64,
                 max_len: Optional[int] = None, tokenizer=None, cuda_graphs: Optional[bool] = None,
                 lookahead: Optional[bool] = None, pp_group=None, kv_cache_tokens: Optional[int] = None,
                 record_routes: bool = False):
        if max_batch_size < 1:  # no cache slot: no sequence could ever start, and `generate` would spin
            raise ValueError(f"generator max_batch_size={max_batch_size} must be >= 1 (the number of sequences "
                             f"decoded at once)")
        self.model = model
        self.vocab_size = vocab_size
        self.tp_group = tp_group
        self.max_batch_size = max_batch_size
        self.max_len = max_len or model.max_sequence_length
        self.tokenizer = tokenizer
        self.cuda_rules_on = cuda_rules.enabled()
        self.forward = IncrementalForward(model, tp_group, self.cuda_rules_on)
        self.pipeline = None
        if pp_group is not None and pp_group.size() > 1:
            self.pipeline = PipelinedDecode(self.forward, pp_group, self._full_logits, self._append, self._observe)
        elif not (model.pre_process and model.post_process):
            raise ValueError("the model is one pipeline stage: the generator needs its pp_group")
        # A paged cache of that many tokens (`kv_forward.PagedKVCache`, `inference/paging.py`), or None: a slot cache.
        self.kv_cache_tokens = kv_cache_tokens
        if kv_cache_tokens is not None and self.pipeline is not None:
            raise ValueError("a paged KV cache needs a generator of one pipeline stage (its lanes split a slot cache)")
        gpu = torch.cuda.is_available() or self.cuda_rules_on
        # A mixture-of-experts model decodes eagerly: its expert dispatch has data-dependent shapes and host syncs.
        if cuda_graphs and self.forward.moe:
            raise ValueError("cuda_graphs=True: a mixture-of-experts model's decode step cannot be captured in a CUDA "
                             "graph (its expert dispatch selects each expert's tokens: data-dependent shapes)")
        self.cuda_graphs = (gpu and not self.forward.moe) if cuda_graphs is None else cuda_graphs
        # Launch step t + 1 before reading step t's tokens (on by default with CUDA, where it hides the host's
        # bookkeeping behind the GPU's work; on a CPU there is nothing to overlap). A sequence that ends at step t
        # then costs its slot one more (discarded) step, and its successor is admitted one step later; every
        # sequence's tokens are the same either way.
        # With a paged cache the host decides between steps which sequence holds which block (and may preempt one):
        # nothing may run ahead of those decisions.
        self.lookahead = (gpu if lookahead is None else lookahead) and kv_cache_tokens is None
        self.stats: dict = {}
        self._cache = None
        self._steps: dict = {}
        self._paging_stats: dict = {}  # the last batch's decode batch size, and its paged cache's use
        self.routes = _Routes(model, self._check_routes(record_routes))

    def _check_routes(self, record: bool) -> bool:
        """Whether to record routes (module docstring): only a one-stage generator of a mixture-of-experts model."""
        if record and not self.forward.moe:
            raise ValueError("record_routes=True needs a mixture-of-experts model (this one is dense)")
        if record and self.pipeline is not None:
            raise ValueError("routing replay needs a generator of one pipeline stage (generator.pp=1): a pipelined "
                             "generator does not record its routes (set trainer.routing_replay=false)")
        return record

    def _cache_for(self, slots: int, max_len: int):
        c = self._cache
        if c is None or c.slots != slots or c.max_len < max_len:
            self._cache = self.forward.allocate_cache(slots, max_len, tokens=self.kv_cache_tokens)
            self._steps = {}
        return self._cache

    def _full_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[k, vocab] fp32 logits for k positions, gathered over TP, padding columns removed."""
        tp = self.tp_group.size()
        if tp > 1:
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local.contiguous(), group=self.tp_group)
            local = torch.cat(parts, -1)
        return local[:, : self.vocab_size].float()

    def _validate(self, r: GenerationRequest) -> Optional[str]:
        problems = r.params.problems()
        if not r.prompt_ids:
            problems.append("empty prompt")
        elif len(r.prompt_ids) + 1 > self.max_len:
            problems.append(f"prompt of {len(r.prompt_ids)} tokens leaves no room in the context of {self.max_len}")
        elif any(not 0 <= t < self.vocab_size for t in r.prompt_ids):
            problems.append(f"prompt holds token ids outside [0, {self.vocab_size})")
        return "; ".join(problems) if problems else None

    def _stopped(self, seq: _Seq, tok: int) -> Optional[str]:
        p = seq.params
        if tok in p.stop_token_ids:
            return "stop"
        if p.stop_strings and self.tokenizer is not None:
            tail = self.tokenizer.decode(seq.tokens[-16:])
            if any(s in tail for s in p.stop_strings):
                return "stop"
        if (len(seq.tokens) - seq.turn_start >= p.max_new_tokens or len(seq.prompt) + len(seq.tokens) >= self.max_len
                or (seq.budget is not None and len(seq.tokens) >= seq.budget)):
            return "length"
        return None

    @torch.no_grad()
    def generate(self, requests: list[GenerationRequest], turns: Optional[Turns] = None) -> list[SampledResponse]:
        """Outputs in request order, n per request; a bad request gets finish_reason "error", the rest run. With
        `turns`, each sequence is an episode (`inference/episodes.py`)."""
        t0 = time.perf_counter()
        self._paging_stats = {}
        self.model.eval()
        device = next(self.model.parameters()).device
        outputs: list[Optional[SampledResponse]] = []
        pending: list[_Seq] = []
        for r in requests:
            err = self._validate(r)
            base = r.params.seed if r.params.seed is not None else int(torch.randint(0, 2**31, (1,)))
            for k in range(max(r.params.n, 1)):
                if err is not None:
                    outputs.append(SampledResponse(r.request_id, k, list(r.prompt_ids), [], [], "error",
                                                    error=err))
                    continue
                outputs.append(None)
                seed = stream_seed(base, k)
                pending.append(_Seq(len(outputs) - 1, k, list(r.prompt_ids), r.params, seed, r.request_id,
                                    budget=turns.max_tokens if turns is not None else None))
        if pending:
            from megatron_rl.compat import suspended

            longest = max(len(s.prompt) + (s.params.max_new_tokens if turns is None else turns.max_tokens)
                          for s in pending)
            # Round the cache length up so that consecutive batches reuse the cache and its captured graphs.
            max_len = min(-(-longest // 128) * 128, self.max_len)
            cache = self._cache_for(min(self.max_batch_size, len(pending)), max_len)
            self.forward.prepare(cache.max_len)  # Megatron-Core's RoPE table names the CUDA device: build it here
            record_routes(self.model, self.routes.on)
            try:
                with suspended():  # the decode loop allocates only on the model's device
                    self._run(pending, cache, device, turns)
            finally:
                record_routes(self.model, False)
        for s in pending:
            text = self.tokenizer.decode(s.tokens) if self.tokenizer is not None else None
            outputs[s.req] = SampledResponse(s.request_id, s.sample, s.prompt, s.tokens, s.logprobs, s.finish,
                                              text=text, policy_mask=s.policy if turns is not None else None,
                                              turns=max(s.turns, 1), routes=self.routes.output(s))
        n_tokens = sum(len(s.tokens) if turns is None else s.sampled for s in pending)
        elapsed = time.perf_counter() - t0
        self.stats = {"generated_tokens": n_tokens, "time_s": elapsed, "tokens_per_s": n_tokens / max(elapsed, 1e-9),
                      "cuda_graph": any(step.graph is not None for step in self._steps.values()),
                      **self._paging_stats}
        return outputs  # type: ignore[return-value]

    def _prefill(self, admitted: list[_Seq], cache, device) -> None:
        """Fill the cache of newly admitted sequences (`Prefill`: a new sequence's prompt but its last token; an
        episode's turn that resumes, its last reply token and the observation but its last token)."""
        chunk = Prefill.of(admitted, cache.max_len)
        if chunk is None:
            return
        # kv_len given: no device-to-host read, so a step launched ahead keeps running meanwhile.
        c = chunk.to(lambda t: _to_device(t, device, self.cuda_rules_on))
        self.forward(c.tokens, c.positions, c.slots, cache, kv_len=c.kv_len, logits=False)
        routes = self.routes.take()
        if routes is not None:
            self.routes.prefilled(admitted, routes)

    def _run(self, pending: list[_Seq], cache, device, turns: Optional[Turns] = None) -> None:
        filtering = any(s.params.top_p < 1.0 or s.params.top_k > 0 for s in pending)
        noise = any(s.params.temperature > 0 for s in pending)
        if self.pipeline is not None:
            return self.pipeline.run(pending, cache, device, filtering, noise, turns)
        key = (filtering, noise)
        if key not in self._steps:
            use_graph = self.cuda_graphs and (device.type == "cuda" or self.cuda_rules_on)
            self._steps[key] = _DecodeStep(self, cache, device, filtering, noise, use_graph)
        step = self._steps[key]
        # Two host buffers (pinned on GPUs) for the tokens and log-probs of consecutive steps: step t's are read
        # while step t + 1 copies into the other one.
        pin = device.type == "cuda"
        host = [(torch.empty(cache.slots, dtype=torch.long, pin_memory=pin),
                 torch.empty(cache.slots, dtype=torch.float32, pin_memory=pin)) for _ in range(2)]
        waiting = list(pending)
        by_slot: dict[int, _Seq] = {}  # running sequences (not known to have finished)
        free = list(range(cache.slots))
        pool = BlockPool(cache) if isinstance(cache, PagedKVCache) else None
        preempted = batched = 0  # sequences preempted (paged cache); sequences over the decode steps
        in_flight = None  # (tokens, logprobs, ready event or None, {slot: sequence} when launched, routes or None)
        launched = 0
        # Episodes: turns handed to `turns.start` at the last iteration (their slots held), and the sequences whose
        # observation came at the last iteration, to resume in their own slots at this one.
        answering: list[_Seq] = []
        resuming: list[_Seq] = []
        while waiting or by_slot or in_flight or answering or resuming:
            admitted = resuming
            resuming = []
            for seq in admitted:
                by_slot[seq.slot] = seq
            if pool is not None:  # blocks for the running sequences' next positions, preempting where they lack
                preempted += self._grow(pool, by_slot, admitted, waiting, free)
            while waiting and free and (pool is None or pool.admits(len(waiting[0].history), len(by_slot))):
                seq = waiting.pop(0)
                seq.slot = free.pop(0)
                seq.admitted_at = launched
                by_slot[seq.slot] = seq
                admitted.append(seq)
                if pool is not None:
                    pool.grow(seq.slot, len(seq.history))
            if not (by_slot or in_flight or answering):  # nothing runs and nothing could start: never spin
                raise RuntimeError(f"{len(waiting)} sequences wait for a cache of {cache.slots} slots")
            self._prefill(admitted, cache, device)
            step.admit(admitted)
            current = None
            if by_slot:
                batched += len(by_slot)
                tokens, logprobs, routes = step(sorted(by_slot))
                toks_h, lps_h = host[launched % 2]
                routes_h = self.routes.to_host(routes, launched % 2, pin)
                launched += 1
                toks_h.copy_(tokens, non_blocking=True)
                lps_h.copy_(logprobs, non_blocking=True)
                ready = None
                if device.type == "cuda":
                    ready = torch.cuda.Event()
                    ready.record()
                current = (toks_h, lps_h, ready, dict(by_slot), routes_h)
            if self.lookahead:
                done, in_flight = in_flight, current
            else:
                done = current
            ended = self._take(done, by_slot, free, turns, pool) if done is not None else []
            if answering:  # this iteration's step launched: the observations of the turns that ended at the last
                resuming = self._observe(answering, turns.finish(), turns, free, pool)
            answering = ended
            if ended:
                turns.start([s.ended_turn() for s in ended])
        self._paging_stats = {"mean_batch": batched / max(launched, 1)}
        if pool is not None:
            self._paging_stats.update(kv_blocks_peak=pool.peak, kv_blocks=cache.blocks, preempted=preempted)

    def _grow(self, pool: BlockPool, by_slot: dict, resumed: list, waiting: list, free: list) -> int:
        """Give every running sequence the blocks for its next decode position (and a resumed episode those of its
        observation); where the cache runs out, preempt the sequence admitted last (its blocks freed, its slot
        too, back to the front of `waiting` with nothing cached). Returns how many were preempted."""
        preempted = 0
        need = lambda q: len(q.prompt) + len(q.tokens)  # noqa: E731 - positions up to its last token's
        while sum(pool.missing(slot, need(q)) for slot, q in by_slot.items()) > len(pool.free):
            if len(by_slot) == 1 and set(pool.held) <= set(by_slot):  # alone in the cache, and still too long
                (q,) = by_slot.values()
                raise RuntimeError(f"a sequence of {need(q)} tokens does not fit the paged KV cache of "
                                   f"{pool.cache.blocks * pool.block_size} tokens (generator.kv_cache_tokens)")
            # (Alone but beside episodes that hold blocks while their environments answer: it waits for them.)
            slot, victim = max(by_slot.items(), key=lambda item: item[1].admitted_at)
            del by_slot[slot]
            if victim in resumed:
                resumed.remove(victim)
            pool.release(slot)
            free.append(slot)
            victim.cached, victim.slot = 0, -1
            waiting.insert(0, victim)
            preempted += 1
        for slot, q in by_slot.items():
            pool.grow(slot, need(q))
        return preempted

    def _take(self, done, by_slot: dict, free: list[int], turns: Optional[Turns],
              pool: Optional[BlockPool] = None) -> list[_Seq]:
        """Append a finished step's tokens to its sequences; a sequence that stops frees its slot (and its cache
        blocks), or, in an episode, holds it: those are returned (their turn has ended)."""
        toks_h, lps_h, ready, slots, routes_h = done
        if ready is not None:
            ready.synchronize()
        tokens, logprobs = toks_h.tolist(), lps_h.tolist()
        ended = []
        for slot, s in slots.items():
            if s.finish is not None:  # ended at the previous step: this one ran ahead for nothing
                continue
            if routes_h is not None:  # the routes of the token this step fed (its last, at len(history) - 1)
                s.routes.append(routes_h[slot][None])
            if self._append(s, tokens[slot], logprobs[slot]):
                del by_slot[slot]
                if turns is None:
                    free.append(slot)
                    if pool is not None:
                        pool.release(slot)
                else:  # its slot is held while the environment answers
                    ended.append(s)
        return ended

    def _append(self, s: _Seq, token: int, logprob: float) -> bool:
        """Append a token `s` sampled; True when it ends the sequence or, in an episode, its turn (`s.finish`)."""
        s.tokens.append(token)
        s.logprobs.append(logprob)
        s.policy.append(True)
        s.sampled += 1
        s.finish = self._stopped(s, token)
        if s.finish is None:
            return False
        s.turns += 1
        return True

    def _observe(self, ended: list[_Seq], observations: list, turns: Turns, free: list[int],
                 pool: Optional[BlockPool] = None) -> list[_Seq]:
        """Apply the environments' answers to the turns that ended: an episode that is over (its environment said
        so, or its turns, token budget or context are used up) frees its slot into `free`; the others get their
        observation's ids appended and are returned, to resume in their own slots (prefilled from their last reply
        token). The pipelined generator calls it with a lane's sequences and free slots."""
        resuming = []
        for s, obs in zip(ended, observations):
            used = len(s.tokens) + (len(obs) if obs is not None else 0)
            if obs is None:
                s.finish = "done"
            elif s.turns >= turns.max_turns:
                s.finish = "turns"
            elif not obs or used + 1 > turns.max_tokens or len(s.prompt) + used + 1 >= self.max_len:
                s.finish = "length"
            else:
                s.cached = len(s.prompt) + len(s.tokens) - 1  # the last reply token was sampled, never fed
                s.tokens += obs
                s.logprobs += [0.0] * len(obs)
                s.policy += [False] * len(obs)
                s.turn_start = len(s.tokens)
                s.finish = None
                resuming.append(s)
                continue
            free.append(s.slot)
            if pool is not None:
                pool.release(s.slot)
        return resuming

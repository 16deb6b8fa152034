"""The generator executor's sampling: requests in, sampled responses with behaviour log-probs out.

`Generator.generate(requests, turns)` expands each request into `n` sequences (`inference/sequence.py`; sample k of
a request seeded s is seeded `stream_seed(s, k)`) and runs them through the request-level engine
(`inference/engine.py`): continuous batching over a KV cache of slots, each step prefilling the sequences just
admitted and decoding one token for every running one, a finished sequence freeing its slot at once. Every
tensor-parallel rank of a replica runs the same engine on the same requests (the vocabulary is gathered for the
sampled positions only) and draws the same tokens from the same per-sequence seeds.

With `kv_cache_tokens` the cache is paged (`kv_forward.PagedKVCache`, `inference/paging.py`): a sequence holds blocks
of positions as it grows, and when the running sequences outgrow the cache the one admitted last is preempted and
prefilled again later, so more sequences decode at once in the same memory where lengths vary. A CUDA graph replays
the decode step (`inference/decode_step.py`), which reads the block table and gathers each slot's blocks.

With `turns` (`inference/episodes.py`), a sequence is an episode: when a turn ends, the sequence keeps its slot and
its cache while its environment answers and the other sequences decode; the observation's token ids are appended
(no loss: `SampledResponse.policy_mask`), only they are prefilled into the slot, and decoding resumes, with the
sequence's sampling stream continuing where the last turn left it (`EpisodeLoop`, the engine's client). A pipelined
generator plays episodes the same way, a lane's round standing for an engine step (`inference/pipeline.py`), with the
same `Sequence` rules and prefill.

With `record_routes` (a mixture-of-experts model; routing replay), every forward records the experts each MoE layer
chose for each token it fed, and each output carries them as `routes` (`inference/routes.py`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.compat import cuda_rules
from megatron_rl.inference.decode_step import DecodeStep
from megatron_rl.inference.engine import Engine
from megatron_rl.inference.episodes import EpisodeLoop, Turns
from megatron_rl.inference.kv_forward import IncrementalForward
from megatron_rl.inference.pipeline import PipelinedDecode
from megatron_rl.inference.routes import RouteRecorder
from megatron_rl.inference.sampling import stream_seed
from megatron_rl.inference.sequence import GenerationRequest, SampledResponse, Sequence, StopRule
from megatron_rl.models.moe import record_routes

__all__ = ["Generator", "GenerationRequest", "SampledResponse"]


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
        self.stops = StopRule(self.max_len, tokenizer)
        self.forward = IncrementalForward(model, tp_group, self.cuda_rules_on)
        self.pipeline = None
        if pp_group is not None and pp_group.size() > 1:
            self.pipeline = PipelinedDecode(self.forward, pp_group, self._full_logits, self.stops)
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
        self.routes = RouteRecorder(model, self._check_routes(record_routes))
        self.live = None  # the engine kept across calls, once `inference/live.py` opened one

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

    @torch.no_grad()
    def generate(self, requests: list[GenerationRequest], turns: Optional[Turns] = None) -> list[SampledResponse]:
        """Outputs in request order, n per request; a bad request gets finish_reason "error", the rest run. With
        `turns`, each sequence is an episode (`inference/episodes.py`)."""
        if self.live is not None and self.live.engine.busy:
            raise RuntimeError("generate() while the live engine holds sequences in the cache (inference/live.py)")
        t0 = time.perf_counter()
        self._paging_stats = {}
        outputs = self.sequences(requests, turns)
        pending = [s for s in outputs if isinstance(s, Sequence)]
        if pending:
            longest = max(len(s.prompt) + (s.params.max_new_tokens if turns is None else turns.max_tokens)
                          for s in pending)
            cache = self._cache_for(min(self.max_batch_size, len(pending)), self.cache_length(longest))
            with self.decoding(cache):
                self._run(pending, cache, turns)
        outputs = [self.response(s) if isinstance(s, Sequence) else s for s in outputs]
        n_tokens = sum(len(s.tokens) if turns is None else s.sampled for s in pending)
        self.stats = self.run_stats(n_tokens, time.perf_counter() - t0, self._paging_stats)
        return outputs

    def sequences(self, requests: list[GenerationRequest], turns: Optional[Turns] = None) -> list:
        """Each request's n samples, in order: a `Sequence` to run, or a bad request's "error" response."""
        out: list = []
        for r in requests:
            err = self._validate(r)
            base = r.params.seed if r.params.seed is not None else int(torch.randint(0, 2**31, (1,)))
            for k in range(max(r.params.n, 1)):
                if err is not None:
                    out.append(SampledResponse(r.request_id, k, list(r.prompt_ids), [], [], "error", error=err))
                    continue
                out.append(Sequence(len(out), k, list(r.prompt_ids), r.params, stream_seed(base, k), r.request_id,
                                    episode=turns is not None, budget=turns.max_tokens if turns is not None else None))
        return out

    def response(self, s: Sequence) -> SampledResponse:
        """A finished sequence's output (an episode split by a rewrite: its parts before the last in `parts`)."""
        text = self.tokenizer.decode(s.tokens) if self.tokenizer is not None else None
        parts = [SampledResponse(s.request_id, s.sample, p["prompt"], p["tokens"], p["logprobs"], "rewritten",
                                 text=self.tokenizer.decode(p["tokens"]) if self.tokenizer is not None else None,
                                 policy_mask=p["policy"], turns=max(s.turns, 1), versions=p["versions"] or None,
                                 routes=self.routes.output(p["routes"], len(p["prompt"]) + len(p["tokens"])))
                 for p in s.parts]
        return SampledResponse(s.request_id, s.sample, s.prompt, s.tokens, s.logprobs, s.finish, text=text,
                               policy_mask=s.policy if s.episode else None, turns=max(s.turns, 1),
                               versions=list(s.versions) if s.versions else None,
                               routes=self.routes.output(s.routes, s.length),
                               parts=parts or None)

    def cache_length(self, longest: int) -> int:
        """The cache's length for sequences of up to `longest` tokens: rounded up, so that consecutive batches reuse
        the cache and its captured graphs."""
        return min(-(-longest // 128) * 128, self.max_len)

    @contextlib.contextmanager
    def decoding(self, cache):
        """Around engine steps: no autograd, the model in eval mode with its RoPE table built for the cache (it names
        the CUDA device: built here, not inside a captured step), routes recorded where asked, and allocations only
        on the model's device."""
        from megatron_rl.compat import suspended

        self.model.eval()
        self.forward.prepare(cache.max_len)
        record_routes(self.model, self.routes.on)
        try:
            with torch.no_grad(), suspended():
                yield
        finally:
            record_routes(self.model, False)

    def run_stats(self, n_tokens: int, elapsed: float, engine_stats: dict) -> dict:
        return {"generated_tokens": n_tokens, "time_s": elapsed, "tokens_per_s": n_tokens / max(elapsed, 1e-9),
                "cuda_graph": any(step.graph is not None for step in self._steps.values()), **engine_stats}

    def engine(self, cache, filtering: bool, noise: bool) -> Engine:
        """An engine over `cache` for sequences of these sampling features (one stage only)."""
        device = next(self.model.parameters()).device
        return Engine(self.forward, self._decode_step(cache, device, filtering, noise), cache, self.routes,
                      self.stops, device, self.lookahead, self.cuda_rules_on)

    def _run(self, pending: list[Sequence], cache, turns: Optional[Turns] = None) -> None:
        """Decode `pending` to the end: the pipelined loop, or the engine stepped until it is idle (its episodes
        answered between steps)."""
        filtering = any(s.params.top_p < 1.0 or s.params.top_k > 0 for s in pending)
        noise = any(s.params.temperature > 0 for s in pending)
        if self.pipeline is not None:
            device = next(self.model.parameters()).device
            return self.pipeline.run(pending, cache, device, filtering, noise, turns)
        engine = self.engine(cache, filtering, noise)
        for seq in pending:
            engine.add(seq)
        episodes = EpisodeLoop(turns, self.max_len) if turns is not None else None
        while engine.busy:
            ended = engine.step()
            if episodes is not None:
                episodes.after_step(engine, ended)
        self._paging_stats = engine.stats()

    def _decode_step(self, cache, device, filtering: bool, noise: bool) -> DecodeStep:
        """The decode step for these sampling features, built (and captured) once per cache."""
        key = (filtering, noise)
        if key not in self._steps:
            use_graph = self.cuda_graphs and (device.type == "cuda" or self.cuda_rules_on)
            self._steps[key] = DecodeStep(self.forward, self._full_logits, self.routes, cache, device, filtering,
                                          noise, use_graph, self.cuda_rules_on)
        return self._steps[key]

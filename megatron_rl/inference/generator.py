"""The generator executor's sampling loop: continuous batching over a slot KV cache, behaviour log-probs.

Requests are expanded into sequences (n per request), which wait for a free cache slot. Each step prefills the
sequences that just got a slot (one batched chunk, right-padded) and decodes one token for every running one;
a finished sequence frees its slot at once, so a long tail does not idle the batch. Every tensor-parallel rank
of a replica runs the same loop on the same requests (the vocabulary is gathered for the sampled positions
only) and draws the same tokens from the same per-sequence seeds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.inference.kv_forward import IncrementalForward
from megatron_rl.inference.sampling import SamplingParams, sample_token


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: Optional[str] = None


@dataclass
class GenerationOutput:
    request_id: Optional[str]
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # log mu(token) under softmax(logits / T), T = 1 for greedy
    finish_reason: str  # "stop" (stop token or string), "length", or "error"
    weight_version: int
    text: Optional[str] = None
    error: Optional[str] = None


@dataclass
class _Seq:
    req: int
    sample: int
    prompt: list[int]
    params: SamplingParams
    rng: torch.Generator
    request_id: Optional[str] = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    slot: int = -1
    finish: Optional[str] = None


class Generator:
    """Batched sampling for one generator replica (all of its TP ranks call `generate` with the same requests)."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, tp_group, max_batch_size: int = 64,
                 max_len: Optional[int] = None, tokenizer=None):
        self.model = model
        self.vocab_size = vocab_size
        self.tp_group = tp_group
        self.max_batch_size = max_batch_size
        self.max_len = max_len or model.max_sequence_length
        self.tokenizer = tokenizer
        self.forward = IncrementalForward(model, tp_group)
        self.weight_version = 0
        self.stats: dict = {}
        self._cache = None

    def _cache_for(self, slots: int, max_len: int):
        c = self._cache
        if c is None or c.slots < slots or c.max_len < max_len:
            self._cache = self.forward.allocate_cache(slots, max_len)
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
        if len(seq.tokens) >= p.max_new_tokens or len(seq.prompt) + len(seq.tokens) >= self.max_len:
            return "length"
        return None

    @torch.no_grad()
    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        """Outputs in request order, n per request; a bad request gets finish_reason "error", the rest run."""
        t0 = time.perf_counter()
        self.model.eval()
        device = next(self.model.parameters()).device
        outputs: list[Optional[GenerationOutput]] = []
        pending: list[_Seq] = []
        for i, r in enumerate(requests):
            err = self._validate(r)
            for k in range(max(r.params.n, 1)):
                if err is not None:
                    outputs.append(GenerationOutput(r.request_id, k, list(r.prompt_ids), [], [], "error",
                                                    self.weight_version, error=err))
                    continue
                rng = torch.Generator()
                seed = r.params.seed if r.params.seed is not None else torch.randint(0, 2**31, (1,)).item()
                rng.manual_seed((int(seed) * 1_000_003 + k) % (2**63))
                outputs.append(None)
                pending.append(_Seq(len(outputs) - 1, k, list(r.prompt_ids), r.params, rng, r.request_id))
        if pending:
            longest = max(len(s.prompt) + s.params.max_new_tokens for s in pending)
            cache = self._cache_for(min(self.max_batch_size, len(pending)), min(longest, self.max_len))
            self._run(pending, cache, device)
        for s in pending:
            text = self.tokenizer.decode(s.tokens) if self.tokenizer is not None else None
            outputs[s.req] = GenerationOutput(s.request_id, s.sample, s.prompt, s.tokens,
                                              s.logprobs, s.finish, self.weight_version, text=text)
        n_tokens = sum(len(s.tokens) for s in pending)
        elapsed = time.perf_counter() - t0
        self.stats = {"generated_tokens": n_tokens, "time_s": elapsed, "tokens_per_s": n_tokens / max(elapsed, 1e-9)}
        return outputs  # type: ignore[return-value]

    def _run(self, pending: list[_Seq], cache, device) -> None:
        waiting = list(pending)
        running: list[_Seq] = []
        free = list(range(cache.slots))
        while waiting or running:
            # Admit waiting sequences into free slots and prefill them (all but their last prompt token).
            admitted = []
            while waiting and free:
                seq = waiting.pop(0)
                seq.slot = free.pop(0)
                admitted.append(seq)
            prefill = [s for s in admitted if len(s.prompt) > 1]
            if prefill:
                width = max(len(s.prompt) - 1 for s in prefill)
                toks = torch.zeros(len(prefill), width, dtype=torch.long)
                pos = torch.zeros(len(prefill), width, dtype=torch.long)
                for j, s in enumerate(prefill):
                    n = len(s.prompt) - 1
                    toks[j, :n] = torch.tensor(s.prompt[:n])
                    # Padding sits at positions >= n: decoding overwrites those cache entries before any
                    # query attends to them.
                    pos[j] = torch.arange(width)
                slots = torch.tensor([s.slot for s in prefill])
                self.forward(toks.to(device), pos.to(device), slots.to(device), cache)
            running += admitted
            # One decode step for every running sequence: feed its last token at its position.
            last = [s.tokens[-1] if s.tokens else s.prompt[-1] for s in running]
            position = [len(s.prompt) + len(s.tokens) - 1 for s in running]
            logits = self.forward(torch.tensor(last, device=device)[:, None],
                                  torch.tensor(position, device=device)[:, None],
                                  torch.tensor([s.slot for s in running], device=device), cache)
            full = self._full_logits(logits[:, 0]).cpu()
            still = []
            for j, s in enumerate(running):
                tok, lp = sample_token(full[j], s.params, s.rng)
                s.tokens.append(tok)
                s.logprobs.append(lp)
                s.finish = self._stopped(s, tok)
                if s.finish is None:
                    still.append(s)
                else:
                    free.append(s.slot)
            running = still


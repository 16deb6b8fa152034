"""Requests from the endpoint decoded by a live engine, continuously: `megatron-rl serve`'s backend.

The endpoint's thread parses a request and queues it (`handle`); the generator's thread (`serve`) admits whatever
is queued between two engine steps, so a request arriving while others decode takes the next free slot instead of
waiting for them to drain, and each one is answered the moment its sequence ends. Requests sample with their own
temperature, top_p, seed and max_tokens (the command's defaults where they give none). A seeded request draws
from its own stream (`inference/sampling.py`); the engine always runs its top-p-capable step, so its draws are those
of `Generator.generate` with top_p < 1 (a request alone equals `generate`'s tokens bit for bit:
tests/test_serving.py; beside others, the batch's numerics may move a logit).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from megatron_rl.inference import GenerationRequest, SamplingParams
from megatron_rl.inference.live import LiveGeneration
from megatron_rl.serving.protocol import ChatRequest, CompletionRequest, ProtocolError, reply_body
from megatron_rl.tokenizers.turns import TurnTemplate


class EngineServer:
    """A generator (one pipeline stage) behind the endpoint (module docstring). `defaults`: the sampling of a
    request that sets nothing."""

    def __init__(self, gen, tokenizer, chat: bool, model: str, defaults: SamplingParams):
        self.gen, self.tok, self.model, self.defaults = gen, tokenizer, model, defaults
        self.template = TurnTemplate(tokenizer, chat)
        self.live = LiveGeneration(gen, gen.max_len, filtering=True, noise=True, version=0)
        self._queue: "queue.Queue" = queue.Queue()
        self.served = 0  # requests answered

    def handle(self, kind: str, body: dict) -> Future:
        """The endpoint's handler: parse (ProtocolError at once for a bad body), render, queue."""
        if kind == "chat":
            req = ChatRequest.parse(body)
            try:
                prompt = self.template.prompt(req.messages, req.tools)
            except (ValueError, KeyError, TypeError) as e:
                raise ProtocolError(400, f"the chat template cannot render these messages: {e}") from None
        else:
            req = CompletionRequest.parse(body)
            prompt = req.prompt if isinstance(req.prompt, list) else self.tok.encode(
                req.prompt, add_bos=self.tok.bos_id is not None)
        d, asked = self.defaults, req.sampling
        params = SamplingParams(temperature=d.temperature if asked.temperature is None else float(asked.temperature),
                                top_p=d.top_p if asked.top_p is None else float(asked.top_p), top_k=d.top_k,
                                max_new_tokens=asked.max_tokens or d.max_new_tokens,
                                stop_token_ids=tuple(sorted(self.tok.stop_ids)), seed=asked.seed)
        fut: Future = Future()
        self._queue.put((kind, req, GenerationRequest(prompt, params), fut))
        return fut

    def serve(self, stop: threading.Event) -> None:
        """Decode what is queued until `stop` is set (in the generator's thread)."""
        pending: dict[int, tuple] = {}  # id(sequence) -> (kind, request, future)
        while not stop.is_set():
            if not self._admit(pending, block=True):
                continue
            with self.gen.decoding(self.live.cache):
                engine = self.live.engine
                while engine.busy:
                    self._answer(engine.step(), pending)
                    self._admit(pending, block=False)
                self._answer(engine.drain(), pending)

    def _admit(self, pending: dict, block: bool) -> bool:
        taken = 0
        while True:
            try:
                kind, req, greq, fut = self._queue.get(timeout=0.2) if block and not taken else \
                    self._queue.get_nowait()
            except queue.Empty:
                return taken > 0
            handle = self.live.add([greq])[0]
            if not hasattr(handle, "finish"):  # a request the generator refuses (its prompt does not fit)
                fut.set_exception(ProtocolError(400, handle.error, "context_length_exceeded"))
                continue
            pending[id(handle)] = (kind, req, fut, handle)
            taken += 1

    def _answer(self, ended: list, pending: dict) -> None:
        for seq in ended:
            kind, req, fut, _ = pending.pop(id(seq))
            out = self.gen.response(seq)
            self.served += 1
            fut.set_result(reply_body(self.model, self.tok, kind, req, out.prompt_ids, out.token_ids, out.logprobs,
                                      out.finish_reason, f"call_{self.served}"))

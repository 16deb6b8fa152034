"""`megatron-rl serve CKPT`: the OpenAI-compatible endpoint over a checkpoint, without training: for evaluating an
agent against a trained policy, or trying one out with the `openai` client.

The checkpoint is checked as `eval` checks it (its metadata, its files against their checksums, its pickles holding
only data; a run's step is held against the run's retention while it is served), its model loaded on one local
process (`evaluation.eval.load_model`) and decoded by a live engine (`serving/engine_server.py`): requests arriving
while others decode take the next free cache slot. It listens on 127.0.0.1 by default; every request must carry the
key (`--key`, or a new random one printed with the address). Ctrl-C or SIGTERM stops it.
"""

from __future__ import annotations

import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from megatron_rl.checkpointing import safe_load
from megatron_rl.checkpointing.inspect import reading
from megatron_rl.checkpointing.layout import MODEL_DIR, CheckpointError, InspectError, verify_weights
from megatron_rl.evaluation.eval import (EvalError, _compute_dtype, _dtype_of, checkpoint_tokenizer,
                                         read_checkpoint_meta)


@dataclass
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    key: Optional[str] = None  # None: a new random key, printed with the address
    batch_size: int = 16  # sequences decoded together (cache slots)
    max_len: Optional[int] = None  # a sequence's most tokens, prompt and reply (default: the model's positions)
    max_tokens: int = 256  # a reply's most tokens where a request sets none
    temperature: float = 1.0
    top_p: float = 1.0
    tokenizer: Optional[str] = None
    chat: Optional[bool] = None
    dtype: Optional[str] = None


def serve(checkpoint: Union[str, Path], s: Optional[ServeSettings] = None) -> dict:
    """Serve `checkpoint` until stopped; returns what was served. EvalError (one line) for a checkpoint or setting
    that cannot be served."""
    s = s or ServeSettings()
    for name, value in (("--batch-size", s.batch_size), ("--max-tokens", s.max_tokens)):
        if value < 1:
            raise EvalError(f"{name}={value} must be >= 1")
    _check_port(s.host, s.port)
    try:
        held = reading(Path(checkpoint))
    except InspectError as e:
        raise EvalError(str(e)) from None
    with held as ckpt:
        cfg, meta = read_checkpoint_meta(ckpt)
        compute = _compute_dtype(s.dtype, _dtype_of(meta))
        try:
            verify_weights(ckpt, meta)
            safe_load.check_checkpoint(ckpt)
        except CheckpointError as e:
            raise EvalError(str(e)) from None
        tok = checkpoint_tokenizer(ckpt, s.tokenizer)
        if tok.vocab_size > cfg.vocab_size:
            raise EvalError(f"the tokenizer has {tok.vocab_size} tokens but the model's vocabulary has "
                            f"{cfg.vocab_size}; pass the model's tokenizer with --tokenizer")
        max_len = min(s.max_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        key = s.key or secrets.token_urlsafe(18)
        from megatron_rl.launch.spawn import run_local  # imports torch: after the checks

        return run_local(_serve_worker, 1, cfg, str(ckpt), compute, s, max_len, key, backend="auto", timeout=None,
                         stop_grace_s=30.0, dist_timeout_s=1800.0)[0]


def _check_port(host: str, port: int) -> None:
    """One line now for an address the endpoint could not listen on (taken, or not this machine's)."""
    import socket

    if not 0 <= port <= 65535:
        raise EvalError(f"--port={port} must be in [0, 65535]")
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise EvalError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _serve_worker(rank, world_size, cfg, ckpt: str, dtype: str, s: ServeSettings, max_len: int, key: str) -> dict:
    import signal
    import threading

    from megatron_rl.evaluation.eval import load_model
    from megatron_rl.inference import Generator, SamplingParams
    from megatron_rl.parallel import ParallelLayout
    from megatron_rl.serving.engine_server import EngineServer
    from megatron_rl.serving.server import Endpoint

    tok = checkpoint_tokenizer(Path(ckpt), s.tokenizer)
    g, model = load_model(cfg, str(Path(ckpt) / MODEL_DIR), dtype, ParallelLayout())
    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=s.batch_size, max_len=max_len, tokenizer=tok)
    chat = tok.has_chat_template if s.chat is None else s.chat
    server = EngineServer(gen, tok, chat, cfg.name,
                          SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_tokens))
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    endpoint = Endpoint(cfg.name, key, server.handle, host=s.host, port=s.port).start()
    shown = "the key given with --key" if s.key else f"key {key}"
    print(f"megatron-rl: serve: {ckpt} at {endpoint.url} (model {cfg.name!r}, {shown}); Ctrl-C stops it",
          file=sys.stderr, flush=True)
    try:
        server.serve(stop)
    finally:
        endpoint.close()
    return {"checkpoint": ckpt, "url": endpoint.url, "served": server.served}

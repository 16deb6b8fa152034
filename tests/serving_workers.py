"""Worker functions for the endpoint's tests: a tiny generator behind `serving.Endpoint`, asked by the real `openai`
client from another thread of the same process."""

from __future__ import annotations

import threading

import torch

from gen_workers import _setup
from megatron_rl.inference import GenerationRequest, Generator, SamplingParams
from megatron_rl.serving.engine_server import EngineServer
from megatron_rl.serving.server import Endpoint
from megatron_rl.tokenizers.byte import ByteTokenizer
from megatron_rl.training.engine import model_forward
from megatron_rl.training.logprobs import target_logprobs

KEY = "run-key"


def serve_worker(rank, world_size, cfg, full, asks):
    """Serve the tiny model; `asks(base_url, key)` (in a client thread) returns what it saw. Returns that, and the
    reference: each response's ids decoded again by `Generator.generate` with the same prompt and sampling, and
    teacher-forced log-probs of its ids."""
    g, model = _setup(cfg, full, 1)
    tok = ByteTokenizer()
    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=4, max_len=320, tokenizer=tok)
    server = EngineServer(gen, tok, chat=False, model="tiny-test",
                          defaults=SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16))
    endpoint = Endpoint("tiny-test", KEY, server.handle).start()
    stop, seen = threading.Event(), {}

    def client():
        try:
            seen["result"] = asks(endpoint.url, KEY)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            seen["error"] = repr(e)
        finally:
            stop.set()

    thread = threading.Thread(target=client)
    thread.start()
    server.serve(stop)
    thread.join()
    endpoint.close()
    if "error" in seen:
        return seen
    refs = []
    for prompt, token_ids, temperature, seed, top_p, max_tokens in seen["result"].get("replay", []):
        params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_tokens, seed=seed,
                                stop_token_ids=tuple(sorted(tok.stop_ids)))
        out = gen.generate([GenerationRequest(prompt, params)])[0]
        seq = torch.tensor([prompt + token_ids])
        with torch.no_grad():
            lp = target_logprobs(model_forward(model, seq, False), seq, g.pgs.tp, cfg.vocab_size,
                                 temperature or 1.0)
        refs.append((out.token_ids, out.logprobs, lp[0, len(prompt):].tolist()))
    return {**seen, "refs": refs}


def agents_worker(rank, world_size, cfg, full, cases: list, timeout_s: float, out_dir: str,
                  spec: str = "agent_cases:counting"):
    """One batch of `agent_cases:counting` episodes through the job's own `Agents` (byte tokenizer, plain turns), one
    per (prompt, metadata) of `cases`: each output (finish, ids, log-probs, policy mask, turns), the returns, the
    statistics, and the failure lines."""
    from megatron_rl.agents.play import Agents
    from megatron_rl.data import PromptRecord
    from megatron_rl.environments.settings import EnvSettings

    g, model = _setup(cfg, full, 1)
    tok = ByteTokenizer()
    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=4, max_len=160, tokenizer=tok)
    env = EnvSettings(agent=spec, max_turns=3, max_tokens=100, timeout_s=timeout_s, num_workers=len(cases))
    agents = Agents(env, tok, chat=False, replica_group=g.pgs.mp, is_leader=True,
                    sampling=SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=(tok.eos_id,)),
                    log_path=f"{out_dir}/workers.log")
    try:
        records = [PromptRecord(f"r{i}", prompt, metadata={**meta, "out": f"{out_dir}/seen{i}.json"})
                   for i, (prompt, meta) in enumerate(cases)]
        reqs, turns = agents.requests(records, list(range(len(records))), 1)
        outs = gen.generate(reqs, turns=turns)
        returns, stats = turns.returns(), turns.statistics(outs)
        errors = [e.error for e in turns.episodes]
    finally:
        agents.close()
    parts = [[(p.prompt_ids, p.token_ids, p.logprobs, p.policy_mask) for p in o.parts or []] for o in outs]
    return ([(o.finish_reason, o.prompt_ids, o.token_ids, o.logprobs, o.policy_mask, o.turns) for o in outs],
            returns, stats, errors, parts)

"""The GPU twins of the CUDA-rules tests: each runs the real CUDA path on one GPU and checks it against an
independent reference. `tests/test_gpu.py` runs them, each in a process of its own that sees the GPU (the test
session itself hides it, `conftest.py`):

    python tests/gpu_checks.py decode|int8|checkpoint DIR

Each check ends with exit code 0 and one JSON line, or with the AssertionError that says what differed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPTS = [[5, 17, 42, 99], [7], [250, 3, 3, 3, 8, 61, 12, 4, 90], [1, 2]]
NEW = 12


def _tiny_llama():
    """conftest's tiny random Llama (transformers' model, its Megatron config and weights). Importing conftest hides
    the GPUs from this process's children (the ranks): they are shown again as this check found them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    from conftest import make_tiny_llama

    if visible is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    return make_tiny_llama(num_layers=3, seed=0, name="tiny-gpu")


def _hf_greedy(hf, prompts, new):
    """transformers' greedy continuation and its log-probs (fp64 softmax) on the CPU: the reference."""
    tokens, logprobs = [], []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.no_grad():
            lp = torch.log_softmax(hf(out).logits[0, len(p) - 1:-1].double(), dim=-1)
        tokens.append(out[0, len(p):].tolist())
        logprobs.append(lp.gather(1, out[0, len(p):, None])[:, 0])
    return tokens, logprobs


def decode_worker(rank, world_size, cfg, full, requests):
    """Greedy generation on this rank's GPU at TP1: the decode step captured in a CUDA graph, pinned copies."""
    from gen_workers import _setup

    from megatron_rl.inference import Generator

    g, model = _setup(cfg, full, 1)
    assert next(model.parameters()).is_cuda
    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=4, max_len=64)
    outs = gen.generate(requests)
    return [(o.token_ids, o.logprobs) for o in outs], gen.stats["cuda_graph"]


def _close(outs, want, want_lp, bound):
    assert [t for t, _ in outs] == want, ([t for t, _ in outs], want)
    gap = max((torch.tensor(lp, dtype=torch.float64) - ref).abs().max().item() for (_, lp), ref in zip(outs, want_lp))
    assert gap < bound, gap
    return gap


def check_decode(_: Path) -> dict:
    """The generator's CUDA-graph decode at TP1 writes transformers' greedy tokens, log-probs within 1e-3."""
    from megatron_rl.inference import GenerationRequest, SamplingParams
    from megatron_rl.launch.spawn import run_local

    hf, cfg, full = _tiny_llama()
    want, want_lp = _hf_greedy(hf, PROMPTS, NEW)
    reqs = [GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=NEW)) for p in PROMPTS]
    (outs, graph), = run_local(decode_worker, 1, cfg, full, reqs)
    assert graph, "the decode step was not captured in a CUDA graph"
    return {"cuda_graph": graph, "logprob_gap": _close(outs, want, want_lp, 1e-3)}


def check_int8(_: Path) -> dict:
    """The int8 generator on the GPU writes what transformers writes on the same int8-rounded weights."""
    from gen_workers import int8_generate_worker
    from test_quantized_generator import _int8_reference

    from megatron_rl.inference import GenerationRequest, SamplingParams
    from megatron_rl.launch.spawn import run_local

    hf, cfg, full = _tiny_llama()
    want, want_lp = _hf_greedy(_int8_reference(hf, 1), PROMPTS, NEW)
    reqs = [GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=NEW)) for p in PROMPTS]
    (outs, before, after, names), = run_local(int8_generate_worker, 1, cfg, full, 1, reqs, "build")
    assert after < 0.6 * before and len(names) == 4 * cfg.num_layers
    return {"logprob_gap": _close(outs, want, want_lp, 1e-3), "weight_bytes_ratio": after / before}


def check_checkpoint(root: Path) -> dict:
    """A checkpoint saved in the background from the GPU (pinned staging copies, the next step running before the
    files are written) holds the state of the save: a fresh trainer restored from it takes the same next step as
    the one that saved it."""
    from ckpt_workers import load_and_continue, train_save_continue
    from rl_workers import random_full_state

    from megatron_rl.launch.spawn import run_local

    state = root / "full.pt"
    torch.save(random_full_state(), state)
    ref, = run_local(train_save_continue, 1, dict(tp=1), str(state), str(root / "ckpt"), 3, True)
    out, = run_local(load_and_continue, 1, dict(tp=1), ref["path"], 3)
    assert out["steps_done"] == 4 and out["rl_state"] == {"step": 3, "weight_version": 3}
    loss_gap = abs(out["metrics"]["loss"] - ref["metrics"]["loss"])
    assert loss_gap <= 1e-5 * abs(ref["metrics"]["loss"]) + 1e-6, loss_gap
    worst = max((out["params"][k] - v).abs().max().item() for k, v in ref["params"].items())
    assert worst <= 1e-5, worst
    return {"loss_gap": loss_gap, "max_weight_gap": worst}


CHECKS = {"decode": check_decode, "int8": check_int8, "checkpoint": check_checkpoint}

if __name__ == "__main__":
    assert torch.cuda.is_available(), "this check needs a GPU"
    name, where = sys.argv[1], Path(sys.argv[2])
    print(json.dumps({"check": name, "device": torch.cuda.get_device_name(), **CHECKS[name](where)}))

"""CUDA's rules under CPU CI (`MEGATRON_RL_CUDA_RULES=1`, megatron_rl/compat/cuda_rules.py).

The GPU code paths run here on CPU tensors and are held to what CUDA enforces: compiled kernels within a budget of
graphs under the job's call pattern, pinned copies that refuse overlapping tensors, a decode step free of what a
CUDA-graph capture forbids (at generator TP1, TP2 and PP2), NCCL's rules on gloo, one GPU per local rank, gloo
refused on GPUs, a CPU-made checkpoint's RNG states on a GPU, and a short colocated job with every executor option
(KL reference, held-out eval, int8 generator, reward model) within its per-function graph budget.
"""

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from megatron_rl.compat import cuda_rules
from megatron_rl.compat.compiled import CompiledKernel, compiled_graph_counts
from megatron_rl.models import fused
from megatron_rl.launch.spawn import run_local
import warm_cli

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def rules(monkeypatch):
    monkeypatch.setenv(cuda_rules.ENV, "1")
    for k in (fused._rms_norm_compiled, fused._rope_compiled):
        k.reset()
    yield
    for k in (fused._rms_norm_compiled, fused._rope_compiled):
        k.reset()


def rules_worker(rank, world_size, fn, *args):
    """Run a test worker with the CUDA-rules mode on (ranks start from a server started before the test set it)."""
    os.environ[cuda_rules.ENV] = "1"
    cuda_rules.install_nccl_rules()
    return fn(rank, world_size, *args)


# ------------------------------------------------------------------------------------------ compiled kernels


def _rms_calls():
    """RMSNorm as the job calls it: trainer widths with grad (fp32 and bf16 activations, fp32 weight), prefill and
    decode without grad (batch 1 and more), an 8-bit generator's bf16 weight, no weight, 2-D inputs, and a second
    model (a reward model) with another hidden size and eps."""
    g = torch.Generator().manual_seed(0)
    w64 = (1 + 0.1 * torch.randn(64, generator=g)).requires_grad_()
    w96 = 1 + 0.1 * torch.randn(96, generator=g)
    calls = []
    for dtype in (torch.float32, torch.bfloat16):
        for s, b in ((40, 2), (57, 4), (33, 2), (64, 1)):
            calls.append((torch.randn(s, b, 64, generator=g).to(dtype).requires_grad_(), w64, 1e-5, True))
        for s, b in ((7, 3), (1, 1), (1, 5), (1, 8), (12, 1)):
            calls.append((torch.randn(s, b, 64, generator=g).to(dtype), w64.detach(), 1e-5, False))
    calls.append((torch.randn(1, 4, 64, generator=g).bfloat16(), w64.detach().bfloat16(), 1e-5, False))
    calls.append((torch.randn(5, 2, 64, generator=g), None, 1e-5, False))
    calls.append((torch.randn(11, 64, generator=g), w64.detach(), 1e-5, False))
    calls.append((torch.randn(9, 2, 96, generator=g), w96, 1e-6, False))
    return calls


def test_compiled_rmsnorm_holds_its_graph_budget_under_the_jobs_call_pattern(rules):
    kernel = fused._rms_norm_compiled
    for x, w, eps, grad in _rms_calls():
        with torch.set_grad_enabled(grad):
            y = fused.rms_norm(x, w, eps, impl="compiled")
            ref = fused.rms_norm_math(x, w, eps)
            assert torch.equal(y, ref)
            if grad:
                gy = torch.ones_like(y)
                got = torch.autograd.grad(y, (x, w), gy)
                want = torch.autograd.grad(ref, (x, w), gy)
                assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert kernel.fallbacks == {}
    # One graph per specialization, each named by its key (here 16 of 24), whatever the number of sizes.
    assert kernel.graphs == len(kernel.graphs_by_key) <= kernel.max_keys, kernel.graphs_by_key


def _rope_calls():
    """RoPE as the job calls it: queries (contiguous) and keys (a strided view of the fused QKV output) for training
    widths with grad and for prefill and decode (s = 1, batch 1 and more), fp32 and bf16, one key head (GQA at
    high TP), and a rotary dimension smaller than the head's."""
    g = torch.Generator().manual_seed(1)
    calls = []
    for dtype in (torch.float32, torch.bfloat16):
        for s, b, grad, kv_heads in ((40, 2, True, 2), (57, 4, True, 2), (7, 3, False, 2), (1, 1, False, 2),
                                     (1, 5, False, 2), (1, 6, False, 1)):
            qkv = torch.randn(s, b, kv_heads, 4 * 8, generator=g).to(dtype)  # per group: 2 query heads, k, v
            q = qkv[..., :16].reshape(s, b, 2 * kv_heads, 8)
            k = qkv[..., 16:24]
            freqs = torch.randn(s, 1, 1, 8, generator=g)
            for t in (q, k):
                calls.append((t.detach().requires_grad_(grad) if grad else t, freqs, grad))
    calls.append((torch.randn(5, 2, 4, 16, generator=g), torch.randn(5, 1, 1, 8, generator=g), False))
    return calls


def test_compiled_rope_holds_its_graph_budget_under_the_jobs_call_pattern(rules):
    kernel = fused._rope_compiled
    for t, freqs, grad in _rope_calls():
        with torch.set_grad_enabled(grad):
            y = fused.apply_rope(t, freqs, compiled=True)
            ref = fused.rope_math(t, freqs)
            assert torch.equal(y, ref)
            if grad:
                assert torch.equal(*(torch.autograd.grad(o, t, torch.ones_like(o))[0] for o in (y, ref)))
    assert kernel.fallbacks == {}
    assert kernel.graphs == len(kernel.graphs_by_key) <= kernel.max_keys, kernel.graphs_by_key


def test_logprob_chunks_do_not_recompile_per_micro_batch(rules):
    from megatron_rl.training import logprobs

    fwd, bwd = logprobs._forward_chunk.kernel, logprobs._backward_chunk.kernel
    fwd.reset(), bwd.reset()
    g = torch.Generator().manual_seed(2)
    for b, s in ((2, 17), (3, 40), (2, 9), (4, 23), (1, 31), (2, 64)):
        logits = torch.randn(b, s, 50, generator=g).requires_grad_()
        tokens = torch.randint(0, 45, (b, s), generator=g)
        mask = torch.rand(b, s, generator=g) > 0.3
        lp, ent = logprobs.target_logprobs_and_entropy(logits, tokens, None, 45, 0.9, mask)
        (lp.sum() + 0.1 * ent.sum()).backward()
        grad = logits.grad
        os.environ[cuda_rules.ENV] = "0"  # the same call on the CPU's eager path
        ref_logits = logits.detach().requires_grad_()
        lp_ref, ent_ref = logprobs.target_logprobs_and_entropy(ref_logits, tokens, None, 45, 0.9, mask)
        (lp_ref.sum() + 0.1 * ent_ref.sum()).backward()
        os.environ[cuda_rules.ENV] = "1"
        assert torch.equal(lp, lp_ref) and torch.equal(ent, ent_ref) and torch.equal(grad, ref_logits.grad)
    assert fwd.fallbacks == bwd.fallbacks == {}
    assert fwd.graphs <= 2 and bwd.graphs <= 2, (fwd.graphs_by_key, bwd.graphs_by_key)


def test_a_kernel_that_cannot_compile_runs_eagerly_with_one_warning(rules, caplog):
    def with_graph_break(x):
        y = x * 2
        torch._dynamo.graph_break()  # which fullgraph=True refuses
        return y + 1

    kernel = CompiledKernel(with_graph_break, "test.graph_break", lambda x: (), max_keys=4)
    x = torch.arange(4.0)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert torch.equal(kernel(x), x * 2 + 1)
    assert len(kernel.fallbacks) == 1 and kernel.graphs == 0
    assert sum("test.graph_break runs eagerly" in r.getMessage() for r in caplog.records) == 1


def test_specializations_past_the_budget_run_eagerly(rules, caplog):
    kernel = CompiledKernel(lambda x: x * 2, "test.budget", lambda x: (), max_keys=2)
    dtypes = (torch.float32, torch.float64, torch.bfloat16)
    with caplog.at_level(logging.WARNING):
        for dtype in dtypes:
            assert torch.equal(kernel(torch.ones(3, dtype=dtype)), torch.full((3,), 2, dtype=dtype))
    assert kernel.graphs == 2 and len(kernel.fallbacks) == 1
    assert "specializations are all compiled" in next(iter(kernel.fallbacks.values()))


def test_graph_counts_include_megatrons_swiglu():
    counts = compiled_graph_counts()
    assert "megatron.swiglu" in counts and "fused.rms_norm" in counts


# ------------------------------------------------------------------------------------------------ pinned copies


def test_pin_memory_copies_and_refuses_overlapping_tensors_as_cuda_does(rules):
    grid = torch.arange(6).expand(3, 6)  # a prefill's position grid: every row is the same memory
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        cuda_rules.pin_memory(grid)
    pinned = cuda_rules.pin_memory(grid.contiguous())
    assert torch.equal(pinned, grid) and pinned.data_ptr() != grid.data_ptr()
    strided = torch.arange(12.0).view(3, 4)[:, ::2]  # non-overlapping, non-contiguous: CUDA pins it
    assert torch.equal(cuda_rules.pin_memory(strided), strided)
    from megatron_rl.compat import is_active

    if is_active():  # the CPU layer's Tensor.pin_memory keeps CUDA's rule in this mode
        with pytest.raises(RuntimeError, match="more than one element"):
            grid.pin_memory()


# ------------------------------------------------------------------------------------ CUDA-graph capture rules


@pytest.mark.parametrize("body, what", [
    (lambda t: t.sum().item(), "host sync"),
    (lambda t: int(t.max()), "host sync"),
    (lambda t: t.nonzero(), "nonzero"),
    (lambda t: t[t > 0], "boolean-mask indexing"),
    (lambda t: t.__setitem__(t > 0, 0.0), "boolean-mask write"),
    (lambda t: t.tolist(), "host read"),
])
def test_capture_checker_refuses_what_capture_forbids(body, what):
    with pytest.raises(cuda_rules.CaptureError, match=what):
        with cuda_rules.CaptureChecker("test"):
            body(torch.randn(4))
    with cuda_rules.CaptureChecker("test"):  # what capture allows
        t = torch.randn(4)
        t.masked_fill_(t > 0, 0.0)
        torch.where(t < 0, t, torch.zeros_like(t)).add_(1).clamp_(max=3)
    assert torch.Tensor.tolist(torch.ones(2)) == [1.0, 1.0]  # restored after the block


def _generate_both(rank, world_size, cfg, full, tp, requests, kv_cache_tokens=None):
    """Greedy generation with the CUDA-rules mode on (decode step captured-checked, pinned copies, lookahead, the
    compiled fusions) and off, on the same weights; with a paged cache of `kv_cache_tokens`, where given."""
    from gen_workers import _setup

    from megatron_rl.inference import Generator

    out = []
    for mode in ("1", "0"):
        os.environ[cuda_rules.ENV] = mode
        g, model = _setup(cfg, full, tp)
        gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=3, max_len=64, kv_cache_tokens=kv_cache_tokens)
        outs = gen.generate(requests)
        out.append(([o.token_ids for o in outs], [o.logprobs for o in outs], gen.lookahead,
                    getattr(model, "megatron_rl_fusions", None)))
    os.environ[cuda_rules.ENV] = "1"
    return out


@pytest.mark.parametrize("tp,kv_cache_tokens", [(1, None), (2, None), (1, 48)])
def test_generation_under_cuda_rules_equals_the_cpu_path(tiny_hf, tp, kv_cache_tokens):
    """The decode step passes the capture check and the pinned copies CUDA's rule (a prefill's expanded position
    grid was refused before), and its tokens equal the CPU path's; with a paged cache too (its block table read
    inside the captured step; 48 tokens for 3 slots: sequences preempted)."""
    from megatron_rl.inference import GenerationRequest, SamplingParams

    _, cfg, full = tiny_hf
    prompts = [[5, 17, 42, 99], [7], [250, 3, 3, 3, 8, 61, 12, 4, 90], [1, 2]]
    reqs = [GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=8)) for p in prompts]
    for (rules_out, cpu_out) in run_local(rules_worker, tp, _generate_both, cfg, full, tp, reqs, kv_cache_tokens):
        # the GPU paths ran (lookahead but with a paged cache, which decides between steps)
        assert rules_out[2] is (kv_cache_tokens is None) and rules_out[3] == {"rmsnorm", "rope"}
        assert cpu_out[3] == frozenset()
        assert rules_out[0] == cpu_out[0]
        gap = max(abs(a - b) for x, y in zip(rules_out[1], cpu_out[1]) for a, b in zip(x, y))
        assert gap < 1e-4, gap


def test_pipelined_generation_under_cuda_rules(tiny_hf):
    """PP2: the stage's decode step under the capture check, the pipeline's batched point-to-point under NCCL's
    rules; the same tokens as the one-stage generator."""
    from conftest import make_tiny_llama
    from gen_workers import pipeline_worker

    from megatron_rl.inference import GenerationRequest, SamplingParams

    _, cfg, full = make_tiny_llama(num_layers=4, seed=1, name="tiny4-rules")
    reqs = [GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=5))
            for p in ([5, 17, 42], [7], list(range(30, 44)))]
    (_, want), = run_local(pipeline_worker, 1, cfg, full, 1, 1, [(reqs, 2)])
    for _, got in run_local(rules_worker, 2, pipeline_worker, cfg, full, 1, 2, [(reqs, 2)]):
        assert [t for t, _, _ in got[0]] == [t for t, _, _ in want[0]]


# ---------------------------------------------------------------------------------------------- NCCL's rules


def _nccl_rule_worker(rank, world_size):
    import torch.distributed as dist

    refused = []

    def attempt(name, fn):
        try:
            fn()
        except cuda_rules.NcclRuleError:
            refused.append(name)

    t = torch.ones(4, 4)
    attempt("non-contiguous all_reduce", lambda: dist.all_reduce(t.t()[:, :2]))
    attempt("mixed dtypes", lambda: dist.all_gather([torch.zeros(2), torch.zeros(2, dtype=torch.float64)],
                                                    torch.zeros(2)))
    group = dist.new_group([0, 1])
    peer = 1 - rank
    ops = lambda: [dist.P2POp(dist.isend, torch.ones(2), peer, group=group),  # noqa: E731
                   dist.P2POp(dist.irecv, torch.empty(2), peer, group=group)]
    attempt("first batch before a collective", lambda: dist.batch_isend_irecv(ops()))
    dist.barrier(group=group)
    for work in dist.batch_isend_irecv(ops()):  # after a collective over the group: allowed
        work.wait()
    dist.all_reduce(t)
    return refused


def test_gloo_keeps_nccls_rules():
    for refused in run_local(rules_worker, 2, _nccl_rule_worker):
        assert refused == ["non-contiguous all_reduce", "mixed dtypes", "first batch before a collective"]


def test_ddma_reshard_keeps_nccls_rules():
    """Every DDMA transfer across layouts (TP2xPP2 -> TP1xDP2 and back) under NCCL's rules, bit for bit."""
    env = {**os.environ, cuda_rules.ENV: "1"}
    for src, dst in (("tp=2,pp=2", "tp=1,dp=2"), ("tp=1,dp=2", "tp=2,pp=2")):
        r = warm_cli.run(["reshard-check", "--model", "tiny", "--src", src, "--dst", dst], cwd=REPO, env=env)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


# ------------------------------------------------------------------------------------- devices and backends


def test_each_local_rank_gets_its_own_gpu(monkeypatch):
    from megatron_rl.launch.spawn import bind_device
    from megatron_rl.launch.world import LaunchError

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for local_rank in (0, 3, 1):
        bind_device(local_rank)
    assert chosen == [0, 3, 1]
    with pytest.raises(LaunchError, match="local rank 4 has no GPU of its own: this node shows 4"):
        bind_device(4)


def test_gloo_on_a_gpu_machine_is_refused_in_one_line(monkeypatch):
    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.controller.train import env_backend
    from megatron_rl.launch.spawn import job_backend, resolve_backend
    from megatron_rl.launch.world import EnvWorld, LaunchError

    with pytest.raises(LaunchError, match="run.backend=gloo cannot carry the GPU tensors") as e:
        job_backend("gloo", 3, 8)
    assert "\n" not in str(e.value)
    assert job_backend("gloo", 3, 0) == "gloo" and job_backend("auto", 3, 8) == "nccl"
    assert resolve_backend("gloo", 1, 8) == "gloo"  # a tool's own world (conversion) may still use gloo
    cfg = load_config(None, ["run.backend=gloo"])
    world = EnvWorld(rank=0, world_size=3, local_rank=0, master_addr="127.0.0.1", master_port=1, source="test")
    with pytest.raises(ConfigError, match="run.backend='gloo'"):
        env_backend(cfg, world, 8)


def test_a_cpu_made_checkpoints_rng_states_resume_on_a_gpu(caplog):
    """A CPU generator's state is 5,056 bytes, CUDA's 16: the tracker states of a checkpoint made on the other kind
    of device are set aside with one warning instead of failing the resume."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megatron_rl.checkpointing.rng import rng_state, set_rng_state
    from megatron_rl.compat import activate
    from megatron_rl.models.builder import seed_rng_tracker

    activate()
    seed_rng_tracker(1234, tp_rank=0)
    state = rng_state()
    here = {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}
    other = dict(state, tracker={k: torch.zeros(16, dtype=torch.uint8) for k in state["tracker"]})
    with caplog.at_level(logging.WARNING):
        set_rng_state(other)
    assert "another kind of device (16 bytes, here 5056)" in caplog.text
    assert all(torch.equal(v, here[k]) for k, v in get_cuda_rng_tracker().get_states().items())
    set_rng_state(state)  # the same kind of device: restored as saved


# -------------------------------------------------------------------------------------------- the job itself


# Per function, the most graphs a short job may compile (one per specialization it uses; see each kernel's key).
GRAPH_BUDGET = {"fused.rms_norm": 8, "fused.rope": 12, "logprobs.forward_chunk": 3, "logprobs.backward_chunk": 2,
                "megatron.swiglu": 4, "megatron.swiglu_back": 2, "megatron.bias_swiglu": 4,
                "megatron.bias_swiglu_back": 2}


def test_a_colocated_job_runs_under_cuda_rules_within_its_graph_budget(reward_model_job, tmp_path):
    """The job as one GPU runs it (trainer and generator colocated, bf16, fusions and compiled chunks on, the decode
    step capture-checked, pinned copies, gloo under NCCL's rules), with a KL reference, held-out eval, the int8
    generator and the reward model in process."""
    d = reward_model_job
    args = [f"model.checkpoint={d / 'hf'}", "data.dataset=jsonl", f"data.path={d / 'words.jsonl'}",
            "data.answer_field=null", "data.eval_size=4", "data.eval_samples=2", "reward.kind=reward-model",
            f"reward.model={d / 'rm'}", "trainer.sft_warmup_steps=0", "trainer.dtype=bf16", "generator.dtype=bf16",
            "generator.quantization=int8", "algorithm.kl_coef=0.05", "trainer.tp=1", "generator.colocated=true",
            "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4",
            "run.eval_interval=2", "run.steps=3", "checkpoint.save_interval=2", f"checkpoint.dir={tmp_path}"]
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_RL_FAILPOINT"}
    env.update({cuda_rules.ENV: "1", "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                                    os.environ.get("PYTHONPATH", "")])})
    r = warm_cli.run(["train", *args], timeout=400, cwd=REPO, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "runs eagerly" not in r.stderr
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    compiled = summary["compiled_graphs"]
    assert compiled.get("eager_fallbacks", {}) == {}
    graphs = compiled["graphs"]
    assert {"fused.rms_norm", "fused.rope", "logprobs.forward_chunk"} <= set(graphs), graphs
    over = {k: n for k, n in graphs.items() if n > GRAPH_BUDGET.get(k, 0)}
    assert not over, f"over budget: {over} (budget {GRAPH_BUDGET})"
    rows = [json.loads(line) for line in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and any("eval/reward" in r for r in rows) and any("kl" in k for k in rows[-1])


def test_checkpoint_staging_takes_pinned_copies_that_training_cannot_change(rules):
    """The GPU path of a save's copy out (`checkpointing/background.py: HostStaging`): pinned buffers (here CUDA's
    `at::_pin_memory` rules), non-blocking copies. The staged tensors hold the values of the save after the
    source changes, a replica another rank writes is not copied, and the next save reuses the buffers."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_rl.checkpointing.background import HostStaging

    flat = torch.arange(24, dtype=torch.float32)

    def state():  # two views of one flat tensor (as the optimizer's pieces are), and a non-main replica
        return {"a": ShardedTensor.from_rank_offsets("a", flat[:12].view(3, 4)),
                "b": ShardedTensor.from_rank_offsets("b", flat[12:20]),
                "c": ShardedTensor.from_rank_offsets("c", flat[20:], replica_id=1)}

    staging = HostStaging(keep=True)
    assert staging.pinned
    sd = state()
    assert staging.stage(sd) == 20 * 4
    flat.add_(100.0)  # training goes on
    torch.testing.assert_close(sd["a"].data, torch.arange(12.0).view(3, 4))
    torch.testing.assert_close(sd["b"].data, torch.arange(12.0, 20.0))
    assert sd["c"].data.data_ptr() == flat[20:].data_ptr()  # not copied: another rank writes it
    used = {sd["a"].data.data_ptr(), sd["b"].data.data_ptr()}
    staging.release()
    again = state()
    staging.stage(again)
    assert {again["a"].data.data_ptr(), again["b"].data.data_ptr()} == used
    torch.testing.assert_close(again["b"].data, torch.arange(112.0, 120.0))

"""The GPU fusions (megatron_rl.models.fused) against the unfused paths they replace, on the CPU.

RMSNorm and RoPE are the unfused arithmetic written once and compiled for CUDA tensors (RMSNorm optionally torch's
fused kernel with the weight cast to the activations' dtype). Here the plain, the compiled (CPU inductor) and the
weight-cast versions are compared with torch's RMSNorm, Megatron-Core's RoPE and closed forms, and the builder is
checked to change nothing on the CPU by default and to give the same model (training forward, gradients, the
generator's incremental forward) when the fusions are forced on.
"""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from megatron_rl.models.fused import FUSIONS, apply_rope, resolve_fusions, rms_norm
from megatron_rl.launch.spawn import run_local


def _angles(seq, dim, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    a = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return torch.cat((a, a), -1)[:, None, None, :]


def _rms_closed_form(x, w, eps):
    xf = x.double()
    return (xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps) * w.double())


def test_resolve_fusions():
    assert resolve_fusions("none") == resolve_fusions(None) == frozenset()
    assert resolve_fusions("auto") == (frozenset(FUSIONS) if torch.cuda.is_available() else frozenset())
    assert resolve_fusions("rope, rmsnorm") == {"rope", "rmsnorm"}
    with pytest.raises(ValueError):
        resolve_fusions("rmsnorm,swiglu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_torch_rmsnorm_and_the_closed_form(dtype):
    g = torch.Generator().manual_seed(0)
    for shape in ((7, 3, 64), (1, 5, 48), (11, 32)):
        x = (torch.randn(*shape, generator=g) * 3).to(dtype).requires_grad_()
        w = (1 + 0.2 * torch.randn(shape[-1], generator=g)).requires_grad_()  # fp32 weight, as in the model
        y = rms_norm(x, w, 1e-5)
        ref = F.rms_norm(x, (shape[-1],), w, 1e-5)  # what torch.nn.RMSNorm (Megatron's local spec) runs
        assert y.dtype == ref.dtype == dtype
        gy = torch.randn(shape, generator=g).to(dtype)
        assert torch.equal(y, ref)  # the same operations: bit-identical on the CPU
        for a, b in zip(torch.autograd.grad(y, (x, w), gy), torch.autograd.grad(ref, (x, w), gy)):
            assert torch.equal(a, b)
        if dtype == torch.float32:
            torch.testing.assert_close(y.double(), _rms_closed_form(x, w, 1e-5), atol=1e-6, rtol=0)
        # The alternative: the weight cast to x's dtype (a no-op in fp32), torch's fused kernel where it has one.
        y_t = rms_norm(x, w, 1e-5, impl="torch")
        g_t = torch.autograd.grad(y_t, (x, w), gy)
        assert y_t.dtype == dtype and g_t[1].dtype == torch.float32
        if dtype == torch.float32:
            assert torch.equal(y_t, ref)
        else:  # the weight rounded to bf16: within bf16 rounding of the fp32-weight result
            torch.testing.assert_close(y_t, ref, atol=0, rtol=2 ** -7)
            torch.testing.assert_close(y_t.float(), _rms_closed_form(x, w, 1e-5).float(), atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_megatron_apply_rotary_pos_emb(dtype):
    g = torch.Generator().manual_seed(1)
    s, b, groups, per, d = 9, 2, 2, 3, 16
    qkv = torch.randn(s, b, groups, (per + 2) * d, generator=g).to(dtype).requires_grad_()
    q, k, _ = torch.split(qkv, [per * d, d, d], dim=3)
    q = q.reshape(s, b, groups * per, d)
    for t, freqs in ((q, _angles(s, d)), (k, _angles(s, d)), (q, _angles(s, d // 2)),  # partial rotary dim
                     (k, torch.rand(s, b, 1, d, generator=g) * 100)):  # per-token angles, as in decoding
        y, ref = apply_rope(t, freqs), _apply_rotary_pos_emb_bshd(t, freqs)
        assert torch.equal(y, ref)
        gy = torch.randn(y.shape, generator=g).to(dtype)
        assert torch.equal(torch.autograd.grad(y, qkv, gy)[0], torch.autograd.grad(ref, qkv, gy)[0])
    if dtype == torch.float32:  # closed form: pairs (i, i + d/2) rotate by the angle
        x, f = q.detach().double(), _angles(s, d).double()
        x1, x2, c, sn = x[..., : d // 2], x[..., d // 2:], f[..., : d // 2].cos(), f[..., : d // 2].sin()
        want = torch.cat((x1 * c - x2 * sn, x2 * c + x1 * sn), -1)
        torch.testing.assert_close(apply_rope(q, _angles(s, d)).double(), want, atol=1e-6, rtol=0)


def test_compiled_kernels_equal_the_unfused_paths_in_fp32():
    """The compiled functions (what runs on GPUs), here through the CPU inductor backend."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 2, 64, generator=g, requires_grad=True)
    w = (1 + 0.2 * torch.randn(64, generator=g)).requires_grad_()
    y, ref = rms_norm(x, w, 1e-5, impl="compiled"), F.rms_norm(x, (64,), w, 1e-5)
    torch.testing.assert_close(y, ref, atol=1e-6, rtol=0)
    gy = torch.randn(y.shape, generator=g)
    (gx, gw), (rx, rw) = torch.autograd.grad(y, (x, w), gy), torch.autograd.grad(ref, (x, w), gy)
    torch.testing.assert_close(gx, rx, atol=1e-6, rtol=0)
    torch.testing.assert_close(gw, rw, atol=1e-5, rtol=1e-6)  # a sum over 12 rows

    qkv = torch.randn(5, 2, 2, 4 * 16, generator=g, requires_grad=True)
    k = qkv[..., 2 * 16: 3 * 16]  # a strided view, like Megatron's key
    y, ref = apply_rope(k, _angles(5, 16), compiled=True), _apply_rotary_pos_emb_bshd(k, _angles(5, 16))
    torch.testing.assert_close(y, ref, atol=1e-6, rtol=0)
    gy = torch.randn(y.shape, generator=g)
    torch.testing.assert_close(torch.autograd.grad(y, qkv, gy)[0], torch.autograd.grad(ref, qkv, gy)[0],
                               atol=1e-6, rtol=0)


def _builder_worker(rank, world_size):
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rl.inference.kv_forward import IncrementalForward
    from megatron_rl.models import build_gpt_model, get_preset
    from full_state import gather_full_state_dict
    from megatron_rl.models.sharding import load_full_state_dict
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
    from megatron_rl.training.engine import model_forward

    cfg = get_preset("tiny")
    g = build_topology([ExecutorPlacement("x", ParallelLayout())])["x"]
    slot_before = rope_utils.fused_apply_rotary_pos_emb
    plain = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", fusions="none")
    auto = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa")  # default: "auto"
    norms = ("input_layernorm", "pre_mlp_layernorm", "final_layernorm")
    out = {"auto_fusions": auto.megatron_rl_fusions, "auto_rope_fusion": auto.config.apply_rope_fusion,
           "auto_norm_types": {type(m) for n, m in auto.named_modules() if n.endswith(norms)},
           "slot_untouched_by_auto": rope_utils.fused_apply_rotary_pos_emb is slot_before}
    with torch.no_grad():  # non-trivial norm weights
        for n, p in plain.named_parameters():
            if "layernorm" in n:
                p.add_(0.2 * torch.randn_like(p))
    full = gather_full_state_dict(plain, cfg, g.pgs)
    load_full_state_dict(auto, full, cfg, g.pgs)
    forced = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", fusions="rmsnorm,rope")
    load_full_state_dict(forced, full, cfg, g.pgs)
    out["forced_fusions"] = forced.megatron_rl_fusions
    out["forced_rope_fusion"] = forced.config.apply_rope_fusion
    out["forced_norm_types"] = {n: type(m) for n, m in forced.named_modules() if n.endswith(norms)}
    out["same_parameters"] = ([(n, p.shape, p.dtype) for n, p in plain.named_parameters()]
                              == [(n, p.shape, p.dtype) for n, p in forced.named_parameters()])
    tokens = torch.randint(0, cfg.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    logits = {}
    grads = {}
    for name, m in (("plain", plain), ("auto", auto), ("forced", forced)):
        m.zero_grad()
        lg = model_forward(m, tokens, False)
        (lg.float().square().mean()).backward()
        logits[name] = lg.detach()
        grads[name] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    out["logits"], out["grads"] = logits, grads
    # The generator's incremental forward: a right-padded prefill chunk and a decode step for every slot.
    inc = {}
    for name, m in (("plain", plain), ("forced", forced)):
        f = IncrementalForward(m, g.pgs.tp)
        cache = f.allocate_cache(3, 32)
        f.prepare(32)
        pos = torch.arange(6).expand(3, 6)
        a = f(tokens[:, :6], pos, torch.tensor([2, 0, 1]), cache)
        b = f(tokens[:, 6:7], torch.tensor([[6], [4], [5]]), torch.arange(3), cache, kv_len=32, all_slots=True)
        inc[name] = (a, b)
    out["incremental"] = inc
    return out


def test_builder_is_unchanged_on_cpu_and_forced_fusions_give_the_same_model():
    from megatron_rl.models.fused import FusedRMSNorm

    r = run_local(_builder_worker, 1)[0]
    # "auto" on a CPU: Megatron-Core's modules and flags, bit-identical outputs and gradients.
    assert r["auto_fusions"] == frozenset() and r["auto_rope_fusion"] is False and r["slot_untouched_by_auto"]
    assert r["auto_norm_types"] == {torch.nn.RMSNorm}
    assert torch.equal(r["logits"]["auto"], r["logits"]["plain"])
    for n, gr in r["grads"]["plain"].items():
        assert torch.equal(r["grads"]["auto"][n], gr), n
    # Forced on: our norms everywhere (the final one included), Megatron's RoPE switch on, same parameters.
    assert r["forced_fusions"] == {"rmsnorm", "rope"} and r["forced_rope_fusion"] is True
    assert set(r["forced_norm_types"].values()) == {FusedRMSNorm}
    assert "decoder.final_layernorm" in r["forced_norm_types"] and len(r["forced_norm_types"]) == 2 * 4 + 1
    assert r["same_parameters"]
    torch.testing.assert_close(r["logits"]["forced"], r["logits"]["plain"], atol=1e-5, rtol=0)
    for n, gr in r["grads"]["plain"].items():
        torch.testing.assert_close(r["grads"]["forced"][n], gr, atol=1e-5, rtol=1e-5, msg=lambda m: f"{n}: {m}")
    # The generator's incremental forward (fused norms and RoPE) against the unfused one.
    for got, want in zip(r["incremental"]["forced"], r["incremental"]["plain"]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

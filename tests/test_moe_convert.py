"""Mixture-of-experts checkpoints (Qwen3-MoE, Mixtral): HF -> Megatron written with the experts split over EP ranks
(`convert --ep`) and back bit for bit, with per-expert HF tensors and the same config; the converted checkpoint
loaded by the job's loader at other layouts (TP2 x DP2 x EP2, TP1, TP2 with EP2 inside TP) gives transformers'
logits; refusals."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_hf import MOE_CONFIGS, tiny_family_model  # noqa: E402
import warm_cli  # noqa: E402

# The layout each family is written with: Qwen3-MoE also over two pipeline stages.
WRITTEN = {"qwen3_moe": {"tp": 2, "pp": 2, "dp": 2, "ep": 2}, "mixtral": {"tp": 2, "pp": 1, "dp": 2, "ep": 2}}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """family -> (HF directory as `save_pretrained` writes it, the transformers model, its conversion at
    WRITTEN[family]); Mixtral's through the `convert` command."""
    from megatron_rl.checkpointing.convert import convert

    root = tmp_path_factory.mktemp("moe")
    out = {}
    for family in MOE_CONFIGS:
        src, dst = root / f"{family}-hf", root / family
        model = tiny_family_model(family)
        model.save_pretrained(src, safe_serialization=True)
        w = WRITTEN[family]
        if family == "mixtral":
            r = warm_cli.run(["convert", str(src), str(dst), "--to", "megatron", "--tp", str(w["tp"]),
                              "--ep", str(w["ep"])])
            assert r.returncode == 0, r.stderr[-3000:]
            summary = json.loads(r.stdout)
        else:
            summary = convert(src, dst, "megatron", tp=w["tp"], pp=w["pp"], ep=w["ep"])
        assert summary["layout"] == w and len(summary["memory"]["rank_peak_rss_mb"]) == w["tp"] * w["pp"] * w["ep"]
        out[family] = (src, model, dst)
    return out


def _hf_tensors(d):
    from safetensors.torch import load_file

    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}


def _config(d):
    """transformers' reading of a config.json (the head size resolved, as the model uses it)."""
    c = transformers.AutoConfig.from_pretrained(d).to_dict()
    c.pop("_name_or_path")
    c["head_dim"] = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c


@pytest.mark.parametrize("family", MOE_CONFIGS)
def test_ep2_conversion_and_back_is_bit_exact_per_expert(moe_checkpoints, family, tmp_path):
    from megatron_rl.checkpointing.convert import convert
    from megatron_rl.checkpointing.inspect import read_model
    from megatron_rl.models.hf_mapping import model_config_from_hf

    src, model, ckpt = moe_checkpoints[family]
    cfg, meta = read_model(ckpt)
    assert cfg.family == family and cfg.num_moe_experts == 4 and meta.layout == WRITTEN[family]
    assert meta.trainer_layout().ep == 2
    r = warm_cli.run(["inspect", str(ckpt)])
    assert r.returncode == 0 and "4 experts (top 2" in r.stdout and "ep=2" in r.stdout, r.stderr[-2000:]
    summary = convert(ckpt, tmp_path / "back", "hf", shard_bytes=100_000)
    assert summary["shards"] > 1
    want, got = _hf_tensors(src), _hf_tensors(tmp_path / "back")
    experts = [k for k in want if ".experts.3." in k]
    assert len(experts) == 2 * 3 and set(got) == set(want)  # one tensor per expert and projection, 2 layers
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert _config(tmp_path / "back") == _config(src)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert type(back) is type(model) and model_config_from_hf(back.config, name=src.name) == cfg


def _load_logits_worker(rank, world_size, ckpts, tokens):
    """Ranks 0-3 a TP2 x DP2 x EP2 model (each rank 2 experts of 4, split over TP), rank 4 a TP1 one, ranks 5-6 a
    TP2 one with EP2 inside TP (a generator's: each TP rank 2 whole experts); each loads
    every checkpoint with the job's loader (`initial.load_weights`: checksums, each replicated tensor read by one DP
    rank; collective over the world, so one executor at a time, the other's ranks passing None) and returns its
    logits over the vocabulary, gathered over TP."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_rl.checkpointing.initial import load_weights
    from megatron_rl.checkpointing.inspect import read_model
    from megatron_rl.models import build_gpt_model
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
    from megatron_rl.training.engine import model_forward

    topo = build_topology([ExecutorPlacement("ep", ParallelLayout(tp=2, dp=2, ep=2)),
                           ExecutorPlacement("tp1", ParallelLayout(), 4),
                           ExecutorPlacement("in-tp", ParallelLayout(tp=2, ep=2, etp=1), 5)])
    g = next(group for group in topo.values() if group.is_member)
    out = []
    for ckpt in ckpts:
        cfg = read_model(ckpt)[0]
        model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", initialize=False)
        for name in topo:
            load_weights(model if topo[name] is g else None, ckpt, g.pgs.dp_cp)
        with torch.no_grad():
            logits = model_forward(model, tokens, False)
        out.append(gather_from_tensor_model_parallel_region(logits, group=g.pgs.tp)[..., :cfg.vocab_size])
    return out


def test_a_converted_checkpoint_loads_at_other_expert_layouts_with_transformers_logits(moe_checkpoints):
    from megatron_rl.launch.spawn import run_local

    tokens = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(5))  # 18 tokens: TP splits them
    results = run_local(_load_logits_worker, 7, [c for _, _, c in moe_checkpoints.values()], tokens)
    for i, (family, (_, model, _)) in enumerate(moe_checkpoints.items()):
        with torch.no_grad():
            want = model(tokens).logits
        for rank, per_rank in enumerate(results):
            torch.testing.assert_close(per_rank[i], want, atol=1e-4, rtol=0,
                                       msg=lambda m: f"{family} rank {rank}: {m}")


def test_expert_layouts_that_cannot_hold_the_model_are_refused_in_one_line(moe_checkpoints, tmp_path):
    from megatron_rl.checkpointing.convert import convert
    from megatron_rl.checkpointing.layout import ConversionError

    dense = tmp_path / "dense"
    tiny_family_model("qwen3").save_pretrained(dense, safe_serialization=True)
    src, _, ckpt = moe_checkpoints["qwen3_moe"]
    cases = [((dense, tmp_path / "x", "megatron"), dict(ep=2), "--ep 2 needs a mixture-of-experts model"),
             ((src, tmp_path / "x", "megatron"), dict(ep=3), "--ep 3 does not divide num_moe_experts=4"),
             ((src, tmp_path / "x", "megatron"), dict(ep=0), "must be >= 1"),
             ((ckpt, tmp_path / "x", "hf"), dict(ep=2), "--tp/--pp/--ep apply to --to megatron")]
    for args, kw, message in cases:
        with pytest.raises(ConversionError) as e:
            convert(*args, **kw)
        assert message in str(e.value) and "\n" not in str(e.value) and not (tmp_path / "x").exists()

"""HF Llama -> Megatron distributed checkpoint -> HF: logits at other layouts, bit-exact round trip, bad inputs."""

import json
import subprocess
import sys

import pytest
import torch

from megatron_rl.parallel.spawn import run_local

transformers = pytest.importorskip("transformers")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_rl.cli", "convert", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=301, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("hf")
    model.save_pretrained(d, safe_serialization=True)
    return d, model


def _logits_worker(rank, world_size, ckpt, layout_kw, tokens):
    from megatron.core import dist_checkpointing

    from megatron_rl.checkpointing.convert import read_meta
    from megatron_rl.models import build_gpt_model
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
    from megatron_rl.training.engine import run_schedule

    cfg, _ = read_meta(ckpt)
    g = build_topology([ExecutorPlacement("x", ParallelLayout(**layout_kw))])["x"]
    model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", seed=99)
    sd = dist_checkpointing.load(model.sharded_state_dict(metadata={"dp_cp_group": g.pgs.dp_cp}), str(ckpt / "model"))
    model.load_state_dict(sd)
    out = []

    def grab(logits, mb):
        shards = [torch.empty_like(logits) for _ in range(g.layout.tp)]
        torch.distributed.all_gather(shards, logits.contiguous(), group=g.pgs.tp)
        out.append(torch.cat(shards, -1)[..., : cfg.vocab_size])
        return logits.sum() * 0, torch.ones((), dtype=torch.int64), {}

    with torch.no_grad():
        run_schedule(model, g.pgs, [{"tokens": tokens}], grab, forward_only=True)
    return out[0] if out else None


def test_hf_to_megatron_loads_at_other_layouts_and_round_trips(hf_dir, tmp_path):
    src, hf = hf_dir
    out = _cli(src, tmp_path / "mcore", "--to", "megatron")
    assert out.returncode == 0, out.stderr[-2000:]
    tokens = torch.randint(0, 301, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
    for layout in (dict(tp=1), dict(tp=2), dict(pp=2)):
        world = layout.get("tp", 1) * layout.get("pp", 1)
        got = [r for r in run_local(_logits_worker, world, tmp_path / "mcore", layout, tokens) if r is not None]
        torch.testing.assert_close(got[0], want, atol=1e-4, rtol=0, msg=lambda m: f"{layout}: {m}")
    out = _cli(tmp_path / "mcore", tmp_path / "back", "--to", "hf")
    assert out.returncode == 0, out.stderr[-2000:]
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").state_dict()
    for k, v in hf.state_dict().items():
        assert torch.equal(back[k], v), k
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(hf.state_dict())


def test_bad_inputs_fail_with_one_line_and_leave_nothing(hf_dir, tmp_path):
    src, _ = hf_dir
    (tmp_path / "empty").mkdir()
    out = _cli(tmp_path / "empty", tmp_path / "x", "--to", "megatron")
    assert out.returncode == 2 and "not a Hugging Face directory" in out.stderr and not (tmp_path / "x").exists()
    (tmp_path / "exists").mkdir()
    out = _cli(src, tmp_path / "exists", "--to", "megatron")
    assert out.returncode == 2 and "exists (pass --overwrite" in out.stderr
    bad = tmp_path / "truncated"
    bad.mkdir()
    (bad / "config.json").write_text((src / "config.json").read_text())
    data = (src / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    out = _cli(bad, tmp_path / "y", "--to", "megatron")
    assert out.returncode == 2 and "unreadable safetensors" in out.stderr
    assert not any(p.name.startswith("y") for p in tmp_path.iterdir())

"""HF Llama <-> Megatron distributed checkpoint: streaming conversion at several writer layouts, logits at other
layouts, bit-exact round trips, the tokenizer travelling with the checkpoint, and bad inputs."""

import json
import shutil
import struct

import pytest
import torch

from megatron_rl.launch.spawn import run_local

transformers = pytest.importorskip("transformers")

from tiny_hf import save_tiny_llama, save_word_tokenizer  # noqa: E402
import warm_cli  # noqa: E402


def _cli(*args):
    return warm_cli.run(["convert", *map(str, args)])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    model = save_tiny_llama(d, vocab_size=301)
    save_word_tokenizer(d)
    return d, model


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    """The model written by 1 process and by tp=2 x pp=2 processes."""
    from megatron_rl.checkpointing.convert import convert

    src, _ = hf_dir
    root = tmp_path_factory.mktemp("mcore")
    return root, convert(src, root / "tp1", "megatron"), convert(src, root / "tp2pp2", "megatron", tp=2, pp=2)


def _load_model(ckpt, layout_kw):
    from megatron.core import dist_checkpointing

    from megatron_rl.checkpointing.inspect import read_model
    from megatron_rl.models import build_gpt_model
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology

    cfg, _ = read_model(ckpt)
    g = build_topology([ExecutorPlacement("x", ParallelLayout(**layout_kw))])["x"]
    model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", seed=99)
    sd = dist_checkpointing.load(model.sharded_state_dict(metadata={"dp_cp_group": g.pgs.dp_cp}), str(ckpt / "model"))
    model.load_state_dict(sd)
    return cfg, g, model


def _logits(cfg, g, model, tokens):
    from megatron_rl.training.engine import run_schedule

    out = []

    def grab(logits, mb):
        shards = [torch.empty_like(logits) for _ in range(g.layout.tp)]
        torch.distributed.all_gather(shards, logits.contiguous(), group=g.pgs.tp)
        out.append(torch.cat(shards, -1)[..., : cfg.vocab_size])
        return logits.sum() * 0, torch.ones((), dtype=torch.int64), {}

    with torch.no_grad():
        run_schedule(model, g.pgs, [{"tokens": tokens}], grab, forward_only=True)
    return out[0] if out else None


def _logits_worker(rank, world_size, ckpt, layout_kw, tokens):
    return _logits(*_load_model(ckpt, layout_kw), tokens)


def _tp1_worker(rank, world_size, ckpts, tokens):
    """Each checkpoint loaded into a TP=1 model: its full state dict and logits."""
    from full_state import gather_full_state_dict

    out = []
    for ckpt in ckpts:
        cfg, g, model = _load_model(ckpt, {})
        out.append((gather_full_state_dict(model, cfg, g.pgs), _logits(cfg, g, model, tokens)))
    return out


def _tokens():
    return torch.randint(0, 301, (2, 12), generator=torch.Generator().manual_seed(1))


def test_checkpoint_written_at_tp2_pp2_loads_at_tp1_bit_for_bit(hf_dir, converted):
    (root, s1, s22), (_, hf) = converted, hf_dir
    assert s1["layout"] == {"tp": 1, "pp": 1, "dp": 1} and s22["layout"] == {"tp": 2, "pp": 2, "dp": 1}
    assert len(s22["memory"]["rank_peak_rss_mb"]) == 4
    with torch.no_grad():
        want = hf(_tokens()).logits
    (sd1, logits1), (sd22, logits22) = run_local(_tp1_worker, 1, [root / "tp1", root / "tp2pp2"], _tokens())[0]
    assert set(sd1) == set(sd22)
    for k in sd1:
        assert torch.equal(sd1[k], sd22[k]), k
    torch.testing.assert_close(logits1, want, atol=1e-4, rtol=0)
    assert torch.equal(logits1, logits22)


def test_checkpoint_logits_match_hf_at_tp2_pp2(hf_dir, converted):
    (root, _, _), (_, hf) = converted, hf_dir
    with torch.no_grad():
        want = hf(_tokens()).logits
    got = [r for r in run_local(_logits_worker, 4, root / "tp1", dict(tp=2, pp=2), _tokens()) if r is not None]
    torch.testing.assert_close(got[0], want, atol=1e-4, rtol=0)


def test_round_trip_to_hf_is_bit_exact_and_carries_the_tokenizer(hf_dir, converted, tmp_path):
    from megatron_rl.checkpointing.tokenizer import load_checkpoint_tokenizer
    from megatron_rl.checkpointing.convert import convert
    from megatron_rl.checkpointing.inspect import read_model
    from megatron_rl.models.hf_mapping import model_config_from_hf

    (root, _, _), (src, hf) = converted, hf_dir
    text = "the cat sat on a mat"
    want_ids = transformers.AutoTokenizer.from_pretrained(src).encode(text, add_special_tokens=False)
    for name in ("tp1", "tp2pp2"):
        meta = json.loads((root / name / "megatron_rl.json").read_text())
        assert meta["tokenizer"] == {"type": "hf", "path": "tokenizer"}
        assert (root / name / "tokenizer" / "tokenizer.json").is_file()
        assert load_checkpoint_tokenizer(root / name).encode(text) == want_ids
    # The way back, in small shards (one tensor at a time into files whose headers were written first).
    summary = convert(root / "tp2pp2", tmp_path / "back", "hf", shard_bytes=100_000)
    assert summary["shards"] > 1 and summary["tokenizer_files"] >= 2
    back_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back")
    back = back_model.state_dict()
    for k, v in hf.state_dict().items():
        assert torch.equal(back[k], v), k
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(hf.state_dict())
    assert model_config_from_hf(back_model.config, name=src.name) == read_model(root / "tp1")[0]
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "back").encode(text) == \
        transformers.AutoTokenizer.from_pretrained(src).encode(text)


def test_config_json_is_read_as_transformers_reads_it(hf_dir, tmp_path):
    from megatron_rl.checkpointing.hf_sources import hf_model_config
    from megatron_rl.models.hf_mapping import model_config_from_hf

    src, _ = hf_dir
    assert hf_model_config(src) == model_config_from_hf(transformers.AutoConfig.from_pretrained(src), name=src.name)
    # An older-style config: rope_theta and a llama3 rope_scaling at the top level, defaults left out.
    d = tmp_path / "old"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 500, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}}))
    assert hf_model_config(d) == model_config_from_hf(transformers.AutoConfig.from_pretrained(d), name="old")


def _write_gguf_header(path, arch):
    def s(text):
        b = text.encode()
        return struct.pack("<Q", len(b)) + b

    kv = s("general.architecture") + struct.pack("<I", 8) + s(arch)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv)


def _llama_cpp_rows(w, heads):
    """llama.cpp's row order for a Q or K projection (its convert_hf_to_gguf.py): within each head, the rotary pairs'
    two halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf_llama(path, hf, extra=()):
    """`hf` (a transformers Llama) as llama.cpp writes it, in F32: its names, its keys, its Q/K row order."""
    gguf = pytest.importorskip("gguf")
    c = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"] if hasattr(c, "rope_parameters") else c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "input_layernorm": "attn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, t in hf.state_dict().items():
        t = t.float().numpy()
        if name == "lm_head.weight":
            w.add_tensor("output.weight", t)
            continue
        parts = name.removeprefix("model.").removesuffix(".weight").split(".")
        if parts[0] == "layers":
            key = ".".join(parts[2:])
            if key in ("self_attn.q_proj", "self_attn.k_proj"):
                t = _llama_cpp_rows(t, c.num_attention_heads if key.endswith("q_proj") else c.num_key_value_heads)
            w.add_tensor(f"blk.{parts[1]}.{names[key]}.weight", t)
        else:
            w.add_tensor(f"{names[parts[0]]}.weight", t)
    for gname, t in extra:
        w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_llama_reads_as_its_hf_model_without_transformers(tiny_hf, tmp_path):
    """A Llama written as llama.cpp writes it (GQA: Q and K reordered with their own head counts; untied) reads back
    as the HF model it came from: the config's shape, and every tensor bit for bit in HF names and row order. A
    GGUF with RoPE frequencies (llama.cpp's Llama 3.1 scaling), a truncated one and an unknown tensor are refused in
    one line, as a job's `model.checkpoint` too."""
    import dataclasses

    import numpy as np
    from safetensors.torch import load_file

    from megatron_rl.checkpointing.hf_sources import gguf_model_config, gguf_to_safetensors
    from megatron_rl.checkpointing.initial import checkpoint_model_config
    from megatron_rl.checkpointing.layout import ConversionError
    from megatron_rl.models.hf_mapping import model_config_from_hf

    hf, ours, _ = tiny_hf
    _write_gguf_llama(tmp_path / "tiny.gguf", hf)
    # GGUF holds the norm's epsilon as a float32
    want = dataclasses.replace(model_config_from_hf(hf.config), name="tiny",
                               norm_epsilon=float(np.float32(hf.config.rms_norm_eps)))
    assert gguf_model_config(tmp_path / "tiny.gguf") == want
    assert checkpoint_model_config(str(tmp_path / "tiny.gguf")) == want
    gguf_to_safetensors(tmp_path / "tiny.gguf", tmp_path / "out")
    got = {k: v for f in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(f).items()}
    sd = hf.state_dict()
    assert set(got) == set(sd)
    for name, t in sd.items():
        assert torch.equal(got[name], t), name

    def refused(path, match):
        with pytest.raises(ConversionError, match=match) as e:
            gguf_to_safetensors(path, tmp_path / "refused")
        assert "\n" not in str(e.value) and not (tmp_path / "refused").exists()
        return str(e.value)

    _write_gguf_llama(tmp_path / "rope.gguf", hf, extra=[("rope_freqs.weight", np.ones(8, np.float32))])
    refused(tmp_path / "rope.gguf", "RoPE scaling in a GGUF file is not supported")
    with pytest.raises(ValueError, match=r"^model.checkpoint: .*RoPE scaling"):
        checkpoint_model_config(str(tmp_path / "rope.gguf"))
    _write_gguf_llama(tmp_path / "extra.gguf", hf, extra=[("blk.0.attn_q.bias", np.ones(64, np.float32))])
    refused(tmp_path / "extra.gguf", r"unexpected tensor blk.0.attn_q.bias \(1 in all\)")
    data = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    refused(tmp_path / "cut.gguf", "runs past the end of the file")
    (tmp_path / "header.gguf").write_bytes(data[:40])
    refused(tmp_path / "header.gguf", "the header runs past the end of the file")


def test_bad_inputs_fail_with_one_line_and_leave_nothing(hf_dir, converted, tmp_path):
    from safetensors.torch import load_file, save_file

    from megatron_rl.checkpointing.convert import convert
    from megatron_rl.checkpointing.layout import ConversionError

    src, _ = hf_dir
    root = converted[0]

    def fails(match, *args, **kw):
        with pytest.raises(ConversionError, match=match) as e:
            convert(*args, **kw)
        assert "\n" not in str(e.value)
        return str(e.value)

    (tmp_path / "empty").mkdir()
    fails("not a Hugging Face directory", tmp_path / "empty", tmp_path / "x", "megatron")
    (tmp_path / "exists").mkdir()
    fails(r"exists \(pass --overwrite", src, tmp_path / "exists", "megatron")
    fails(r"exists \(pass --overwrite", root / "tp1", tmp_path / "exists", "hf")
    fails("does not divide num_attention_heads=4", src, tmp_path / "x", "megatron", tp=3)
    fails("is a hf source", src, tmp_path / "x", "hf")
    # A truncated file, a tensor of the wrong shape, a missing tensor.
    sd = load_file(src / "model.safetensors")
    for name, change in (("truncated", None), ("shape", "model.layers.1.self_attn.k_proj.weight"),
                         ("missing", "model.norm.weight")):
        bad = tmp_path / name
        bad.mkdir()
        shutil.copy(src / "config.json", bad / "config.json")
        if change is None:
            data = (src / "model.safetensors").read_bytes()
            (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
        elif name == "shape":
            save_file(dict(sd, **{change: sd[change][:16].clone()}), bad / "model.safetensors")
        else:
            save_file({k: v for k, v in sd.items() if k != change}, bad / "model.safetensors")
    fails("unreadable safetensors", tmp_path / "truncated", tmp_path / "y", "megatron")
    msg = fails("model.layers.1.self_attn.k_proj.weight has shape", tmp_path / "shape", tmp_path / "y", "megatron")
    assert "[16, 64]" in msg and "[32, 64]" in msg
    fails("tensor model.norm.weight missing", tmp_path / "missing", tmp_path / "y", "megatron")
    # Other architectures: a GPT-2 directory saved by transformers, and a GGUF whose header says gpt2.
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32,
                                                                n_layer=1, n_head=2))
    gpt2.save_pretrained(tmp_path / "gpt2", safe_serialization=True)
    fails("architecture 'gpt2' is not supported", tmp_path / "gpt2", tmp_path / "y", "megatron")
    _write_gguf_header(tmp_path / "tiny-gpt2.gguf", "gpt2")
    fails("architecture 'gpt2' is not supported", tmp_path / "tiny-gpt2.gguf", tmp_path / "y", "megatron")
    # A half-written Megatron checkpoint, through the command: exit code 2 and one line.
    half = tmp_path / "half"
    shutil.copytree(root / "tp1", half)
    (half / "model" / ".metadata").unlink()
    out = _cli(half, tmp_path / "z", "--to", "hf")
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert out.stderr.startswith("megatron-rl: convert: ") and "model/.metadata missing" in out.stderr
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(("x", "y", "z"))]
    assert not leftovers, leftovers


def test_overwrite_replaces_only_an_empty_dir_or_a_checkpoint(hf_dir, converted, tmp_path):
    """--overwrite used to delete whatever directory it was given; it now refuses, in one line, anything that is not
    empty, a conversion's output or a Hugging Face model, and leaves it as it was."""
    from megatron_rl.checkpointing.convert import convert
    from megatron_rl.checkpointing.layout import ConversionError
    from megatron_rl.checkpointing.layout import CONVERT_FORMAT, LATEST, META, TRAIN_FORMAT

    root = converted[0]
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("years of work")
    run_root = tmp_path / "run"
    (run_root / "step_00000010").mkdir(parents=True)
    (run_root / LATEST).write_text("step_00000010")
    step = tmp_path / "step"
    step.mkdir()
    (step / META).write_text(json.dumps({"format": TRAIN_FORMAT}))
    (tmp_path / "file").write_text("x")
    for dst, why in ((notes, "is neither empty nor a checkpoint"), (run_root, "is a training run's checkpoint"),
                     (step, "is a training checkpoint of a run"), (tmp_path / "file", "is not a directory")):
        with pytest.raises(ConversionError, match=why) as e:
            convert(root / "tp1", dst, "hf", overwrite=True)
        assert "\n" not in str(e.value) and "not deleting it" in str(e.value)
    assert (notes / "thesis.tex").read_text() == "years of work" and (run_root / "step_00000010").is_dir()
    out = _cli(root / "tp1", notes, "--to", "hf", "--overwrite")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "not deleting it" in out.stderr, out.stderr
    # What it may replace: an empty directory, a conversion's output, a Hugging Face model.
    empty, old_conversion, hf = tmp_path / "empty", tmp_path / "converted", tmp_path / "hf"
    empty.mkdir()
    old_conversion.mkdir()
    (old_conversion / META).write_text(json.dumps({"format": CONVERT_FORMAT}))
    shutil.copytree(hf_dir[0], hf)
    for dst in (empty, old_conversion, hf):
        convert(root / "tp1", dst, "hf", overwrite=True)
        assert (dst / "config.json").is_file() and not (dst / META).exists()


def test_a_converted_checkpoint_carries_checksums_and_a_flipped_byte_is_one_line_for_every_reader(
        hf_dir, converted, tmp_path, capsys):
    """Issue 53: what a 405B job starts from, often copied between clusters, is checked like a training checkpoint:
    `inspect`, `convert --to hf`, `eval` and a job's `model.checkpoint` each name the changed file in one line."""
    import os
    from pathlib import Path

    from megatron_rl.checkpointing.convert import convert
    from megatron_rl.checkpointing.inspect import format_text, inspect_path, run
    from megatron_rl.checkpointing.layout import (CHECKSUMS, MANIFEST, META, ConversionError, read_meta,
                                                  verify_weights)
    from megatron_rl.cli import main

    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted[0] / "tp1", ckpt)
    meta = json.loads((ckpt / META).read_text())
    files = sorted(str(f.relative_to(ckpt)) for f in ckpt.rglob("*") if f.is_file() and f.name != META)
    assert sorted(meta[MANIFEST]) == sorted(meta[CHECKSUMS]) == files and any(f.startswith("tokenizer/") for f in files)
    assert f"checksums    {len(files)} files match their CRC-32" in format_text(inspect_path(ckpt))
    shard = sorted((ckpt / "model").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit; the size stays
    shard.write_bytes(bytes(data))
    line = f"{shard}: checksum mismatch (flipped bits or a partial copy)"

    assert run(ckpt) == 2
    assert capsys.readouterr().err == f"megatron-rl inspect: {line}\n"
    with pytest.raises(ConversionError) as e:
        convert(ckpt, tmp_path / "hf", "hf")
    assert str(e.value) == line and not (tmp_path / "hf").exists()
    assert main(["eval", str(ckpt), "--tokenizer", "byte", "--limit", "1"]) == 2
    assert capsys.readouterr().err == f"megatron-rl: eval: {line}\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    job = warm_cli.run(["train", f"model.checkpoint={ckpt}", "model.tokenizer=byte", "trainer.tp=1",
                        "trainer.sft_warmup_steps=0", "rollout.prompts_per_step=4", "data.eval_size=4",
                        "rollout.max_new_tokens=4", "run.steps=1", f"checkpoint.dir={tmp_path}", "run.name=j"], env=env)
    last = job.stderr.strip().splitlines()[-1]  # the launcher's line naming the rank that found it
    assert job.returncode == 1 and f"failed: CheckpointError: {line};" in last, job.stderr[-3000:]
    # A checkpoint converted before conversions carried checksums still loads, and says it has none.
    for key in (MANIFEST, CHECKSUMS):
        del meta[key]
    (ckpt / META).write_text(json.dumps(meta))
    verify_weights(ckpt, read_meta(ckpt))
    assert "checksums    none recorded" in format_text(inspect_path(ckpt))

"""`megatron-rl inspect`: conversion and training checkpoints, run roots, half-written checkpoints, from metadata
only; and the checkpoint's tokenizer."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import warm_cli  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny Llama with tied embeddings, converted by 2 tensor-parallel processes."""
    from megatron_rl.checkpointing.convert import convert

    from tiny_hf import save_tiny_llama

    d = tmp_path_factory.mktemp("inspect")
    model = save_tiny_llama(d / "hf", num_layers=4, tied=True)
    convert(d / "hf", d / "mcore", "megatron", tp=2)
    return d / "mcore", model


def _expected_shapes(cfg, tp):
    """Global shapes of the stored tensors, from the model shape alone (layers stacked on the first dim)."""
    L, h, f, d = cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.kv_channels
    q, kv = cfg.num_attention_heads * d, cfg.num_query_groups * d
    out = {"embedding.word_embeddings.weight": [cfg.padded_vocab_size(tp), h],
           "decoder.layers.self_attention.linear_qkv.layer_norm_weight": [L, h],
           "decoder.layers.self_attention.linear_qkv.weight": [L, q + 2 * kv, h],
           "decoder.layers.self_attention.linear_proj.weight": [L, h, q],
           "decoder.layers.mlp.linear_fc1.layer_norm_weight": [L, h],
           "decoder.layers.mlp.linear_fc1.weight": [L, 2 * f, h],
           "decoder.layers.mlp.linear_fc2.weight": [L, h, f],
           "decoder.final_layernorm.weight": [h]}
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = [cfg.padded_vocab_size(tp), h]
    return out


def _du(p):
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def test_conversion_checkpoint_from_metadata_only(ckpt, monkeypatch):
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_rl.checkpointing.inspect import format_text, inspect_path, read_model

    path, _ = ckpt
    cfg, _ = read_model(path)

    def no_tensor_reads(*a, **k):
        raise AssertionError("inspect read tensor data")

    monkeypatch.setattr(FileSystemReader, "read_data", no_tensor_reads)
    info = inspect_path(path)
    assert info["format"] == "megatron-rl/dist_checkpointing" and info["layout"] == {"tp": 2, "pp": 1, "dp": 1}
    assert {t["name"]: t["shape"] for t in info["tensors"]} == _expected_shapes(cfg, tp=2)
    assert {t["dtype"] for t in info["tensors"]} == {"float32"}
    assert info["parameters"] == cfg.num_parameters(tp=2) == sum(t["numel"] for t in info["tensors"])
    assert info["padded_vocab_size"] == 512 and info["model"]["vocab_size"] == 300
    assert info["size"]["total"] == _du(path) and info["size"]["model"] == _du(path / "model")
    text = format_text(info)
    assert "tp=2, pp=1, dp=1" in text and "stored padded to 512" in text and "[4, 352, 64]" in text


def _fake_training_checkpoint(src: Path, dst: Path, step: int, manifest: bool = True):
    """The agreed training layout, made from a conversion checkpoint (optimizer/ stands in with a copy of a
    dist_checkpointing directory)."""
    shutil.copytree(src / "model", dst / "model")
    shutil.copytree(src / "model", dst / "optimizer")
    torch.save({"step": step, "in_flight": []}, dst / "rl_state.pt")
    conv = json.loads((src / "megatron_rl.json").read_text())
    meta = {"format": "megatron-rl/train", "step": step, "weight_version": step - 1,
            "layout": {"tp": 2, "pp": 1, "dp": 1}, "dtype": "float32", "model": conv["model"],
            "tokenizer": {"type": "byte"}}
    if manifest:
        meta["files"] = {str(f.relative_to(dst)): f.stat().st_size for f in sorted(dst.rglob("*")) if f.is_file()}
    (dst / "megatron_rl.json").write_text(json.dumps(meta))


def test_run_root_shows_latest_and_lists_steps_and_incomplete_writes(ckpt, tmp_path):
    from megatron_rl.checkpointing.tokenizer import load_checkpoint_tokenizer
    from megatron_rl.checkpointing.convert import convert
    from megatron_rl.checkpointing.inspect import InspectError, format_text, inspect_path
    from megatron_rl.tokenizers import ByteTokenizer

    path, hf = ckpt
    root = tmp_path / "run"
    for step in (2, 4):
        _fake_training_checkpoint(path, root / f"step_{step:08d}", step)
    (root / "step_00000006.tmp").mkdir()
    shutil.copytree(path / "model", root / "step_00000006.tmp" / "model")
    (root / "step_00000006.tmp" / "model" / ".metadata").unlink()
    (root / "latest").write_text("step_00000004\n")
    info = inspect_path(root)
    assert info["kind"] == "run" and info["latest"] == "step_00000004"
    assert [(r["step"], r["status"]) for r in info["checkpoints"]] == [(2, "complete"), (4, "complete"),
                                                                        (6, "incomplete")]
    c = info["checkpoint"]
    assert c["format"] == "megatron-rl/train" and c["step"] == 4 and c["weight_version"] == 3
    assert c["optimizer"]["bytes"] == _du(root / "step_00000004" / "optimizer") > 0
    assert c["size"]["optimizer"] == c["optimizer"]["bytes"] and c["size"]["model"] == _du(path / "model")
    assert c["size"]["rl_state"] > 0 and c["size"]["total"] == _du(root / "step_00000004")
    text = format_text(info)
    assert "step_00000006.tmp" in text and "incomplete" in text and "complete (latest)" in text
    assert "optimizer" in text and "step         4, weight version 3" in text
    # The tokenizer and the weights come out of the run root (its latest checkpoint).
    assert isinstance(load_checkpoint_tokenizer(root), ByteTokenizer)
    convert(root, tmp_path / "hf", "hf")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for k, v in hf.state_dict().items():
        assert torch.equal(back[k], v), k
    # A checkpoint whose files no longer match its manifest.
    with open(root / "step_00000002" / "rl_state.pt", "ab") as f:
        f.write(b"x")
    with pytest.raises(InspectError, match=r"step_00000002: corrupt checkpoint: rl_state.pt has"):
        inspect_path(root / "step_00000002")


def test_half_written_and_unknown_paths_exit_2_with_one_line(ckpt, tmp_path, capsys):
    from megatron_rl.checkpointing.tokenizer import load_checkpoint_tokenizer
    from megatron_rl.checkpointing.inspect import run

    path, _ = ckpt
    half = tmp_path / "half"
    shutil.copytree(path, half)
    (half / "model" / ".metadata").unlink()
    (tmp_path / "junk").mkdir()
    root = tmp_path / "run"
    (root / "step_00000001.tmp").mkdir(parents=True)
    (root / "latest").write_text("step_00000001")
    cases = {half: "incomplete checkpoint: model/.metadata missing", tmp_path / "junk": "not a megatron-rl checkpoint",
             tmp_path / "nowhere": "does not exist", root: "names step_00000001, which does not exist"}
    for p, what in cases.items():
        assert run(p) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(p) in err and what in err, err
    # Through the command and the tool wrapper.
    out = warm_cli.run(["inspect", str(half)], timeout=120)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and ".metadata missing" in out.stderr
    out = subprocess.run([sys.executable, str(REPO / "tools" / "inspect_checkpoint.py"), str(path), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["layout"]["tp"] == 2 and info["parameters"] > 0
    # A checkpoint converted from a directory without tokenizer files records none.
    with pytest.raises(ValueError, match="records no tokenizer"):
        load_checkpoint_tokenizer(path)


def test_checksums_name_a_flipped_shard_and_old_checkpoints_say_they_have_none(ckpt, tmp_path, capsys):
    from megatron_rl.checkpointing.inspect import format_text, inspect_path, run
    from megatron_rl.checkpointing.layout import CHECKSUMS, file_checksum

    path, _ = ckpt
    old, new = tmp_path / "step_00000002", tmp_path / "step_00000004"
    _fake_training_checkpoint(path, old, 2)
    _fake_training_checkpoint(path, new, 4)
    meta = json.loads((new / "megatron_rl.json").read_text())
    meta[CHECKSUMS] = {rel: file_checksum(new / rel) for rel in meta["files"]}
    (new / "megatron_rl.json").write_text(json.dumps(meta))
    assert f"checksums    {len(meta['files'])} files match their CRC-32" in format_text(inspect_path(new))
    assert "written before checkpoints carried checksums" in format_text(inspect_path(old))
    shard = sorted((new / "optimizer").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x10  # one bit; the size stays
    shard.write_bytes(bytes(data))
    assert run(new) == 2
    err = capsys.readouterr().err
    assert err == f"megatron-rl inspect: {shard}: checksum mismatch (flipped bits or a partial copy)\n"


def test_the_metadata_is_read_in_one_place_each_field_typed_and_the_model_entry_parsed_one_way(tmp_path):
    """`read_meta` is the one reader of megatron_rl.json: an ill-typed field, a model entry with a field this version
    does not know (a newer version's), are one line naming the file and the field; a model entry without a field
    added since (an older version's) takes its default; every other key is kept in `extra`."""
    import dataclasses

    from megatron_rl.checkpointing.layout import CONVERT_FORMAT, META, CheckpointError, read_meta
    from megatron_rl.models.presets import get_preset

    model = dataclasses.asdict(get_preset("tiny"))
    base = {"format": CONVERT_FORMAT, "model": model, "layout": {"tp": 2, "pp": 1, "dp": 1}, "dtype": "float32",
            "tokenizer": {"type": "byte"}, "converted_by": "a test"}

    def read(**changes):
        (tmp_path / META).write_text(json.dumps({**base, **changes}))
        return read_meta(tmp_path)

    meta = read()
    assert meta.model_config() == get_preset("tiny") and meta.trainer_layout().tp == 2
    assert meta.extra == {"converted_by": "a test"} and meta.torch_dtype_name == "float32"
    older = {k: v for k, v in model.items() if k != "rope_scaling"}
    assert "rope_scaling" in model and read(model=older).model_config() == get_preset("tiny")
    with pytest.raises(CheckpointError) as e:
        read(model={**model, "mla_rank": 64}).model_config()
    assert str(e.value) == f"{tmp_path / META}: the model entry has field mla_rank, which this version does not know " \
                           f"(written by a newer megatron-rl?)"
    for field, value, kind in (("step", "4", "int"), ("step", True, "int"), ("model", [1], "dict"),
                               ("optimizer_state", 1, "bool")):
        with pytest.raises(CheckpointError) as e:
            read(**{field: value})
        assert str(e.value) == f"{tmp_path / META}: {field} is {value!r}, not a {kind}"

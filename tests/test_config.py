"""Configs: YAML + dotted overrides, and one clear line for each kind of bad config, before any process group."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, JobConfig, load_config, parse_override, validate

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_valid_and_default_yaml_spells_them_out():
    assert validate(JobConfig(), world_size=3).name == "tiny"
    assert load_config(ROOT / "configs/default.yaml").to_dict() == JobConfig().to_dict()
    validate(load_config(ROOT / "configs/smollm2-gsm8k.yaml"))


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("model:\n  num_layers: 2\n  preset: smollm2-135m\ntrainer:\n  tp: 3\n  lr: 3.0e-6\n")
    cfg = load_config(f, ["trainer.tp=1", "rollout.top_p=0.9", "algorithm.ppo_clip=0.2", "run.world_size=null"])
    assert cfg.trainer.tp == 1 and cfg.trainer.lr == 3e-6 and cfg.rollout.top_p == 0.9
    assert cfg.algorithm.ppo_clip == 0.2 and cfg.run.world_size is None
    model = validate(cfg)
    assert model.name == "smollm2-135m" and model.num_layers == 2  # override applies on top of the preset
    assert parse_override("data.path=/x/y.jsonl") == ("data.path", "/x/y.jsonl")
    assert load_config(None, ["trainer.lr=3e-4"]).trainer.lr == 3e-4  # YAML 1.1 reads 3e-4 as a string


BAD = [
    (["trainer.tpp=2"], r"^unknown key 'trainer.tpp' \(did you mean 'trainer.tp'\?\)$"),
    (["trainr.tp=2"], r"^unknown section 'trainr' in 'trainr.tp' \(did you mean 'trainer'\?\)$"),
    (["model.hidden=2"], r"^unknown key 'model.hidden' \(did you mean 'model.hidden_size'\?\)$"),
    (["trainer.tp=two"], r"^trainer.tp='two' has the wrong type: expected int$"),
    (["trainer.use_distributed_optimizer=3"], r"wrong type: expected bool"),
    (["rollout.mode=fast"], r"^rollout.mode='fast' is not allowed: expected one of 'async', 'sync'$"),
    (["trainer.tp=4"], r"^trainer.tp=4 does not divide model.num_query_groups=2$"),
    (["generator.tp=3"], r"^generator.tp=3 does not divide model.num_attention_heads=4$"),
    (["trainer.pp=3"], r"^trainer.pp=3 does not divide model.num_layers=4$"),
    (["generator.dp=0"], r"^generator.dp=0 must be >= 1$"),
    (["model.preset=llama3-8bb"], r"^model.preset='llama3-8bb' is not a preset \(did you mean 'llama3-8b'\?\)"),
    (["trainer.dp=4", "run.world_size=8"], r"^the executors need 9 ranks .* but the world has 8$"),
    (["rollout.top_p=1.5"], r"^rollout.top_p=1.5 must be in \(0, 1\]$"),
    (["rollout.temperature=0"], r"^rollout.temperature=0.0 must be > 0"),
    (["algorithm.rho=0.5"], r"^algorithm.rho=0.5 must be >= 1"),
    (["reward.kind=function"], r"^reward.function must be set"),
    (["generator.colocated=true"], r"^generator.colocated=true needs"),
    (["rollout.max_new_tokens=1000"], r"exceeds model.max_position_embeddings=512$"),
    (["generator.quantization=fp8"], r"^generator.quantization='fp8' is not allowed: expected one of 'none', 'int8'$"),
    (["generator.quantization=int8", "generator.attention=te"], r"needs Megatron-Core's own linear layers"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_config_fails_with_one_clear_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, overrides))
    assert "\n" not in str(e.value)
    assert any(re.search(message, p) for p in _problems(e.value)), str(e.value)


def _problems(error: ConfigError) -> list[str]:
    text = str(error)
    return text.split(": ", 1)[1].split("; ") if re.match(r"\d+ problems: ", text) else [text]


def test_validation_reports_every_problem_it_finds():
    cfg = load_config(None, ["rollout.temperature=0", "trainer.lr=-1", "checkpoint.keep_last=0"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert sorted(_problems(e.value)) == ["checkpoint.keep_last=0 must be >= 1", "rollout.temperature=0.0 must be > 0 "
                                          "(use top_k=1 for greedy)", "trainer.lr=-1.0 must be > 0"]
    assert str(e.value).startswith("3 problems: ")


@pytest.mark.parametrize("old,hint", [("trainer.warmup_steps_sft=0", "renamed trainer.sft_warmup_steps"),
                                      ("trainer.warmup_lr=0.1", "renamed trainer.sft_lr"),
                                      ("trainer.warmup_steps=5", "renamed trainer.lr_warmup_steps"),
                                      ("trainer.min_lr=0", "removed"), ("run.log_interval=5", "removed")])
def test_retired_options_say_what_replaced_them(old, hint):
    with pytest.raises(ConfigError, match=hint):
        load_config(None, [old])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    f = tmp_path / "bad.yaml"
    f.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(f)
    f.write_text("trainer: 3\n")
    with pytest.raises(ConfigError, match="section 'trainer' must be a mapping"):
        load_config(f)


def test_cli_reports_config_errors_in_one_line_without_starting_processes():
    out = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "trainer.pp=3"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == "megatron-rl: config error: trainer.pp=3 does not divide model.num_layers=4"
    out = subprocess.run([sys.executable, "-c", "import sys, megatron_rl.cli as c; c.main(['config']); "
                          "print('megatron.core' in sys.modules)"], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().endswith("False"), "validating a config must not import Megatron-Core"

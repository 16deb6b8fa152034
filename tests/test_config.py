"""Configs: YAML + dotted overrides, and one clear line for each kind of bad config, before any process group."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_rl.config import ConfigError, JobConfig, load_config, parse_override, validate

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_valid_and_default_yaml_spells_them_out():
    assert validate(JobConfig(), world_size=3).name == "tiny"
    assert load_config(ROOT / "configs/default.yaml").to_dict() == JobConfig().to_dict()


def test_the_smollm2_gsm8k_recipe_is_valid(shared_data):
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
    (["generator.quantization=fp4"],
     r"^generator.quantization='fp4' is not allowed: expected one of 'none', 'int8', 'fp8'$"),
    (["generator.quantization=int8", "generator.attention=te"], r"needs Megatron-Core's own linear layers"),
    (["generator.quantization=fp8", "generator.attention=te"],
     r"^generator.quantization='fp8' needs Megatron-Core's own linear layers"),
    # Ranges that used to pass: a run of 0 steps, a run without checkpoints, hangs, non-finite sampling and updates.
    (["run.steps=-5"], r"^run.steps=-5 must be >= 1$"),
    (["run.eval_interval=0"], r"^run.eval_interval=0 must be >= 1$"),
    (["checkpoint.save_interval=-1"], r"^checkpoint.save_interval=-1 must be >= 0 \(0: only the final checkpoint\)$"),
    (["trainer.micro_batch_size=0"], r"^trainer.micro_batch_size=0 must be >= 1$"),
    (["trainer.max_tokens_per_micro_batch=50"], r"^trainer.max_tokens_per_micro_batch=50 is less than the longest "
     r"sequence a step can hold \(64 tokens: rollout.max_prompt_length \+ rollout.max_new_tokens\)"),
    (["trainer.attention=local"], r"^trainer.packing=true needs SDPA's or transformer-engine's attention"),
    (["generator.kv_cache_tokens=63"], r"^generator.kv_cache_tokens=63 holds less than one sequence at its longest "
     r"\(64 tokens\)$"),
    (["generator.kv_cache_tokens=640", "generator.pp=2"], r"^generator.kv_cache_tokens=640: a paged KV cache needs "
     r"generator.pp=1"),
    (["trainer.use_distributed_optimizer=false", "trainer.dtype=bf16"],
     r"^trainer.use_distributed_optimizer=false with a bf16 trainer \(trainer.dtype='bf16'\) cannot save its "
     r"optimizer"),
    (["trainer.packing=false", "trainer.max_tokens_per_micro_batch=512"],
     r"^trainer.max_tokens_per_micro_batch=512 is the budget of packed micro-batches and trainer.packing=false$"),
    (["generator.max_batch_size=0"], r"^generator.max_batch_size=0 must be >= 1"),
    (["reward.num_workers=0"], r"^reward.num_workers=0 must be >= 1$"),
    (["reward.timeout_s=0"], r"^reward.timeout_s=0.0 must be > 0$"),
    (["data.eval_size=0"], r"^data.eval_size=0 must be >= 1$"),
    (["data.demo_accuracy=1.5"], r"^data.demo_accuracy=1.5 must be in \[0, 1\]$"),
    (["trainer.adam_beta2=1"], r"^trainer.adam_beta2=1.0 must be in \[0, 1\)$"),
    (["trainer.max_nonfinite_steps=0"], r"^trainer.max_nonfinite_steps=0 must be >= 1$"),
    (["algorithm.ppo_clip=0"], r"^algorithm.ppo_clip=0.0 must be > 0 or null$"),
    (["run.world_size=0"], r"^run.world_size=0 must be >= 1 or null$"),
    (["run.seed=-1"], r"^run.seed=-1 must be in \[0, 2\*\*32\)$"),
    (["rollout.temperature=nan"], r"^rollout.temperature=nan must be a finite number$"),
    (["trainer.lr=inf"], r"^trainer.lr=inf must be a finite number$"),
    (["rollout.top_p=.nan"], r"^rollout.top_p=nan must be a finite number$"),
    (["algorithm.entropy_coef=-inf"], r"^algorithm.entropy_coef=-inf must be a finite number$"),
    (["model.norm_epsilon=0"], r"^model.norm_epsilon=0.0 must be a finite number > 0$"),
    (["model.rotary_base=inf"], r"^model.rotary_base=inf must be a finite number > 0$"),
    # A run name is one directory inside checkpoint.dir: an empty one wrote beside the other runs.
    (["run.name="], r"^run.name='' must be a plain directory name \(not empty, no '/', not '.' or '..'\)"),
    (["run.name=a/b"], r"^run.name='a/b' must be a plain directory name"),
    (["run.name=.."], r"^run.name='..' must be a plain directory name"),
    (["run.name=."], r"^run.name='.' must be a plain directory name"),
    (["model.tokenizer=/nonexistent/tok"], r"^model.tokenizer='/nonexistent/tok' does not exist"),
    (["data.dataset=jsonl", "data.path=/nonexistent.jsonl", "trainer.sft_warmup_steps=0", "reward.kind=synthetic"],
     r"^data.path='/nonexistent.jsonl' does not exist$"),
    (["data.dataset=gsm8k", "data.eval_path=/nonexistent.jsonl", "trainer.sft_warmup_steps=0"],
     r"^data.eval_path='/nonexistent.jsonl' does not exist$"),
    (["data.dataset=gsm8k", "reward.function=m:f", "trainer.sft_warmup_steps=0"],
     r"^reward.function='m:f' is set but reward.kind='auto': set reward.kind=function"),
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
    for command in (["config"], ["train", "run.steps=-5"]):
        out = subprocess.run([sys.executable, "-c", f"import sys, megatron_rl.cli as c; c.main({command!r}); "
                              "print('megatron.core' in sys.modules, 'torch' in sys.modules)"],
                             capture_output=True, text=True, timeout=60)
        # a config error in a fraction of a second: neither Megatron-Core nor torch is imported for it
        assert out.stdout.strip().endswith("False False"), (command, out.stdout[-300:], out.stderr[-300:])


def _numbers(section, prefix):
    import dataclasses

    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            yield from _numbers(value, f"{prefix}.{f.name}")
        elif f.type in ("int", "float", "Optional[int]", "Optional[float]") or f.type.startswith("Union[int, Literal["):
            yield f"{prefix}.{f.name}", f, section


def _breaking(rule: str, kind: str):
    """A value of the field's kind that breaks `rule`."""
    value = {">= 0": -1, ">= 1": 0, "> 0": 0, "in (0, 1]": 0, "in [0, 1]": 2, "in [0, 1)": 1, "in [0, 2**32)": -1,
             "in [1, 64]": 65}[rule]
    return float(value) if "float" in kind else value


def test_every_number_of_every_section_has_a_range_that_the_config_and_the_class_both_enforce():
    """Walks every section: each number field declares its range beside it (a field added later must too; the
    layouts are checked against the model; an entropy bonus and a reward model's weight may take either sign), and
    the one rule is what both a configuration (`validate`) and building the settings class directly refuse, in the
    same words."""
    import dataclasses

    cfg = JobConfig()
    numbers = [n for f in dataclasses.fields(cfg) if f.name != "model" for n in _numbers(getattr(cfg, f.name), f.name)]
    unbounded = {f"{e}.{d}" for e in ("trainer", "generator") for d in ("tp", "pp", "dp")} | {"algorithm.entropy_coef",
                                                                                          "reward.model_coef"}
    assert {path for path, f, _ in numbers if "range" not in f.metadata} == unbounded
    checked = 0
    for path, f, section in numbers:
        if "range" not in f.metadata:
            continue
        bad = _breaking(f.metadata["range"], f.type)
        with pytest.raises(ConfigError) as e:
            validate(load_config(None, [f"{path}={bad}"]), cluster_files=False)
        line = next(p for p in _problems(e.value) if p.startswith(f"{path}="))
        assert f"must be {f.metadata['range']}" in line
        with pytest.raises(ValueError) as direct:
            type(section)(**{f.name: bad})
        assert line in str(direct.value).split("; ")
        checked += 1
    assert checked == len(numbers) - len(unbounded) >= 35


def test_a_sections_own_rule_is_the_same_in_the_config_and_in_its_class():
    from megatron_rl.algorithms import AIPOSettings
    from megatron_rl.inference.settings import GeneratorSettings

    with pytest.raises(ConfigError, match=r"^algorithm.ppo_clip needs algorithm.importance_weights=true"):
        validate(load_config(None, ["algorithm.ppo_clip=0.2", "algorithm.importance_weights=false"]))
    with pytest.raises(ValueError, match=r"^algorithm.ppo_clip needs algorithm.importance_weights=true"):
        AIPOSettings(ppo_clip=0.2, importance_weights=False)
    with pytest.raises(ValueError, match=r"^generator.quantization='int8' needs Megatron-Core's own linear layers"):
        GeneratorSettings(quantization="int8", attention="te")
    with pytest.raises(ValueError, match=r"^algorithm.normalization='mean' is not allowed"):
        AIPOSettings(normalization="mean")


def test_text_fields_take_the_override_as_written(tmp_path):
    """Overrides are read as YAML, so `run.name=yes` was a bool and `run.name=123` an int, both refused."""
    cfg = load_config(None, ["run.name=yes", "data.system=no", "data.prompt_field=123", "run.wandb.project=1e3",
                             "model.tokenizer=byte", "data.path=null", "reward.kind=function"])
    assert (cfg.run.name, cfg.data.system, cfg.data.prompt_field, cfg.run.wandb.project) == ("yes", "no", "123", "1e3")
    assert cfg.data.path is None and cfg.reward.kind == "function"
    assert load_config(None, ["run.name=123"]).run.name == "123"
    with pytest.raises(ConfigError, match=r"^run.wandb.mode='off' is not allowed"):  # YAML would have read False
        load_config(None, ["run.wandb.mode=off"])
    with pytest.raises(ConfigError, match="wrong type: expected int"):
        load_config(None, ["trainer.tp=yes"])
    f = tmp_path / "job.yaml"
    f.write_text("run:\n  name: 123\n")
    assert load_config(f).run.name == "123"


def test_overrides_on_both_sides_of_the_config_file(tmp_path, capsys):
    from megatron_rl.cli import build_parser, main, parse_args

    f = tmp_path / "job.yaml"
    f.write_text("run:\n  steps: 7\n  name: from-file\n")
    args = parse_args(build_parser(), ["train", "run.steps=3", "-c", str(f), "trainer.tp=1", "--launcher", "local",
                                       "rollout.staleness=2"])
    assert args.config == str(f) and args.launcher == "local"
    assert args.overrides == ["run.steps=3", "trainer.tp=1", "rollout.staleness=2"]
    assert main(["config", "run.steps=3", "-c", str(f), "trainer.tp=1"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert (out["run"]["steps"], out["run"]["name"], out["trainer"]["tp"]) == (3, "from-file", 1)
    with pytest.raises(SystemExit):
        parse_args(build_parser(), ["train", "a.b=1", "-c", str(f), "--bogus"])


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_files_and_code_the_job_needs_are_checked_before_it_starts(tmp_path):
    """Each used to surface minutes later, after the ranks started, as per-rank tracebacks."""
    jsonl = ["data.dataset=jsonl", "trainer.sft_warmup_steps=0", "reward.kind=synthetic"]

    def problems(*overrides):
        with pytest.raises(ConfigError) as e:
            validate(load_config(None, [*jsonl, *overrides]), 3)
        assert "\n" not in str(e.value)
        return _problems(e.value)

    good = _write(tmp_path / "good.jsonl", b"\n" + json.dumps({"question": "1+1=", "answer": 2}).encode() + b"\n")
    validate(load_config(None, [*jsonl, f"data.path={good}"]), 3)
    for data, message in ((b'{"question": "1+1=", \n', r":1: invalid JSON .*"),
                          (b'\n{"q": "1+1=", "answer": 2}\n', r":2: no prompt field 'question' \(the row has: .*\)"),
                          (b'{"question": "1+1=\xff"}\n', r":1: not UTF-8 text \(byte 0xff at column 19\)"),
                          (b"\n\n", r": no records")):
        bad = _write(tmp_path / "bad.jsonl", data)
        assert re.fullmatch(rf"data.path: {re.escape(str(bad))}{message}", problems(f"data.path={bad}")[0])
    assert problems(f"data.path={good}", f"data.eval_path={tmp_path}") == [
        f"data.eval_path={str(tmp_path)!r} is not a file"]
    # The reward function is imported here, as each reward worker will import it.
    (tmp_path / "scores.py").write_text("def score(prompt, response, reference):\n    return 1.0\n")
    (tmp_path / "broken.py").write_text("raise RuntimeError('no GPU here\\nsecond line')\n")
    fn = [f"data.path={good}", "reward.kind=function"]
    validate(load_config(None, [*jsonl, *fn, f"reward.function={tmp_path}/scores.py:score"]), 3)
    assert problems(*fn, f"reward.function={tmp_path}/scores.py:scor") == [
        f"reward function '{tmp_path}/scores.py:scor': module '{tmp_path}/scores.py' has no attribute 'scor'"]
    assert problems(*fn, "reward.function=no_such_module_xyz:score") == [
        "reward function 'no_such_module_xyz:score': no module named 'no_such_module_xyz'"]
    assert problems(*fn, f"reward.function={tmp_path}/broken.py:score")[0].endswith(
        "raised RuntimeError: no GPU here second line")
    # A checkpoint directory that cannot hold the run.
    not_dir = _write(tmp_path / "ckpts", b"")
    assert problems(f"data.path={good}", f"checkpoint.dir={not_dir}") == [
        f"checkpoint.dir: {not_dir} is not a directory"]
    assert problems(f"data.path={good}", f"checkpoint.dir={not_dir}/sub") == [
        f"checkpoint.dir: {not_dir}/sub cannot be created ({not_dir} is not a directory)"]
    (tmp_path / "runs").mkdir()
    _write(tmp_path / "runs" / "default", b"")
    assert problems(f"data.path={good}", f"checkpoint.dir={tmp_path}/runs") == [
        f"run.name: {tmp_path}/runs/default is not a directory"]
    # Every problem at once, in one line; validation creates nothing.
    assert len(problems("data.path=/nonexistent.jsonl", f"checkpoint.dir={tmp_path}/new", "run.steps=0",
                        "reward.timeout_s=nan")) == 3
    assert not (tmp_path / "new").exists()


def test_config_errors_stay_fast_and_import_no_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, megatron_rl.config as c; c.validate(c.JobConfig(), 3); "
                          "print('torch' in sys.modules)"], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("devices,ranks,trainer_tp,colocated", [(0, 3, 2, False), (1, 1, 1, True),
                                                                 (2, 2, 1, False), (4, 3, 2, False),
                                                                 (8, 3, 2, False)])
def test_the_default_layout_is_fitted_to_the_machines_gpus(devices, ranks, trainer_tp, colocated):
    """No layout set: the CPU runs the configured one; one GPU colocates both executors at TP1; two run them at TP1
    a GPU each; three or more keep the configured layout. Whatever is chosen is valid on exactly that many ranks
    and fits the GPUs."""
    from megatron_rl.config_fit import fit_to_devices

    cfg, why = fit_to_devices(load_config(), devices, given=set())
    assert (cfg.world_size_needed, cfg.trainer.tp, cfg.generator.colocated) == (ranks, trainer_tp, colocated)
    assert devices == 0 or cfg.world_size_needed <= devices
    validate(cfg, world_size=cfg.world_size_needed)
    if devices == 0:
        assert why == ""
    elif devices < 3:
        assert why.startswith(f"fitted to {devices} GPU") and "needs 3 GPUs" in why
        assert "(" not in why  # the banner puts it in parentheses of its own
    else:
        assert why == f"the configured layout uses 3 of {devices} GPUs"


def test_a_layout_the_user_set_is_never_fitted(tmp_path):
    """Any layout key, in the file or on the command line, keeps the configuration as written (on one GPU the job
    then fails in one line, as before); other keys do not count."""
    from megatron_rl.config import given_keys
    from megatron_rl.config_fit import LAYOUT_KEYS, fit_to_devices

    f = tmp_path / "job.yaml"
    f.write_text("generator:\n  colocated: false\nrollout:\n  staleness: 2\n")
    assert given_keys(f, ["trainer.tp=2", "run.steps=3"]) == {"generator.colocated", "rollout.staleness",
                                                             "trainer.tp", "run.steps"}
    for key in LAYOUT_KEYS:
        cfg, why = fit_to_devices(load_config(), 1, given={key})
        assert (cfg.world_size_needed, why) == (3, ""), key
    cfg, why = fit_to_devices(load_config(None, ["run.steps=3"]), 1, given_keys(None, ["run.steps=3"]))
    assert cfg.world_size_needed == 1 and cfg.run.steps == 3 and why


def test_config_and_the_banner_show_the_fitted_layout(monkeypatch, capsys):
    from megatron_rl import cli
    from megatron_rl.controller.train import banner
    from megatron_rl.launch.world import LocalWorld

    monkeypatch.setattr(cli, "local_gpus", lambda: 1)
    assert cli.main(["config"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert (shown["trainer"]["tp"], shown["generator"]["tp"], shown["generator"]["colocated"]) == (1, 1, True)
    cfg = load_config(None, ["trainer.tp=1", "generator.colocated=true"])
    line = banner(cfg, validate(cfg, 1), LocalWorld(1), "fitted to 1 GPU: trainer and generator colocated at TP1")
    assert "\n" not in line and line.endswith(", 1 process (fitted to 1 GPU: trainer and generator colocated at TP1)")


def test_every_setting_that_cannot_be_applied_is_named_at_once_with_the_range_problems():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.lr=abc", "nosuch.key=1", "rollout.staleness=-1", "trainer.tp"])
    assert str(e.value) == ("4 problems: override 'trainer.tp' must look like section.key=value; trainer.lr='abc' "
                            "has the wrong type: expected float; unknown section 'nosuch' in 'nosuch.key'; "
                            "rollout.staleness=-1 must be >= 0")


def test_a_library_log_record_that_says_nothing_to_act_on_is_dropped_unless_asked_for(monkeypatch):
    """transformers 5.17's tokenizer logger says it ignores `clean_up_tokenization_spaces` when SmolLM2's GGUF
    tokenizer loads (on the H200 image, 2026-11-27: a SmolLM2 job's stderr). `quiet.install` drops that record
    alone, once however often it is called, and `-v` (MEGATRON_RL_LIBRARY_WARNINGS=1) keeps it.

    The records are caught by a handler on the logger itself: once transformers is imported, its loggers no longer
    propagate to the root logger, where pytest's `caplog` listens."""
    import logging
    import warnings

    from megatron_rl import quiet

    name, start = quiet.LOG_FILTERS[0]
    logger = logging.getLogger(name)
    monkeypatch.setattr(logger, "filters", [])  # this test's own filters, the logger's restored after it
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "level", logging.WARNING)
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setenv("PYTHONWARNINGS", "")
    caught = logging.Handler()
    caught.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(caught)
    said = f"{start}=True for BPE tokenizer TokenizersBackend."
    for show, want in (("1", [said, "other"]), ("", ["other"])):
        monkeypatch.setenv(quiet.SHOW_ENV, show)
        seen: list[str] = []
        with warnings.catch_warnings():
            quiet.install()
            quiet.install()
        logger.warning(said)
        logger.warning("other")
        assert seen == want
    assert len(logger.filters) == 1


def test_library_warnings_are_filtered_unless_asked_for(monkeypatch):
    """The dependencies' warnings reach every process through PYTHONWARNINGS; `-v` (MEGATRON_RL_LIBRARY_WARNINGS=1)
    leaves them visible."""
    import os
    import warnings

    from megatron_rl import cli, quiet

    monkeypatch.setenv("PYTHONWARNINGS", "")
    monkeypatch.setenv(quiet.SHOW_ENV, "")  # restored after the test, whatever `-v` sets
    with warnings.catch_warnings():
        quiet.install()
    assert "ignore:Transformer Engine and Apex are not installed:UserWarning" in os.environ["PYTHONWARNINGS"].split(",")
    monkeypatch.setenv("PYTHONWARNINGS", "")
    monkeypatch.setattr(cli, "local_gpus", lambda: 0)
    with warnings.catch_warnings():
        assert cli.main(["-v", "config"]) == 0
    assert os.environ[quiet.SHOW_ENV] == "1" and os.environ["PYTHONWARNINGS"] == ""


def test_one_layout_rule_for_every_caller():
    """The configuration, DDMA, the converter, `eval` and the reward model each word a layout that cannot hold the
    model their own way; the rule is one function, `parallel.layout.layout_problems`."""
    from megatron_rl.models import get_preset
    from megatron_rl.parallel.layout import LayoutProblem, ParallelLayout, layout_problems

    tiny = get_preset("tiny")  # 4 heads, 2 query groups, 176 MLP channels, 4 layers
    assert layout_problems(tiny, ParallelLayout(tp=2, pp=2, dp=3)) == []
    assert layout_problems(tiny, ParallelLayout(tp=4, pp=3)) == [LayoutProblem("tp", 4, "num_query_groups", 2),
                                                                 LayoutProblem("pp", 3, "num_layers", 4)]
    assert [str(p) for p in layout_problems(tiny, ParallelLayout(tp=3))] == [
        "tp=3 does not divide num_attention_heads=4", "tp=3 does not divide num_query_groups=2",
        "tp=3 does not divide ffn_hidden_size=176"]
    assert [str(p) for p in layout_problems(tiny, ParallelLayout(tp=0, pp=3, dp=0))] == ["tp=0 must be >= 1",
                                                                                         "dp=0 must be >= 1"]


def test_a_quantized_generator_is_built_with_sdpa_unless_told_otherwise():
    """The job's executor and `megatron-rl plan` both read `GeneratorSettings.model_attention`."""
    from megatron_rl.inference.settings import GeneratorSettings

    assert GeneratorSettings().model_attention == "auto"
    assert GeneratorSettings(quantization="int8").model_attention == "sdpa"
    assert GeneratorSettings(quantization="fp8", attention="local").model_attention == "local"


@pytest.mark.parametrize("prompts, replicas", [(16, 1), (16, 3), (10, 4), (3, 8)])
def test_a_steps_prompts_split_over_generator_replicas_once_each(prompts, replicas):
    """`rollout.replica_prompts` is how the generator executors split a step's prompts (and `samples_per_replica`
    how many KV-cache slots the planner gives a replica): every prompt on exactly one replica, replica 0 holding
    the most, ceil(prompts / replicas) of them."""
    cfg = load_config(None, [f"rollout.prompts_per_step={prompts}", "rollout.samples_per_prompt=3"])
    r = cfg.rollout
    shares = [r.replica_prompts(i, replicas) for i in range(replicas)]
    assert sorted(p for s in shares for p in s) == list(range(prompts))
    assert max(map(len, shares)) == len(shares[0]) == -(-prompts // replicas)
    assert r.samples_per_replica(replicas) == 3 * -(-prompts // replicas)
    assert r.context_length == r.max_prompt_length + r.max_new_tokens


def test_an_episode_budget_nobody_set_fits_the_model():
    """The tiny model's 512 positions hold no 512-token episode after a 48-token prompt: where env.max_tokens is
    not set, it is fitted to what the positions leave (issue 65: the first try with env.cls stopped at a config
    error); a budget the user sets is kept, and validated."""
    from megatron_rl.config import given_keys, load_config, problems
    from megatron_rl.config_fit import fit_episode_budget

    def fitted(*overrides):
        cfg = load_config(overrides=list(overrides))
        return fit_episode_budget(cfg, given_keys(None, list(overrides)))

    base = ["data.dataset=guess-number", "env.cls=megatron_rl.environments.guess:GuessNumber"]
    cfg = fitted(*base)
    room = cfg.model.resolve().max_position_embeddings - cfg.rollout.max_prompt_length
    assert cfg.env.max_tokens == room < 512 and problems(cfg, cluster_files=False)[1] == []
    assert fitted(*base, "rollout.max_prompt_length=100").env.max_tokens == room - 52
    assert fitted(*base, "model.preset=smollm2-135m").env.max_tokens == 512  # 8,192 positions: the default stands
    chosen = fitted(*base, "env.max_tokens=512")
    assert chosen.env.max_tokens == 512 and any("exceeds model.max_position_embeddings" in p
                                                for p in problems(chosen, cluster_files=False)[1])
    assert fitted("env.max_tokens=7").env.max_tokens == 7 and fitted().env.max_tokens == 512  # no episodes: as set

"""A relaunch on a run directory that holds checkpoints: it resumes with other layouts, steps and intervals, and is
refused, in one line and before anything is written, when it would train on something else or start afresh there."""

import pytest
import yaml

from megatron_rl.config import ConfigError, load_config
from megatron_rl.controller.rundir import check_run_dir


def _run_dir(tmp_path, overrides, steps=("step_00000050", "step_00000100")):
    """A run directory as a run with `overrides` leaves it: config.yaml and checkpoint directories."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump(load_config(None, overrides).to_dict(), sort_keys=False))
    for s in steps:
        (d / s).mkdir()
    return d


def _refused(cfg, run_dir) -> str:
    before = (run_dir / "config.yaml").read_text()
    with pytest.raises(ConfigError) as e:
        check_run_dir(cfg, run_dir)
    assert "\n" not in str(e.value) and (run_dir / "config.yaml").read_text() == before
    return str(e.value)


def test_resume_may_change_how_the_run_executes(tmp_path):
    d = _run_dir(tmp_path, ["run.steps=100"])
    check_run_dir(load_config(None, ["run.steps=300", "run.eval_interval=5", "checkpoint.save_interval=10",
                                     "checkpoint.keep_last=5", "checkpoint.fallback=true", "trainer.tp=1",
                                     "trainer.dp=2", "trainer.micro_batch_size=8", "generator.colocated=true",
                                     "generator.tp=2", "reward.num_workers=4", "run.wandb.project=p",
                                     "model.num_layers=4"]), d)  # num_layers=4 is the tiny preset's own


def test_resume_that_changes_what_the_run_trains_on_is_refused(tmp_path):
    d = _run_dir(tmp_path, ["data.dataset=jsonl", "data.path=a.jsonl", "trainer.sft_warmup_steps=0"])
    msg = _refused(load_config(None, ["data.dataset=jsonl", "data.path=b.jsonl", "trainer.sft_warmup_steps=0",
                                      "run.seed=7", "trainer.tp=1", "model.num_layers=2"]), d)
    assert msg.startswith(f"{d} holds a run trained with other settings: ")
    assert "data.path ('a.jsonl' -> 'b.jsonl')" in msg and "run.seed (1234 -> 7)" in msg
    assert "model.num_layers (4 -> 2)" in msg and "trainer.tp" not in msg
    for override, field in (("trainer.weight_decay=0.1", "trainer.weight_decay"),
                            ("rollout.temperature=0.7", "rollout.temperature"),
                            ("algorithm.kl_coef=0.1", "algorithm.kl_coef"), ("model.tokenizer=byte", "model.tokenizer"),
                            ("trainer.dtype=bf16", "trainer.dtype")):
        cfg = load_config(None, ["data.dataset=jsonl", "data.path=a.jsonl", "trainer.sft_warmup_steps=0", override])
        assert f"other settings: {field} (" in _refused(cfg, d)
    # a run that went unstable may resume at a lower learning rate, with another grace time
    check_run_dir(load_config(None, ["data.dataset=jsonl", "data.path=a.jsonl", "trainer.sft_warmup_steps=0",
                                     "trainer.lr=1e-5", "run.stop_grace_s=5"]), d)


def test_fields_one_side_lacks_are_not_compared_outside_the_model(tmp_path):
    d = _run_dir(tmp_path, [])
    saved = yaml.safe_load((d / "config.yaml").read_text())
    saved["trainer"]["min_lr"] = 0.0  # retired since
    del saved["rollout"]["top_k"]  # added since
    (d / "config.yaml").write_text(yaml.safe_dump(saved))
    check_run_dir(load_config(None, []), d)


def test_without_checkpoints_there_is_nothing_to_resume_and_nothing_is_refused(tmp_path):
    d = _run_dir(tmp_path, ["run.seed=1"], steps=("step_00000050.tmp",))
    check_run_dir(load_config(None, ["run.seed=2"]), d)
    check_run_dir(load_config(None, ["checkpoint.resume=false"]), d)
    check_run_dir(load_config(None, []), tmp_path / "new")


def test_starting_afresh_over_an_earlier_run_is_refused(tmp_path):
    """checkpoint.resume=false used to start a new run among the old run's checkpoints: pruning then deleted the new
    ones and kept the old run's later steps."""
    d = _run_dir(tmp_path, [])
    msg = _refused(load_config(None, ["checkpoint.resume=false"]), d)
    assert msg == (f"checkpoint.resume=false, but {d} holds an earlier run's checkpoints (newest step_00000100); "
                   f"starting afresh there would mix the two runs: use a new run.name, or delete {d}")
    (d / "config.yaml").write_text("trainer: [1,\n")
    assert "cannot read the configuration of the run to resume" in _refused(load_config(None, []), d)

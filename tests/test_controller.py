"""The controller: the deterministic schedule, and a short end-to-end job (async and sync) through the CLI."""

import json
import re
import subprocess
import sys

import pytest

from megatron_rl.controller.schedule import generation_version, pull_before_batch, push_after_step, syncs_needed
from test_loop import documented_metrics
import warm_cli


@pytest.mark.parametrize("n,s", [(6, 0), (6, 1), (7, 2), (3, 3)])
def test_schedule_pushes_and_pulls_pair_up(n, s):
    pushes = [k + 1 for k in range(n) if push_after_step(k, n, s)]
    pulls = [generation_version(k, s) for k in range(n) if pull_before_batch(k, s)]
    assert pushes == pulls == syncs_needed(n, s)
    for k in range(n):
        # batch k uses the weights after k - s steps; the trainer trains it at version k
        assert k - generation_version(k, s) == min(k, s)


def test_schedule_versions_by_hand():
    assert [generation_version(k, 1) for k in range(5)] == [0, 0, 1, 2, 3]
    assert [generation_version(k, 0) for k in range(3)] == [0, 1, 2]
    # n = 4, s = 1: versions 1 and 2 are pushed (version 3 would serve batch 4, which does not exist)
    assert syncs_needed(4, 1) == [1, 2]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_short_job_end_to_end(tmp_path, mode):
    cmd = ["train", "run.steps=4", "trainer.sft_warmup_steps=10",
           "run.eval_interval=2", f"rollout.mode={mode}", "rollout.prompts_per_step=4", "data.eval_size=8",
           f"checkpoint.dir={tmp_path}", "run.name=t"]
    out = warm_cli.run(cmd)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    expected = [0, 0, 1, 2] if mode == "async" else [0, 1, 2, 3]
    assert [r["generated_with_version"] for r in rows] == expected
    assert all(0 <= r["reward"] <= 1 and r["response_length"] >= 1 for r in rows)
    assert [r["step"] for r in rows if "eval/reward" in r] == [0, 2, 3]
    assert set().union(*rows) <= documented_metrics()  # docs/metrics.md explains every field
    assert summary["steps"] == 4 and (tmp_path / "t" / "metrics.png").exists()
    assert (tmp_path / "t" / "config.yaml").exists()


@pytest.mark.parametrize("correction", ["mask", "decoupled", "sequence"])
def test_each_correction_trains_a_stale_pipelined_job_and_resumes(tmp_path, correction):
    """algorithm.correction end to end: a two-stage trainer (PP2) two versions behind its generator; for one of
    them, stopped after a checkpoint and resumed by a longer relaunch (resuming does not depend on the correction,
    and each relaunch costs seconds of the suite). The closed forms are in test_aipo, the parallel step in
    test_rl_trainer."""
    base = ["train", "trainer.sft_warmup_steps=0", "trainer.tp=1",
            "trainer.pp=2", "rollout.staleness=2", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2",
            "rollout.max_new_tokens=4", "data.eval_size=4", "run.eval_interval=100", "checkpoint.save_interval=2",
            f"algorithm.correction={correction}", f"checkpoint.dir={tmp_path}", "run.name=c"]
    resume = correction == "mask"
    if correction == "decoupled":  # and dynamic sampling on a TP2 generator: the leader shares each round's count
        base += ["algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_rounds=1", "generator.tp=2"]
    out = warm_cli.run(base + [f"run.steps={2 if resume else 4}"])
    assert out.returncode == 0, out.stderr[-3000:]
    if resume:
        again = warm_cli.run(base + ["run.steps=4"])
        assert again.returncode == 0, again.stderr[-3000:]
        assert json.loads(again.stdout.strip().splitlines()[-1])["resumed_from_step"] == 2
    rows = [json.loads(line) for line in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    # two versions behind; an extension generates afresh from the checkpoint's weights (version 2): the first run
    # ended with no batch beyond its last step
    versions = [(0, 0), (1, 0), (2, 2), (3, 2)] if resume else [(0, 0), (1, 0), (2, 0), (3, 1)]
    assert [(r["step"], r["generated_with_version"]) for r in rows] == versions
    assert all(r["skipped"] == 0 and 0 <= r["is_truncated_frac"] <= 1 for r in rows)
    assert yaml_value(tmp_path / "c" / "config.yaml", "algorithm", "correction") == correction
    if correction == "decoupled":  # random weights: groups all wrong, refilled once (two prompts drawn a prompt)
        assert all(1 < r["sampling/prompts_drawn"] <= 2 for r in rows), [r["sampling/prompts_drawn"] for r in rows]


def yaml_value(path, section, key):
    import yaml

    return yaml.safe_load(path.read_text())[section][key]


def _dcp_tensors(path):
    """Every tensor of a torch_dist checkpoint directory, by its flattened key."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(str(path), f"{d}/m.pt")
        sd = torch.load(f"{d}/m.pt", weights_only=False)
    out = {}

    def walk(x, key):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(x, torch.Tensor):
            out[key] = x

    walk(sd, "")
    return out


def _final_weights(run_dir):
    """The model tensors of a run's newest checkpoint, read straight from the torch_dist files."""
    latest = (run_dir / "latest").read_text().strip()
    return latest, _dcp_tensors(run_dir / latest / "model")


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_bf16_trainer_with_a_quantized_generator_trains_and_resumes(tmp_path, quantization):
    """trainer.dtype=bf16: bf16 weights, fp32 main weights in the optimizer (the weights are their rounding);
    generator.quantization=int8 / fp8 samples from 8-bit weights that DDMA refreshes: behaviour log-probs stay close
    to the trainer's. A longer relaunch resumes the bf16 run (once: resuming does not depend on the 8-bit format)."""
    import torch

    base = ["train", "trainer.sft_warmup_steps=10", "rollout.mode=sync",
            "rollout.prompts_per_step=4", "data.eval_size=4", "run.eval_interval=100", "checkpoint.save_interval=3",
            "trainer.dtype=bf16", "generator.dtype=bf16", f"generator.quantization={quantization}",
            f"checkpoint.dir={tmp_path}", "run.name=q"]
    out = warm_cli.run(base + ["run.steps=3"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{quantization} generator weights" in out.stdout
    step = tmp_path / "q" / "step_00000003"
    assert json.loads((step / "megatron_rl.json").read_text())["dtype"] == "bfloat16"
    model, opt = _dcp_tensors(step / "model"), _dcp_tensors(step / "optimizer")
    matrices = [k for k in model if "norm" not in k]  # (stacked over layers, norms are 2-D too)
    assert matrices and all(model[k].dtype == torch.bfloat16 for k in matrices)
    for k in matrices:
        main = opt[f"optimizer.state.param.{k}"]
        assert main.dtype == torch.float32 and torch.equal(main.to(torch.bfloat16), model[k]), k
    rows = [json.loads(x) for x in (tmp_path / "q" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:  # sync mode: same weights on both sides, up to bf16 and 8-bit rounding
        assert abs(r["kl_mu_pi"]) < 1e-2 and abs(r["is_weight_mean"] - 1) < 1e-2 and r["skipped"] == 0
        assert r["logp_diff_max"] < 5e-2
    if quantization != "int8":
        return
    again = warm_cli.run(base + ["run.steps=4"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["resumed_from_step"] == 3
    assert [json.loads(x)["step"] for x in (tmp_path / "q" / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]


def test_killed_runs_resume_to_the_same_result(tmp_path):
    """SIGKILL in the middle of a checkpoint's background write (training has gone on meanwhile), then in the middle
    of a trainer step; each time the launcher
    names the dead rank in one line and the same command resumes. Final weights and every step's metrics equal an
    uninterrupted run's."""
    import torch

    args = ["run.steps=6", "trainer.sft_warmup_steps=10", "run.eval_interval=100", "rollout.prompts_per_step=4",
            "data.eval_size=4", "rollout.max_new_tokens=6", "checkpoint.save_interval=2", f"checkpoint.dir={tmp_path}"]

    def launch(name, failpoint=None):
        return warm_cli.run_with_failpoint(["train", *args, f"run.name={name}"], failpoint)

    ref = launch("ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    first = launch("crash", "checkpoint_background_write:step_00000004")
    assert first.returncode == 1, first.stderr[-3000:]
    assert re.fullmatch(r"megatron-rl: rank \d \((trainer|generator)\) died with signal 9 \(SIGKILL\); every rank's "
                        r"traceback: .*failure.log", first.stderr.strip().splitlines()[-1]), first.stderr[-3000:]
    assert (tmp_path / "crash" / "latest").read_text().strip() == "step_00000002"
    second = launch("crash", "train_step:5")  # resumes at step 2, saves step 4, dies inside step 5
    assert second.returncode == 1 and "(trainer) died with signal 9" in second.stderr, second.stderr[-3000:]
    # Step 4's checkpoint is written in the background while step 5 trains: on a loaded machine (two xdist workers)
    # the kill can come before that write ends, and the latest complete checkpoint is then still step 2.
    latest = (tmp_path / "crash" / "latest").read_text().strip()
    assert latest in ("step_00000002", "step_00000004"), latest
    third = launch("crash")
    assert third.returncode == 0, third.stderr[-3000:]
    resumed = json.loads(third.stdout.strip().splitlines()[-1])["resumed_from_step"]
    assert "resumed from" in third.stderr and resumed == int(latest.removeprefix("step_")), (resumed, latest)

    name_ref, w_ref = _final_weights(tmp_path / "ref")
    name_new, w_new = _final_weights(tmp_path / "crash")
    assert name_ref == name_new == "step_00000006"
    assert w_ref.keys() == w_new.keys() and len(w_ref) >= 9
    for k in w_ref:
        assert torch.equal(w_ref[k], w_new[k]), k
    rows_ref = [json.loads(x) for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    rows_new = [json.loads(x) for x in (tmp_path / "crash" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_new] == list(range(6))  # nothing dropped, nothing counted twice
    for a, b in zip(rows_ref, rows_new):
        for key in ("reward", "loss", "generated_with_version", "response_length"):
            assert a[key] == b[key], (a["step"], key)
    assert not list((tmp_path / "crash").glob("*.tmp"))
    assert sorted(p.name for p in (tmp_path / "crash").glob("step_*")) == ["step_00000004", "step_00000006"]


def test_the_launcher_imports_matplotlib_while_its_ranks_run(tmp_path):
    """The local launcher only waits while its ranks run: it imports matplotlib then (a daemon thread), so the
    summary's plot at the end does not pay for it. A fresh process: nothing plotted before, pyplot imported once
    the thread ends, and `plot_run` draws the PNG with it."""
    code = ("import sys, json\n"
            "from pathlib import Path\n"
            "from megatron_rl.controller.metrics import import_plotting_in_background, plot_run\n"
            "assert 'matplotlib' not in sys.modules\n"
            "import_plotting_in_background().join(120)\n"
            "assert 'matplotlib.pyplot' in sys.modules\n"
            "rows = [{'step': s, 'reward': 0.5, 'staleness': 1, 'time/total_s': 0.1} for s in range(3)]\n"
            f"print(plot_run(rows, Path({str(tmp_path / 'm.png')!r})))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(tmp_path / "m.png") and (tmp_path / "m.png").stat().st_size > 1000

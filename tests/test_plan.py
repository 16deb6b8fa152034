"""`megatron-rl plan`: exact bytes against a real CPU job, the activation model against autograd, the recipes fit on
80 GiB, the paper's step-time table, the 405B plan's cost, and one-line errors for bad inputs."""

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_rl.config import load_config, validate
from megatron_rl.launch.spawn import run_local
from megatron_rl.planning.calibration import load_calibration
from megatron_rl.planning.plan import make_plan

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
GIB = 1 << 30

JOBS = {
    # tied embeddings absent, PP x DP sharding with padding, bf16 weights with fp32 norms, an int8 generator
    "tiny-tp2pp2dp2-bf16-int8": ["trainer.tp=2", "trainer.pp=2", "trainer.dp=2", "trainer.dtype=bf16",
                                 "generator.tp=2", "generator.dtype=bf16", "generator.quantization=int8",
                                 "trainer.sft_warmup_steps=0"],
    # tied embeddings split over two stages (their own DDP bucket), fp32 trainer, a TP3 bf16 generator
    "smollm2-pp2-fp32": ["model.preset=smollm2-135m", "trainer.tp=1", "trainer.pp=2", "trainer.dp=1",
                         "trainer.dtype=fp32", "generator.tp=3", "generator.dtype=bf16", "trainer.sft_warmup_steps=0"],
    # a two-stage generator: each stage's rank holds its own layers (embedding on the first, output on the last)
    "tiny-generator-pp2": ["trainer.tp=1", "trainer.dtype=bf16", "generator.pp=2", "generator.dtype=bf16",
                           "trainer.sft_warmup_steps=0"],
    # tied embeddings over two trainer stages, two DP ranks: the output layer is saved once, by the first stage
    "tiny-tied-pp2dp2": ["model.tie_word_embeddings=true", "trainer.tp=1", "trainer.pp=2", "trainer.dp=2",
                         "trainer.dtype=bf16", "generator.dtype=bf16", "trainer.sft_warmup_steps=0"],
}
# Every dtype is explicit: the plan resolves "auto" for a GPU (bf16), the job here for this CPU (fp32 without native
# bf16), and the two must build the same tensors.


@pytest.mark.parametrize("overrides", list(JOBS.values()), ids=list(JOBS))
def test_planned_bytes_equal_what_the_job_allocates(overrides, tmp_path):
    from megatron_rl.planning.plan import _build_trainer
    from megatron_rl.parallel.layout import ParallelLayout
    from plan_workers import allocated_worker

    cfg = load_config(None, overrides)
    model = validate(cfg)
    cal = load_calibration()
    measured = run_local(allocated_worker, cfg.world_size_needed, cfg, str(tmp_path))
    plan = make_plan(cfg, model, cal)
    stages = _build_trainer(cfg, model, ParallelLayout(cfg.trainer.tp, cfg.trainer.pp, cfg.trainer.dp), cal)
    trainers = [m["trainer"] for m in measured if "trainer" in m]
    assert len(trainers) == cfg.trainer.tp * cfg.trainer.pp * cfg.trainer.dp
    for t in trainers:
        o = stages[t["pp"]].optimizer[t["dp"]]
        assert (t["parameters"], t["gradients"], t["main_weights"], t["optimizer_state"]) == (
            o.param_buffer_bytes, o.grad_buffer_bytes, o.main_bytes, o.optimizer_state_bytes), t
    for r in plan.trainer.ranks:  # the report's rows are those of real ranks
        pp, dp = (int(x.split()[1]) for x in r.rank.split(", "))
        t = next(t for t in trainers if (t["pp"], t["dp"]) == (pp, dp))
        assert {k: r.parts[k] for k in ("parameters", "gradients", "main_weights", "optimizer_state")} == {
            k: t[k] for k in ("parameters", "gradients", "main_weights", "optimizer_state")}
    weights = {(m["generator"]["pp"], m["generator"]["weights"]) for m in measured if "generator" in m}
    assert weights == {(p, r.parts["weights"]) for p, r in enumerate(plan.generator.ranks)}
    # A checkpoint: each TP-rank-0 trainer rank copies out (and writes) the bytes the plan gives it. Ranks at other
    # TP ranks leave the TP-replicated norms to TP rank 0. A last stage's tied output layer is not written (the
    # first stage writes the embedding); the plan takes its optimizer state off evenly over DP, the save off the
    # ranks whose range holds it: they differ by up to that state.
    planned = plan.checkpointing["bytes_per_rank"]
    tied = 12 * model.vocab_size * model.hidden_size if model.tie_word_embeddings and cfg.trainer.pp > 1 else 0
    for t in (t for t in trainers if "checkpoint" in t):
        want = planned[f"pp {t['pp']}, dp {t['dp']}"]
        slack = tied if t["pp"] == cfg.trainer.pp - 1 and cfg.trainer.dp > 1 else 0
        if t["tp"] == 0:
            assert abs(t["checkpoint"] - want) <= slack, (t, want)
        else:
            assert 0.9 * want < t["checkpoint"] <= want, (t, want)


def test_activation_model_bounds_what_autograd_keeps():
    """The unfused (CPU) activation model is never below the tensors autograd saves, and at most 15% above."""
    from megatron_rl.models import get_preset
    from megatron_rl.planning.memory import activation_bytes
    from plan_workers import saved_activations_worker

    # bf16 on the tiny model: SmolLM2's bf16 forward took 18 s on a CPU without native bf16, for the same count.
    for preset, tp, dtype in (("tiny", 1, "fp32"), ("tiny", 2, "bf16"), ("smollm2-135m", 1, "fp32")):
        saved = run_local(saved_activations_worker, tp, preset, dtype, 4, 128)[0]
        predicted = activation_bytes(get_preset(preset), tp, 1, 0, 4, 128, 1, 4 if dtype == "fp32" else 2,
                                     fused=False)
        assert saved <= predicted <= 1.15 * saved, (preset, tp, dtype, saved, predicted)


class _ColdCommand:
    """A `megatron-rl` command in a fresh interpreter, started now and awaited by its test: its wall time and peak
    memory are its own (`wait4` on this very child, as soon as it ends), and it runs on the core that the module's
    in-process planning, one Python thread, leaves idle."""

    def __init__(self, argv: list[str], out_dir: Path):
        self.out, self.err = (open(out_dir / name, "w+") for name in ("stdout", "stderr"))
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, stdout=self.out, stderr=self.err, text=True, cwd=REPO)
        self.ended = threading.Thread(target=self._reap, daemon=True)
        self.ended.start()

    def _reap(self) -> None:
        _, status, usage = os.wait4(self.proc.pid, 0)
        self.wall, self.peak_kib = time.perf_counter() - self.t0, usage.ru_maxrss
        self.returncode = self.proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen

    def result(self, timeout: float) -> tuple[int, str, str]:
        """(exit status, stdout, stderr), once it has ended (the same for every test that asks)."""
        if getattr(self, "_result", None) is None:
            self.ended.join(timeout)
            if self.ended.is_alive():
                self.proc.kill()
                self.ended.join()
                pytest.fail(f"{self.proc.args} did not end within {timeout} s")
            with self.out, self.err:
                self.out.seek(0), self.err.seek(0)
                self._result = (self.returncode, self.out.read(), self.err.read())
        return self._result


@pytest.fixture(scope="module")
def plan_405b_cold(tmp_path_factory):
    """`megatron-rl plan` of the 405B recipe, cold, started before the recipes' plans are computed here; with a
    stated filesystem rate (which only the checkpointing times read)."""
    return _ColdCommand([sys.executable, "-m", "megatron_rl.cli", "plan", "-c", str(CONFIGS / "llama3-405b.yaml"),
                         "--json", "--filesystem-gbps", "8"], tmp_path_factory.mktemp("plan_405b"))


@pytest.fixture(scope="module")
def recipe_plans(shared_data, plan_405b_cold):  # the cold 405B plan runs beside these
    cal = load_calibration()
    plans = {}
    for name in ("llama3-8b", "llama3-70b", "llama3-405b-bf16", "qwen2.5-7b", "qwen3-30b-a3b"):
        cfg = load_config(CONFIGS / f"{name}.yaml")
        plans[name] = (cfg, make_plan(cfg, validate(cfg, cfg.run.world_size), cal))
    return plans


def test_8b_70b_405b_bf16_qwen_and_qwen3_moe_recipes_fit_on_80_gib(recipe_plans):
    for name, (cfg, plan) in recipe_plans.items():
        assert plan.trainer.device_bytes == 80 * GIB
        assert plan.trainer.fits and plan.generator.fits, (name, plan.trainer.worst, plan.generator.worst)
    # The bf16 405B generator fits as two pipeline stages, each holding about half of a TP8 rank's 101 GB.
    cfg, plan = recipe_plans["llama3-405b-bf16"]
    assert cfg.generator.pp == 2 and cfg.generator.quantization == "none" and len(plan.generator.ranks) == 2
    assert all(45 * GIB < r.parts["weights"] < 50 * GIB for r in plan.generator.ranks)
    # An independent count: a bf16 generator at TP1 holds 2 bytes per parameter of the preset's formula, and 2 more
    # per norm weight (Megatron-Core's local spec keeps RMSNorm weights in fp32).
    for name in ("llama3-8b", "qwen2.5-7b"):  # the Qwen2.5 count includes its QKV biases
        cfg, plan = recipe_plans[name]
        m = validate(cfg)
        norms = (2 * m.num_layers + 1) * m.hidden_size
        assert plan.generator.ranks[0].parts["weights"] == 2 * m.num_parameters(tp=1) + 2 * norms, name
        assert plan.sync.senders == cfg.trainer.tp * cfg.trainer.dp  # every trainer rank sends
    # The mixture of experts: a generator rank holds its TP share of the dense weights and 64 whole experts of each
    # layer (EP2 inside TP2), the descriptors' count of its parameters (DDMA's, not the meta model's), 2 bytes each
    # but the norms' 4 (fp32 in Megatron-Core's local spec).
    from megatron_rl.ddma.descriptors import rank_params

    cfg, plan = recipe_plans["qwen3-30b-a3b"]
    m = validate(cfg)
    held = rank_params(m, cfg.generator.layout, 0)
    norms = sum(lp.param.numel for lp in held if lp.param.name.endswith("norm.weight"))
    assert sum(".local_experts." in lp.local_name for lp in held) == m.num_layers * 64 * 2
    assert plan.generator.ranks[0].parts["weights"] == 2 * sum(math.prod(lp.local_shape) for lp in held) + 2 * norms
    assert plan.sync.senders == cfg.trainer.tp * cfg.trainer.pp * cfg.trainer.dp


def test_405b_plan_runs_in_a_minute_and_4_gib_and_fits(plan_405b_cold):
    returncode, stdout, stderr = plan_405b_cold.result(timeout=120)
    assert returncode == 0, stderr[-2000:]
    plan = json.loads(stdout)
    assert plan_405b_cold.wall < 60, plan_405b_cold.wall
    assert plan_405b_cold.peak_kib < 4 * (1 << 20), plan_405b_cold.peak_kib  # KiB
    assert plan["fits"] and plan["memory"]["trainer"]["fits"] and plan["memory"]["generator"]["fits"]
    assert plan["weight_sync"]["senders"] == 448 and plan["weight_sync"]["seconds"]["infiniband"] > 0
    assert plan["step_time"]["sync_s"] > plan["step_time"]["async_s"] > 0
    assert all(entry["source"] for key, entry in plan["calibration"].items() if key != "device")


@pytest.fixture(scope="module")
def paper_rows(shared_data):
    from megatron_rl.planning.paper import reproduce_paper

    return {r.model: r for r in reproduce_paper(CONFIGS, load_calibration())}


@pytest.mark.parametrize("model,mode", [("llama3-8b", "sync"), ("llama3-8b", "async"), ("llama3-70b", "sync"),
                                        ("llama3-70b", "async"), ("llama3-405b", "sync")])
def test_paper_step_time_within_25_percent(paper_rows, model, mode):
    row = paper_rows[model]
    error = row.sync_error if mode == "sync" else row.async_error
    assert abs(error) <= 0.25, (model, mode, row)


@pytest.mark.xfail(strict=True, reason="known miss: the 405B LlamaRL step is predicted about 32% short. Our recipe's "
                                       "step is bound by training plus the sync; the paper does not state its 405B "
                                       "split, generator format or workload, and its FSDP trainer is likely slower "
                                       "than ours (benchmarks/paper_405b_sensitivity.py, docs/benchmarks.md)")
def test_paper_405b_async_step_time_within_25_percent(paper_rows):
    assert abs(paper_rows["llama3-405b"].async_error) <= 0.25


def test_training_communication_is_the_closed_form():
    """TP all-reduces, pipeline transfers and the DP gradient/parameter exchange, by hand for one shape."""
    from megatron_rl.planning.steptime import ModelCost, TrainerShape, Workload, training_time

    cal = load_calibration()
    w, cost = Workload(64, 100, 156), ModelCost(10**9, 8, 1024)
    t = TrainerShape(tp=4, pp=2, dp=2, micro_batch_rows=4, activation_itemsize=2, grad_buffer_bytes=4 * 10**9,
                     param_buffer_bytes=2 * 10**9, tp_link_gbps=400.0, pp_link_gbps=50.0, dp_link_gbps=50.0)
    m = 64 // 2 // 4
    act = 4 * 256 * 1024 * 2
    compute = 3 * 64 * 256 * (2e9 + 4 * 8 * 1024 * 128) / (16 * cal.peak_tflops * 1e12 * cal.train_mfu) / m
    tp = 4 * 8 / 2 * 2 * 3 / 4 * act / 400e9
    p2p = 2 * act / 50e9
    dp = 0.5 * 6e9 / 50e9
    assert training_time(w, cost, t, cal).seconds == pytest.approx((m + 1) * (compute + tp + p2p) + dp, rel=1e-12)
    alone = TrainerShape(tp=4, pp=2, dp=2, micro_batch_rows=4)  # no links given: compute and bubble only
    assert training_time(w, cost, alone, cal).seconds == pytest.approx((m + 1) * compute, rel=1e-12)


def test_plan_vs_measured_composes_measured_rates_as_the_plan_does():
    """benchmarks/plan_vs_measured.py's core on synthetic metrics rows: the prediction is the closed form."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from plan_vs_measured import compare, interval_step_s

    def rows(gen, reward, train):
        return [{"step": k, "time/generation_s": g, "time/reward_s": r, "time/train_s": t}
                for k, (g, r, t) in enumerate(zip(gen, reward, train))]

    sync_rows = rows([9.0, 0.1, 0.3], [9.0, 0.02, 0.04], [9.0, 0.5, 0.7])  # step 0 is skipped
    async_rows = rows([9.0, 0.4, 0.6], [9.0, 0.05, 0.05], [9.0, 0.2, 0.4])
    out = compare(sync_rows, async_rows, weight_sync_s=0.01, measured_sync_s=1.0, measured_async_s=0.5, skip=1)
    assert out["sync"]["predicted_s"] == pytest.approx(0.2 + 0.03 + 0.6 + 0.01)
    assert out["async"]["predicted_s"] == pytest.approx(max(0.5 + 0.05, 0.3) + 0.01)
    assert out["async_from_sync_rates"]["predicted_s"] == pytest.approx(max(0.2 + 0.03, 0.6) + 0.01)
    assert out["sync"]["ratio"] == pytest.approx(0.84) and out["async"]["ratio"] == pytest.approx(1.12)
    assert interval_step_s({0: 5.0, 1: 6.0, 2: 6.5, 3: 7.5}, skip=2) == pytest.approx(0.75)


def _write_checkpoint(root: Path, shapes: dict, model: dict) -> Path:
    """A conversion-format checkpoint holding zeros of the given global shapes (metadata is what plan reads)."""
    import torch.distributed.checkpoint as dcp

    d = root / "ckpt"
    (d / "model").mkdir(parents=True)
    dcp.save({k: torch.zeros(v) for k, v in shapes.items()}, checkpoint_id=str(d / "model"), no_dist=True)
    (d / "megatron_rl.json").write_text(json.dumps({"format": "megatron-rl/dist_checkpointing", "model": model}))
    return d


def _tiny_shapes(L=4, h=64, f=176, heads=4, groups=2, vocab=384):
    d = h // heads
    return {"embedding.word_embeddings.weight": [vocab, h],
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight": [L, h],
            "decoder.layers.self_attention.linear_qkv.weight": [L, (heads + 2 * groups) * d, h],
            "decoder.layers.self_attention.linear_proj.weight": [L, h, heads * d],
            "decoder.layers.mlp.linear_fc1.layer_norm_weight": [L, h],
            "decoder.layers.mlp.linear_fc1.weight": [L, 2 * f, h],
            "decoder.layers.mlp.linear_fc2.weight": [L, h, f],
            "decoder.final_layernorm.weight": [h],
            "output_layer.weight": [vocab, h]}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_reshards_from_metadata(tmp_path, capsys):
    from megatron_rl import cli

    ckpt = _write_checkpoint(tmp_path, _tiny_shapes(vocab=512), {"name": "tiny"})  # written at TP2: 512 rows
    assert cli.main(["plan", "trainer.tp=1", "trainer.pp=2", "--checkpoint", str(ckpt), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["checkpoint"]
    assert report["loads"] and report["tensors"] == 9
    # Stage 0 reads the embedding (300 real rows are used, but the rank reads its padded 384) and layers 0-1.
    stage0 = 4 * (384 * 64 + 2 * (64 + 128 * 64 + 64 * 64 + 64 + 352 * 64 + 64 * 176))
    assert report["read_bytes_per_rank"]["pp 0"] == stage0


@pytest.mark.parametrize("args,needle", [
    (["-c", str(CONFIGS / "llama3-8b.yaml"), "trainer.tp=3"], "trainer.tp=3 does not divide"),
    (["--gpu-memory", "lots"], "--gpu-memory 'lots' is not a device memory size"),
    (["--gpu-memory", "0"], "--gpu-memory 0.0 is not a device memory size"),
    (["generator.pp=3"], "generator.pp=3 does not divide model.num_layers=4"),
    (["--filesystem-gbps", "fast"], "--filesystem-gbps 'fast': give the write rate per node in GB/s"),
    (["--filesystem-gbps", "5,0"], "--filesystem-gbps '5,0': give the write rate per node in GB/s"),
])
def test_bad_inputs_get_one_line(args, needle, capsys):
    from megatron_rl import cli

    assert cli.main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err, err


def test_plan_runs_without_the_clusters_files(tmp_path, capsys):
    """A job is planned on a laptop: its data, tokenizer, reward function and run directory live on the cluster.
    `train`'s validation reports each of them; `plan` leaves them out and says so."""
    from megatron_rl import cli
    from megatron_rl.config import ConfigError, load_config, validate

    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the run directory would be: checkpoint.dir cannot be created under it
    job = ["data.dataset=jsonl", "data.path=/cluster/prompts.jsonl", "model.tokenizer=/cluster/tokenizer.model",
           "trainer.sft_warmup_steps=0", "reward.kind=function", "reward.function=cluster_rewards:score",
           f"checkpoint.dir={blocked / 'runs'}"]
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, job))
    for needle in ("data.path='/cluster/prompts.jsonl' does not exist", "model.tokenizer='/cluster/tokenizer.model'",
                   "cluster_rewards", "checkpoint.dir"):
        assert needle in str(e.value), (needle, str(e.value))
    assert cli.main(["plan", *job, "--json"]) == 0, capsys.readouterr().err
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any(n.startswith("not checked here (the data files, model.tokenizer") for n in notes), notes
    assert cli.main(["plan", *job, "trainer.tp=3"]) == 2  # everything else is still checked
    assert "trainer.tp=3" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_of_another_model_and_unsourced_calibration_get_one_line(tmp_path, capsys):
    from megatron_rl import cli

    ckpt = _write_checkpoint(tmp_path, _tiny_shapes(h=32, f=96), {"name": "tiny"})
    assert cli.main(["plan", "--checkpoint", str(ckpt)]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds another model" in err and "\n" not in err, err
    text = (Path(__file__).resolve().parents[1] / "megatron_rl/planning/h100.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace('source: "H100 SXM datasheet: 989', 'source: "" # 989'))
    assert cli.main(["plan", "--calibration", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "peak_tflops has no source" in err and "\n" not in err, err


def test_an_fp8_generator_is_planned_with_int8s_bytes():
    """Both hold one byte per quantized weight and a float32 scale per row; the planner builds the fp8 stage itself
    (its Fp8Weights on the meta device), and it holds less than the dense bf16 generator."""
    cal = load_calibration()
    weights = {}
    for q in ("none", "int8", "fp8"):
        cfg = load_config(None, ["generator.tp=2", "generator.dtype=bf16", f"generator.quantization={q}"])
        weights[q] = make_plan(cfg, validate(cfg), cal).generator.ranks[0].parts["weights"]
    assert weights["fp8"] == weights["int8"] < weights["none"]


def test_generation_is_planned_for_the_busiest_replica_as_the_job_splits_prompts():
    """The job gives each generator replica whole prompts (all their samples): with 10 prompts of 4 samples over 3
    replicas, replica 0 samples 4 prompts, 16 sequences, not an equal share of 40 (14). The synchronous baseline
    runs on all 11 GPUs at the trainer's TP1, 11 replicas: 1 prompt, 4 sequences, not 40 / 11 (4 too; the async
    case is the one that tells the two rules apart)."""
    cal = load_calibration()
    cfg = load_config(None, ["rollout.prompts_per_step=10", "rollout.samples_per_prompt=4", "generator.dp=3",
                             "trainer.tp=1", "trainer.dp=8"])
    plan = make_plan(cfg, validate(cfg), cal).to_dict()
    assert plan["assumptions"]["sync_baseline"]["layout"] == "tp=1,pp=1,dp=11"
    job = {dp: max(len(cfg.rollout.replica_prompts(i, dp)) for i in range(dp)) * 4 for dp in (3, 11)}
    assert job == {3: 16, 11: 4}
    assert plan["step_time"]["async"]["generation"]["sequences_per_replica"] == job[3]
    assert plan["step_time"]["sync"]["generation"]["sequences_per_replica"] == job[11]


def test_pipelined_generator_decode_model():
    """A decode step of a PP generator is pp lock-step ticks, each reading a stage's weights and one micro-batch's
    KV cache: with pp micro-batches in flight the step reads the KV cache once, with one micro-batch pp times."""
    import dataclasses

    from megatron_rl.planning.steptime import GeneratorShape, ModelCost, Workload, generation_time

    cal = load_calibration()
    w, cost = Workload(64, 100, 50), ModelCost(10**9, 4, 1024)
    stage_weights, kv_token, context = 1e9, 1e5, 100 + 50 / 2
    one = GeneratorShape(tp=1, pp=2, replicas=1, slots=64, weight_bytes_per_gpu=int(stage_weights),
                         kv_bytes_per_token_per_gpu=kv_token)
    decode = {m: generation_time(w, cost, dataclasses.replace(one, micro_batches=m), cal, 1.0).detail["decode_s"]
              for m in (1, 2)}
    per_byte = 50 / (cal.hbm_bandwidth_gbps * 1e9)
    assert decode[1] == pytest.approx(per_byte * 2 * (stage_weights + 64 * context * kv_token))
    assert decode[2] == pytest.approx(per_byte * (2 * stage_weights + 64 * context * kv_token))


def _reward_model_bytes(rank, world_size, path):
    """Bytes this TP rank of a real bf16 `ParallelRewardModel` holds: its GPTModel shard's parameters and its head."""
    from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, build_topology
    from megatron_rl.rewards.sequence_classifier import ParallelRewardModel

    g = build_topology([ExecutorPlacement("reward", ParallelLayout(tp=world_size))])["reward"]
    rm = ParallelRewardModel(path, g.layout, g.pgs, params_dtype=torch.bfloat16)
    return sum(p.numel() * p.element_size() for p in rm.model.parameters()) + rm.head.numel() * rm.head.element_size()


def test_reward_executor_gpus_and_weights_are_planned(tmp_path):
    """A reward model on ranks of its own: the plan counts its tp x dp GPUs in the job's, and plans each rank's
    weights as the bytes a real ParallelRewardModel of that TP rank holds (its vocabulary padded per TP, its fp32
    head), in a third executor of the report and the JSON; the step time leaves it out and says so."""
    pytest.importorskip("transformers")
    from test_rewards import _tiny_reward_model
    from tiny_hf import WORDS, save_tiny_llama, save_word_tokenizer

    from megatron_rl.planning.report import format_text

    save_tiny_llama(tmp_path / "hf", vocab_size=16)
    save_word_tokenizer(tmp_path / "hf")
    _tiny_reward_model(tmp_path / "rm")
    data = tmp_path / "words.jsonl"
    data.write_text("".join(json.dumps({"question": " ".join(WORDS[i % 5: i % 5 + 3])}) + "\n" for i in range(12)))
    base = [f"model.checkpoint={tmp_path / 'hf'}", "data.dataset=jsonl", f"data.path={data}",
            "data.answer_field=null", "data.eval_size=4", "reward.kind=reward-model", f"reward.model={tmp_path / 'rm'}",
            "trainer.sft_warmup_steps=0", "generator.dtype=bf16"]
    cal = load_calibration()
    for tp, dp in ((1, 2), (2, 1)):
        # (each reward replica scores whole generator replicas: two need two)
        cfg = load_config(None, base + [f"reward.executor.tp={tp}", f"reward.executor.dp={dp}", f"generator.dp={dp}"])
        plan = make_plan(cfg, validate(cfg), cal)
        executors = cfg.trainer.layout.size + cfg.generator.layout.size
        assert plan.assumptions["gpus"] == executors + tp * dp == cfg.world_size_needed
        assert plan.assumptions["sync_baseline"]["gpus_used"] <= executors
        real = run_local(_reward_model_bytes, tp, str(tmp_path / "rm"))
        assert len(set(real)) == 1  # every TP rank holds the same bytes
        rm = plan.to_dict()["memory"]["reward_model"]
        assert rm["layout"] == f"tp={tp},dp={dp}" and rm["fits"] and rm["ranks"][0]["weights_bytes"] == real[0]
        text = format_text(plan)
        assert f"{executors + tp * dp} GPUs" in text and f"reward model (tp={tp},dp={dp}): fits" in text
        assert "reward model's" in text and "in neither step time" in text


def test_checkpoint_times_follow_the_rates(plan_405b_cold):
    """The 405B recipe (TP8 x PP14 x DP4): the busiest rank writes its DP quarter of the optimizer state (12 bytes
    an element) and a quarter of its shard's weights; nothing is gathered. Times are bytes over the stated rates."""
    returncode, stdout, stderr = plan_405b_cold.result(timeout=120)
    assert returncode == 0, stderr[-2000:]
    c = json.loads(stdout)["checkpointing"]
    n = 405e9 / (8 * 14)  # parameters of one model-parallel shard, about
    assert 0.95 < c["busiest_rank_bytes"] / (n * 2 / 4 + n * 12 / 4) < 1.1
    assert c["host_bytes_per_rank"] == c["busiest_rank_bytes"]
    assert c["rates"] == {"host_copy_gbps": 55, "filesystem_write_gbps": 8.0, "filesystem_read_gbps": 16.0}
    assert c["save_blocking_s"] == pytest.approx(c["busiest_rank_bytes"] / 55e9)
    assert c["save_total_s"] == pytest.approx(c["save_blocking_s"] + c["node_bytes"] / 8e9)
    # A load: the checksums over all the bytes, spread over the 56 nodes, then the busiest node's reads (8 TP
    # ranks); at the layout it was saved with, a rank reads what it wrote.
    assert c["load_bytes_per_rank"] == c["bytes_per_rank"]
    assert c["load_checksum_s"] == pytest.approx(c["total_bytes"] / 56 / 16e9)
    assert c["load_read_s"] == pytest.approx(8 * max(c["load_bytes_per_rank"].values()) / 16e9)
    assert c["load_s"] == pytest.approx(c["load_checksum_s"] + c["load_read_s"])
    assert c["node_bytes"] == pytest.approx(c["total_bytes"] / (8 * 14 * 4) * 8, rel=1e-6)


def test_meta_modules_know_which_weights_are_split_over_tp():
    """The planner's meta modules are built as `build_gpt_model(initialize=False)` builds a model: Megatron-Core's
    initializer still runs, and sets each weight's tensor-parallel split. Column-parallel weights (embedding, QKV,
    FC1, output) split along rows, row-parallel ones (attention projection, FC2) along columns, norms not at all."""
    from megatron_rl.models import get_preset
    from megatron_rl.parallel import ParallelLayout
    from megatron_rl.planning.meta import build_rank_modules

    infos = build_rank_modules(get_preset("tiny"), ParallelLayout(2, 1, 1)).params
    dims = {p.name.split(".", 3)[-1] if p.name.startswith("decoder.layers.") else p.name: p.partition_dim
            for p in infos}
    for name, dim in dims.items():
        want = (1 if name.endswith(("linear_proj.weight", "linear_fc2.weight"))
                else None if "norm" in name else 0)
        assert dim == want, (name, dim)
    assert {"embedding.word_embeddings.weight", "output_layer.weight"} <= set(dims)


def test_what_fits_is_the_largest_batch_that_fits():
    """The 8B recipe at 8,192 new tokens fits neither executor; the plan names the largest micro-batch and
    generator batch that fit, and the plan of the job with them says so (one more does not)."""
    cal = load_calibration()

    def plan(*overrides):
        cfg = load_config(str(CONFIGS / "llama3-8b.yaml"), ["rollout.max_new_tokens=8192", *overrides])
        return make_plan(cfg, validate(cfg, cfg.run.world_size, cluster_files=False), cal)

    p = plan()
    assert not p.trainer.fits and not p.generator.fits
    notes = [n for n in p.notes if "fits with" in n]
    assert notes[0].startswith("the trainer fits with trainer.micro_batch_size=3 ")
    assert notes[1].startswith("the generator fits with generator.max_batch_size=55 ")
    fixed = plan("trainer.micro_batch_size=3", "generator.max_batch_size=55")
    assert fixed.trainer.fits and fixed.generator.fits
    over = plan("trainer.micro_batch_size=4", "generator.max_batch_size=56")
    assert not over.trainer.fits and not over.generator.fits
    # A paged cache: the most tokens that fit, whatever the slots.
    paged = plan("generator.max_batch_size=256", "generator.kv_cache_tokens=2000000")
    (note,) = [n for n in paged.notes if n.startswith("the generator fits with")]
    tokens = int(note.rsplit("=", 1)[1])
    assert plan("generator.max_batch_size=256", f"generator.kv_cache_tokens={tokens}").generator.fits
    assert not plan("generator.max_batch_size=256", f"generator.kv_cache_tokens={tokens + 160}").generator.fits

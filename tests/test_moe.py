"""Mixture-of-experts models (Qwen3-MoE, Mixtral): Megatron-Core's MoE layers under tensor and expert parallelism
against transformers' own classes."""

import pytest
import torch

from tiny_hf import MOE_CONFIGS, file_state_dict, tiny_family_model, tiny_moe_models


@pytest.fixture(scope="module")
def moe_models():
    """family -> (transformers model, ModelConfig, logical Megatron weights)."""
    return tiny_moe_models()


@pytest.mark.parametrize("layout", [dict(tp=2, dp=2, ep=2), dict(tp=2, ep=2, etp=1)], ids=["trainer", "in-tp"])
def test_logits_at_tp2_ep2_match_transformers(moe_models, layout):
    """TP2 x DP2 x EP2 (a trainer's layout: each rank holds 2 of the 4 experts, each split over 2 TP ranks) and
    TP2 with EP2 inside TP (a generator's: each TP rank holds 2 whole experts): the weights gathered back are the
    loaded ones bit for bit, and every rank's logits equal transformers' within the dense families' bound. The MoE
    layer splits its tokens over TP itself (`models.moe.TokenSplitMoELayer`)."""
    from megatron_rl.launch.spawn import run_local
    from moe_workers import logits_worker

    tokens = torch.randint(0, 300, (3, 7), generator=torch.Generator().manual_seed(3))  # 21 tokens: TP pads one
    cases = [(cfg, full) for _, cfg, full in moe_models.values()]
    results = run_local(logits_worker, layout["tp"] * layout.get("dp", 1), cases, tokens, layout)
    for i, family in enumerate(moe_models):
        with torch.no_grad():
            want = moe_models[family][0](tokens).logits
        for rank, per_rank in enumerate(results):
            same, logits = per_rank[i]
            assert same, (family, rank)
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=0, msg=lambda m: f"{family} rank {rank}: {m}")


def test_trainer_ep_is_checked_in_one_line_each():
    """`trainer.ep`: a mixture-of-experts model only, dividing the trainer's DP ranks and the experts."""
    from megatron_rl.config import ConfigError, load_config, validate

    moe = ["model.family=mixtral", "model.num_moe_experts=4"]
    validate(load_config(None, moe + ["trainer.tp=1", "trainer.dp=2", "trainer.ep=2"]))
    assert load_config(None, moe + ["trainer.dp=2", "trainer.ep=2"]).trainer.layout.ep == 2
    for overrides, message in [
            (["trainer.dp=2", "trainer.ep=2"], r"trainer.ep=2 needs a mixture-of-experts model \(this one is dense"),
            (moe + ["trainer.dp=1", "trainer.ep=2"], r"trainer.ep=2 does not divide trainer.dp=1 \(a trainer splits "
             r"its experts over DP ranks, each expert over TP: set trainer.dp to a multiple of 2, or trainer.ep=1; README"),
            (moe + ["trainer.dp=3", "trainer.ep=3"], "trainer.ep=3 does not divide model.num_moe_experts=4"),
            (moe + ["trainer.ep=0"], "trainer.ep=0 must be >= 1")]:
        with pytest.raises(ConfigError, match=message):
            validate(load_config(None, overrides))


MOE_TINY = {"family": "mixtral", "num_moe_experts": 4}


def test_a_checkpoint_saved_at_ep2_resumes_at_ep1_and_at_tp2_exactly(tmp_path):
    """A mixture-of-experts trainer saved at DP2 x EP2 (experts and their optimizer state split over the DP
    ranks) resumes at DP4 x EP2 (each expert on two DP ranks: one reads it, and sends it to the other) and at TP2 x
    DP2 x EP2 and takes the same next step as the uninterrupted run: loss and every weight. Expert weights are expert-parallel at every EP (`build_gpt_model`), so the optimizer
    is the same two-part chain whatever the EP. `resume-check` rehearses both: the save it builds on the meta device
    is the one written (chunk for chunk), each rank reads the bytes it predicted, and an expert chunk missing from
    the index is named in one line."""
    from pathlib import Path

    from ckpt_workers import index_contents, load_and_continue, train_save_continue
    from megatron_rl.launch.spawn import run_local
    from megatron_rl.models import get_preset
    from megatron_rl.models.hf_mapping import hf_to_megatron
    from megatron_rl.parallel import ParallelLayout
    from megatron_rl.planning.resume_check import ResumeCheckError, TrainerSpec, read_index, rehearse, rehearsed_index
    from tiny_hf import tiny_family_model

    cfg = get_preset("tiny", **MOE_TINY)
    hf = tiny_family_model("mixtral", num_layers=cfg.num_layers)  # the tiny preset's shape, 4 experts of 176
    state = tmp_path / "full.pt"
    torch.save(hf_to_megatron(file_state_dict(hf), cfg), state)
    ref = run_local(train_save_continue, 2, dict(dp=2, ep=2, model=MOE_TINY), str(state), str(tmp_path / "c"), 2)[0]
    index = read_index(Path(ref["path"]))
    rehearsed = rehearsed_index(TrainerSpec(cfg, ParallelLayout(dp=2, ep=2), attention="sdpa"), Path("dp2-ep2"))
    assert index_contents(rehearsed) == index_contents(index)
    for layout in (dict(dp=4, ep=2, model=MOE_TINY), dict(tp=2, dp=2, ep=2, model=MOE_TINY)):
        target = ParallelLayout(**{k: v for k, v in layout.items() if k != "model"})
        predicted = sorted(rehearse(index, TrainerSpec(cfg, target, attention="sdpa")),
                           key=lambda r: target.local_rank(r.tp, r.pp, r.dp))
        # at DP4 (experts sent point to point within each expert-data-parallel pair) under NCCL's rules
        loaded = run_local(load_and_continue, target.size, layout, ref["path"], 2, True, target.dp == 4)
        assert [r["read_bytes"] for r in loaded] == [r.read_bytes for r in predicted], layout
        if target.dp == 4:  # DP ranks 0 and 2 hold the same experts, as do 1 and 3: each pair reads them once
            assert sum(r.read_bytes for r in predicted) < sum(r.needed_bytes for r in predicted)
        for r in loaded:
            assert r["steps_done"] == 3
            assert r["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], rel=1e-5, abs=1e-7)
            for k, v in ref["params"].items():
                torch.testing.assert_close(r["params"][k], v, atol=1e-5, rtol=0, msg=lambda s: f"{k}: {s}")
    # One expert's chunk of the Adam moments gone from the index: the resume is refused before it loads a byte.
    broken = read_index(Path(ref["path"]))
    key = next(k for k in broken.metadata["optimizer"].state_dict_metadata if ".experts." in k and "exp_avg" in k)
    chunks = broken.metadata["optimizer"].state_dict_metadata[key].chunks
    assert len(chunks) == cfg.num_layers * cfg.num_moe_experts  # one chunk per layer and expert
    del chunks[5]
    with pytest.raises(ResumeCheckError, match=rf"^{broken.label('optimizer')}: {key}: elements \[.* are in no saved "
                                               rf"chunk \(the trainer at tp=1,pp=1,dp=2 loads it\)$"):
        rehearse(broken, TrainerSpec(cfg, ParallelLayout(dp=2), attention="sdpa"))


def test_eval_greedy_at_tp2_ep2_from_an_ep2_conversion_writes_what_transformers_generate_writes(shared_data,
                                                                                                  tmp_path, capsys):
    """Each MoE family converted at TP2 x EP2 with its chat tokenizer; `megatron-rl eval` (greedy, fp32) at TP2
    writes transformers' greedy `generate` text for the GSM8K prompts."""
    import json

    import transformers

    from megatron_rl.checkpointing.convert import convert
    from megatron_rl.cli import main
    from test_families import LIMIT, NEW, _reference
    from tiny_hf import save_chat_word_tokenizer

    rows = [json.loads(line) for line in (shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()[:LIMIT]]
    for family in MOE_CONFIGS:
        src = tmp_path / f"{family}-hf"
        tok = save_chat_word_tokenizer(src)
        model = tiny_family_model(family, vocab_size=len(tok), scale=4.0, seed=1)
        model.save_pretrained(src, safe_serialization=True)
        assert convert(src, tmp_path / family, "megatron", tp=2, ep=2)["layout"]["ep"] == 2
        samples = tmp_path / f"{family}.jsonl"
        rc = main(["eval", str(tmp_path / family), "--limit", str(LIMIT), "--max-new-tokens", str(NEW), "--tp", "2",
                   "--samples-out", str(samples)])
        out = capsys.readouterr()
        assert rc == 0, out.err[-3000:]
        got = [json.loads(line) for line in samples.read_text().splitlines()]
        want = _reference(model, transformers.AutoTokenizer.from_pretrained(src), rows)
        assert [(g["prompt"], g["output"], g["new_tokens"]) for g in got] == \
            [(w["prompt"], w["output"], w["new_tokens"]) for w in want], family
        assert any(w["output"] for w in want)


def test_train_from_a_converted_qwen3_moe_at_ep2_checks_every_push_and_resumes_at_ep1(tmp_path):
    """`megatron-rl train model.checkpoint=<a converted tiny Qwen3-MoE> trainer.ep=2`: a DP2 x EP2 trainer and a
    TP1 generator, every weight push checked, routing replay on, after a short warm start; then the same run resumed
    at trainer.ep=1 (the checkpoint's experts read back over other ranks) to one more step, its generator in int8
    (experts quantized as DDMA writes them, the router in full precision)."""
    import json

    import warm_cli
    from megatron_rl.checkpointing.convert import convert

    hf = tiny_family_model("qwen3_moe")
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    convert(tmp_path / "hf", tmp_path / "meg", "megatron", ep=2)
    args = ["train", f"model.checkpoint={tmp_path / 'meg'}", "model.tokenizer=byte", "trainer.tp=1", "trainer.dp=2",
            "generator.tp=1", "trainer.sft_warmup_steps=3", "rollout.prompts_per_step=4",
            "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "generator.push_check_interval=1",
            "checkpoint.save_interval=1", f"checkpoint.dir={tmp_path}", "run.name=moe"]
    # The EP2 run starts with a short warm start, whose experts' dispatcher all-gathers over the DP ranks
    # (`test_warm_start_rows_have_one_width_over_expert_parallel_ranks`).
    for ep, steps, generator in ((2, 2, "none"), (1, 3, "int8")):
        job = warm_cli.run([*args, f"trainer.ep={ep}", f"run.steps={steps}", f"generator.quantization={generator}"])
        assert job.returncode == 0, job.stderr[-3000:]
        banner = f"active: 2 of 4 experts), trainer tp=1 pp=1 dp=2{' ep=2' if ep == 2 else ''}, "
        assert banner in job.stdout + job.stderr
        assert (", int8 generator weights, " in job.stdout + job.stderr) == (generator == "int8")
        summary = json.loads(job.stdout.strip().splitlines()[-1])
        assert (summary["steps"], summary["resumed_from_step"]) == (steps, 0 if ep == 2 else 2)
    rows = [json.loads(line) for line in (tmp_path / "moe" / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows if "step" in r}) == [0, 1, 2]  # three steps, the third after the resume
    # Both resumes were rehearsed before they loaded (`check_resume`); `resume-check` rehearses the last checkpoint
    # (written at EP1) at EP2.
    job = warm_cli.run(["resume-check", str(tmp_path / "moe"), "trainer.ep=2", "--json"])
    assert job.returncode == 0, job.stderr[-3000:]
    report = json.loads(job.stdout)
    assert report["ok"] and (report["written_at"], report["target"]) == ("tp=1,pp=1,dp=2", "tp=1,pp=1,dp=2,ep=2")
    assert [(r["tp"], r["dp"]) for r in report["per_rank"]] == [(0, 0), (0, 1)] and report["read_bytes"] > 0


def test_rl_step_at_tp2_dp2_ep2_is_the_single_rank_step(moe_models):
    """An AIPO step of a TP2 x DP2 x EP2 trainer (Megatron-Core's DDP and distributed optimizer; expert gradients
    reduced over the expert-data-parallel group, the grad norm counting every weight once: clipping is on and
    shapes the update) equals a single-rank TP1 trainer's on the same batch, for both families, with padded and
    with packed micro-batches (the same micro-batches at both layouts), the load-balancing loss on: loss, grad
    norm, the response-token statistics, `moe_aux_loss`, every weight gathered back. Control: the loss's
    coefficient changes the gradient (its norm), not the forward (loss and `moe_aux_loss`)."""
    from megatron_rl.launch.spawn import run_local
    from moe_workers import moe_batch, rl_step_worker

    cases = [(cfg, full) for _, cfg, full in moe_models.values()]
    batch = moe_batch(cases[0][0].vocab_size)
    runs = [(False, 1.0, 2), (True, 1.0, 2)]
    ref = run_local(rl_step_worker, 1, cases, batch, dict(), runs + [(False, 0.0, 2)])[0]
    out = run_local(rl_step_worker, 4, cases, batch, dict(tp=2, dp=2, ep=2), runs)
    keys = ("loss", "grad_norm", "is_weight_mean", "is_weight_max", "logp_diff_mean", "logp_diff_max", "entropy",
            "moe_aux_loss")
    for c, family in enumerate(moe_models):
        padded, _, off = ref[c * 3: c * 3 + 3]
        assert off["metrics"]["loss"] == padded["metrics"]["loss"]
        assert off["metrics"]["moe_aux_loss"] == padded["metrics"]["moe_aux_loss"]
        assert off["metrics"]["grad_norm"] != pytest.approx(padded["metrics"]["grad_norm"], rel=1e-3)
        for i in range(len(runs)):
            want = ref[c * 3 + i]
            for rank, per_rank in enumerate(out):
                got = per_rank[c * len(runs) + i]
                for key in keys:
                    assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-6), \
                        (family, i, rank, key)
                for k, v in want["params"].items():
                    torch.testing.assert_close(got["params"][k], v, atol=1e-5, rtol=0,
                                               msg=lambda s: f"{family} run {i} rank {rank} {k}: {s}")


def test_moe_aux_loss_is_the_switch_loss_of_transformers(moe_models):
    """`moe_aux_loss` of a step equals transformers' `load_balancing_loss_func` (divided by k) on the router
    logits of each micro-batch's real tokens (padding excluded), averaged over micro-batches by response tokens
    and over layers; it is reported with the coefficient 0 too."""
    from megatron_rl.launch.spawn import run_local
    from moe_workers import balance_worker, moe_batch

    _, cfg, full = moe_models["mixtral"]
    got, want, hooked = run_local(balance_worker, 1, cfg, full, moe_batch(cfg.vocab_size, seed=1), 0.0)[0]
    assert hooked and 1.0 <= want < cfg.num_moe_experts / cfg.moe_router_topk
    assert got == pytest.approx(want, rel=1e-6)


def test_warm_start_rows_have_one_width_over_expert_parallel_ranks():
    """With experts split over DP ranks (trainer.ep > 1) the MoE layers' dispatcher all-gathers every DP rank's
    tokens, which needs one shape on all of them: each rank's warm-start rows are padded to the longest row of the
    whole step (a DP2 x EP2 tiny-MoE job's warm start crashed gloo at step 54, where the two ranks' longest rows
    first differed). The rows themselves are the ones a dense trainer gets, and a dense trainer (EP1) keeps its
    own width."""
    from types import SimpleNamespace

    from megatron_rl.controller.executors import SFT_BATCH_SIZE, TrainerExecutor
    from megatron_rl.parallel import ParallelLayout
    from megatron_rl.tokenizers.byte import ByteTokenizer

    tok = ByteTokenizer()
    rows = [("1+1=", "2")] * SFT_BATCH_SIZE + [("12+34=", "46")] * SFT_BATCH_SIZE  # rank 1's are longer
    task = SimpleNamespace(demonstrations=lambda step, n: rows[:n])

    def batch(ep: int, rank: int) -> dict:
        me = SimpleNamespace(task=task, tok=tok, encode=tok.encode,
                             groups=SimpleNamespace(layout=ParallelLayout(dp=2, ep=ep), dp_rank=rank))
        return TrainerExecutor._demonstration_batch(me, 0)

    dense = [batch(1, r) for r in (0, 1)]
    experts = [batch(2, r) for r in (0, 1)]
    assert dense[0]["tokens"].shape[1] < dense[1]["tokens"].shape[1]
    assert experts[0]["tokens"].shape == experts[1]["tokens"].shape == dense[1]["tokens"].shape
    for d, e in zip(dense, experts):
        w = d["tokens"].shape[1]
        assert torch.equal(e["tokens"][:, :w], d["tokens"]) and (e["tokens"][:, w:] == tok.pad_id).all()
        assert torch.equal(e["loss_mask"][:, :w], d["loss_mask"]) and not e["loss_mask"][:, w:].any()

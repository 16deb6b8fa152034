"""The trainer's optimizer options of `megatron-rl config` (trainer.lr_warmup_steps, sft_lr, weight_decay,
adam_beta1/2, adam_eps, max_nonfinite_steps) reach the engine (the trainer section and `lr_schedule`) and do what
they say in a running engine, checked against closed forms; and data.eval_path is where a JSONL task's held-out problems come from.

How Megatron-Core 0.16 applies them (read from megatron/core/optimizer/__init__.py and optimizer_param_scheduler.py):
- Without transformer-engine or apex the Adam optimizer is torch.optim.AdamW (OptimizerConfig's default
  decoupled_weight_decay=True): p <- p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps), with bias-corrected moments.
  The project's `_use_fused_adam` switches it to torch's fused kernel on GPUs and to its foreach path on CPUs (the
  same update).
- Weight decay skips 1-D parameters and biases (the standard override wd_mult=0: the norm weights here).
- The scheduler sets the learning rate when it is built (num_steps=0) and after each successful optimizer step, so
  optimizer step k (1-based) uses the rate for num_steps = k - 1: with W warm-up steps from init_lr=0,
  lr_k = lr * min(k - 1, W) / W. The first step's rate is 0 (it moves no weight but does update Adam's moments).
"""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.controller.executors import SFT_LR_WARMUP_STEPS, SFT_MIN_DECAY_STEPS, lr_schedule
from megatron_rl.controller.tasks import build_task
from megatron_rl.data import DataError
from megatron_rl.launch.spawn import run_local
from megatron_rl.tokenizers import ByteTokenizer
from megatron_rl.training.settings import LRSchedule
from options_workers import rl_optimizer_worker, warm_start_worker
from rl_workers import random_full_state

RL_OPTIONS = ["trainer.sft_warmup_steps=0", "trainer.lr=0.01", "trainer.lr_warmup_steps=4",
              "trainer.weight_decay=0.1", "trainer.adam_beta1=0.8", "trainer.adam_beta2=0.9", "trainer.adam_eps=1e-4",
              "trainer.max_nonfinite_steps=2"]


# ---- config -> the engine's settings ----------------------------------------------------------------------------
def test_rl_options_map_to_the_optimizer_settings():
    cfg = load_config(None, RL_OPTIONS + ["trainer.sft_lr=0.5", "trainer.clip_grad=3.0", "run.steps=7",
                                          "trainer.use_distributed_optimizer=false"])
    assert lr_schedule(cfg) == LRSchedule(lr=0.01, min_lr=0.0, warmup_steps=4, total_steps=7, decay_style="constant")
    t = cfg.trainer  # the engine reads the optimizer's fields from the trainer section itself
    assert (t.weight_decay, t.adam_beta1, t.adam_beta2, t.adam_eps, t.clip_grad, t.use_distributed_optimizer,
            t.max_nonfinite_steps) == (0.1, 0.8, 0.9, 1e-4, 3.0, False, 2)


@pytest.mark.parametrize("sft_steps,total", [(20, 20), (3, SFT_MIN_DECAY_STEPS)])
def test_warm_start_options_map_to_the_optimizer_settings(sft_steps, total):
    # The warm start's schedule: trainer.sft_lr after SFT_LR_WARMUP_STEPS of warm-up, cosine to a tenth of it;
    # trainer.lr and trainer.lr_warmup_steps do not apply to it (RL starts its own schedule after it).
    cfg = load_config(None, [f"trainer.sft_warmup_steps={sft_steps}", "trainer.sft_lr=0.02", "trainer.lr=0.5",
                             "trainer.lr_warmup_steps=7", "trainer.weight_decay=0.05", "trainer.adam_beta1=0.7",
                             "trainer.adam_beta2=0.95", "trainer.max_nonfinite_steps=5", "run.steps=99"])
    assert lr_schedule(cfg) == LRSchedule(lr=0.02, min_lr=pytest.approx(0.002, rel=1e-12),
                                          warmup_steps=SFT_LR_WARMUP_STEPS, total_steps=total, decay_style="cosine")
    t = cfg.trainer
    assert (t.weight_decay, t.adam_beta1, t.adam_beta2, t.adam_eps, t.clip_grad, t.use_distributed_optimizer,
            t.max_nonfinite_steps) == (0.05, 0.7, 0.95, 1e-8, 1.0, True, 5)


def test_defaults_map_to_the_optimizer_settings():
    cfg = load_config(None, ["trainer.sft_warmup_steps=0"])
    s, t = lr_schedule(cfg), cfg.trainer
    assert (s.lr, s.warmup_steps, t.weight_decay, t.adam_beta1, t.adam_beta2, t.adam_eps, t.max_nonfinite_steps) == \
        (2e-4, 0, 0.0, 0.9, 0.999, 1e-8, 3)


# ---- the options in a running engine -----------------------------------------------------------------------------
RL_STEPS = 7
ENGINE_OPTIONS = RL_OPTIONS + ["trainer.tp=1", "trainer.dtype=fp32", "trainer.attention=sdpa",
                               "trainer.clip_grad=1e6", "trainer.max_guarded_steps=3", f"run.steps={RL_STEPS + 20}"]


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("options") / "full.pt"
    torch.save(random_full_state(seed=3), path)  # weights of 0.1 to 1: weight decay moves them visibly
    return run_local(rl_optimizer_worker, 1, ENGINE_OPTIONS, str(path), RL_STEPS)[0]


def rl_lr(k: int, lr: float = 0.01, warmup: int = 4) -> float:
    """The learning rate of optimizer step k (1-based) of the RL schedule: linear from 0, then constant."""
    return lr * min(k - 1, warmup) / warmup


def test_the_learning_rate_warms_up_linearly_over_lr_warmup_steps_then_stays(rl_run):
    assert rl_run["dtypes"] == ["torch.float32"] and rl_run["main_grad_dtypes"] == ["torch.float32"]
    log, metrics = rl_run["log"][:RL_STEPS], rl_run["metrics"]
    assert [m["skipped"] for m in metrics] == [False] * RL_STEPS
    want = [rl_lr(k) for k in range(1, RL_STEPS + 1)]
    assert want[:6] == pytest.approx([0.0, 0.0025, 0.005, 0.0075, 0.01, 0.01])
    for k, entry in enumerate(log, 1):
        assert entry["lr"] == pytest.approx([want[k - 1]] * len(entry["lr"]), rel=1e-12, abs=0), k
    # The reported "lr" is the optimizer's after the step: the rate the next step will use.
    assert [m["lr"] for m in metrics] == pytest.approx([rl_lr(k + 1) for k in range(1, RL_STEPS + 1)], rel=1e-12)


def test_adamw_foreach_path_gives_the_per_parameter_paths_bits_on_cpu():
    """`_use_fused_adam` moves CPU groups to torch's foreach AdamW on the promise that it is the per-parameter path's
    update bit for bit: checked here on parameters of several shapes, with weight decay and amsgrad off, 5 steps."""
    from megatron_rl.training.engine import _use_fused_adam

    torch.manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2), (1,)]
    params = {path: [torch.nn.Parameter(torch.randn(s)) for s in shapes] for path in ("plain", "switched")}
    for i in range(len(shapes)):
        params["switched"][i].data.copy_(params["plain"][i].data)
    opts = {path: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False) for path, ps in params.items()}
    _use_fused_adam(SimpleNamespace(optimizer=opts["switched"]))  # as Megatron-Core's wrapper holds it
    assert opts["switched"].param_groups[0]["foreach"] and not opts["plain"].param_groups[0]["foreach"]
    for _ in range(5):
        grads = [torch.randn(s) for s in shapes]
        for path, opt in opts.items():
            for p, g in zip(params[path], grads):
                p.grad = g.clone()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params["plain"], params["switched"]))
    assert not torch.equal(params["plain"][0], params["plain"][0].new_zeros(shapes[0]))


def _decays(name: str, p: torch.Tensor) -> bool:
    return p.dim() > 1 and not name.endswith(".bias")


def adamw(log, lrs, wd, b1, b2, eps, mode="decoupled", decay_all=False):
    """Hand-written Adam in float64 from the observed gradients: the weights each step should produce, from the
    weights it started from. mode: "decoupled" (AdamW), "l2" (decay added to the gradient) or "none"; decay_all:
    decay the 1-D weights too."""
    m, v, out = {}, {}, []
    for t, (entry, lr) in enumerate(zip(log, lrs), 1):
        new = {}
        for name, p0 in entry["before"].items():
            p = p0.double()
            w = wd if ((decay_all or _decays(name, p0)) and mode != "none") else 0.0
            g = entry["grads"][name].double() + (w * p if mode == "l2" else 0.0)
            m[name] = b1 * m.get(name, 0.0) + (1 - b1) * g
            v[name] = b2 * v.get(name, 0.0) + (1 - b2) * g * g
            m_hat, v_hat = m[name] / (1 - b1 ** t), v[name] / (1 - b2 ** t)
            decay = 1 - lr * w if mode == "decoupled" else 1.0
            new[name] = p * decay - lr * m_hat / (v_hat.sqrt() + eps)
        out.append(new)
    return out


def _worst(after: dict, expected: dict, before: dict) -> float:
    """The largest error in units of the tolerance: a few float32 roundings of the weight plus 1e-8."""
    return max(((after[n].double() - expected[n]).abs() / (4e-7 * before[n].double().abs() + 1e-8)).max().item()
               for n in expected)


def test_steps_are_adamw_with_the_configured_betas_eps_and_decoupled_weight_decay(rl_run):
    steps = 3
    log, after = rl_run["log"][:steps], rl_run["after"][:steps]
    names = list(log[0]["before"])
    assert any(_decays(n, log[0]["before"][n]) for n in names) and not all(_decays(n, log[0]["before"][n])
                                                                           for n in names)
    for k in range(1, steps):  # each step starts from the previous one's weights
        assert all(torch.equal(log[k]["before"][n], after[k - 1][n]) for n in names)
    # Distinct batches per step, so the gradients differ and the betas show (with equal gradients m_hat = g and
    # v_hat = g^2 whatever the betas).
    g1, g2 = log[0]["grads"], log[1]["grads"]
    assert max((g1[n] - g2[n]).abs().max().item() for n in names) > 1e-3

    # Step 1 runs at lr 0: no weight moves (not even by weight decay), yet it counts in Adam's moments.
    assert all(torch.equal(after[0][n], log[0]["before"][n]) for n in names)
    lrs = [rl_lr(k) for k in range(1, steps + 1)]
    want = adamw(log, lrs, wd=0.1, b1=0.8, b2=0.9, eps=1e-4)
    for k in range(steps):
        assert _worst(after[k], want[k], log[k]["before"]) < 1.0, f"step {k + 1}"
        moved = max((after[k][n].double() - log[k]["before"][n].double()).abs().max().item() for n in names)
        assert moved == 0.0 if k == 0 else moved > 0.5 * lrs[k]

    # The check can fail: Adam with any other reading of the options misses the observed weights by far.
    others = {"betas 0.9/0.999": adamw(log, lrs, 0.1, 0.9, 0.999, 1e-4),
              "beta1 only": adamw(log, lrs, 0.1, 0.9, 0.9, 1e-4),
              "beta2 only": adamw(log, lrs, 0.1, 0.8, 0.999, 1e-4),
              "eps 1e-8": adamw(log, lrs, 0.1, 0.8, 0.9, 1e-8),
              "no weight decay": adamw(log, lrs, 0.1, 0.8, 0.9, 1e-4, mode="none"),
              "L2 weight decay": adamw(log, lrs, 0.1, 0.8, 0.9, 1e-4, mode="l2"),
              "weight decay on the norm weights too": adamw(log, lrs, 0.1, 0.8, 0.9, 1e-4, decay_all=True),
              "lr one step early": adamw(log, [rl_lr(k + 1) for k in range(1, steps + 1)], 0.1, 0.8, 0.9, 1e-4)}
    for what, alt in others.items():
        assert max(_worst(after[k], alt[k], log[k]["before"]) for k in range(steps)) > 50, what
    # Weight decay alone: a 2-D weight that never had a gradient (an embedding row of a token neither batch holds:
    # Adam's moments are 0) shrinks by exactly the factor (1 - lr wd) of step 2.
    emb = next(n for n in names if n.endswith("word_embeddings.weight"))
    unused = ((log[0]["grads"][emb] == 0).all(dim=1) & (log[1]["grads"][emb] == 0).all(dim=1)
              & (log[1]["before"][emb] != 0).all(dim=1))  # (not a zero padding row of the vocabulary)
    assert unused.any()
    ratio = after[1][emb][unused].double() / log[1]["before"][emb][unused].double()
    assert ratio.sub(1 - lrs[1] * 0.1).abs().max().item() < 1e-6


def test_max_nonfinite_steps_stops_after_that_many_non_finite_steps_in_a_row(rl_run):
    # trainer.max_nonfinite_steps=2: NaN (skipped), finite (resets the count), NaN (skipped), NaN -> stop.
    assert rl_run["nonfinite_seq"] == [(True, True, 1), (False, False, 1), (True, True, 2)]
    assert rl_run["nonfinite_unchanged"] == [True, True]  # a skipped step moves no weight
    assert rl_run["nonfinite_optimizer_steps"] == 1  # only the finite step reached the optimizer
    assert rl_run["nonfinite_error"] is not None and "trainer.max_nonfinite_steps=2" in rl_run["nonfinite_error"]
    assert rl_run["nonfinite_in_a_row"] == 2


def test_warm_start_runs_at_sft_lr_then_rl_at_trainer_lr():
    sft_steps, sft_lr = 12, 0.02
    out = run_local(warm_start_worker, 1, [f"trainer.sft_warmup_steps={sft_steps}", f"trainer.sft_lr={sft_lr}",
                                           "trainer.lr=0.003", "trainer.lr_warmup_steps=5", "trainer.tp=1",
                                           "trainer.dtype=fp32", "trainer.attention=sdpa"])[0]
    total = max(sft_steps, SFT_MIN_DECAY_STEPS)

    def lr(n):  # the scheduler's rate after n steps: linear from 0, then cosine down to sft_lr / 10
        if n <= SFT_LR_WARMUP_STEPS:
            return sft_lr * n / SFT_LR_WARMUP_STEPS
        ratio = (n - SFT_LR_WARMUP_STEPS) / (total - SFT_LR_WARMUP_STEPS)
        return sft_lr / 10 + (sft_lr - sft_lr / 10) * 0.5 * (1 + math.cos(math.pi * ratio))

    assert len(out["warm_lrs"]) == sft_steps
    for k, lrs in enumerate(out["warm_lrs"], 1):
        assert lrs == pytest.approx([lr(k - 1)] * len(lrs), rel=1e-12, abs=0), k
    assert out["warm_lrs"][-1][0] == pytest.approx(0.011)  # halfway down the cosine to sft_lr / 10 = 0.002
    # RL then warms up afresh over trainer.lr_warmup_steps = 5 (its first step at 0, as any Megatron warm-up) to
    # trainer.lr, and stays there.
    for k, lrs in enumerate(out["rl_lrs"]):
        assert lrs == pytest.approx([0.003 * min(k, 5) / 5] * len(lrs), rel=1e-12, abs=0), k


# ---- data.eval_path ----------------------------------------------------------------------------------------------
def _write(path, prefix, n):
    path.write_text("".join(json.dumps({"q": f"{prefix}{i}?", "a": str(i)}) + "\n" for i in range(n)))


@pytest.mark.parametrize("eval_size,held", [(3, 3), (64, 5)])
def test_eval_path_holds_out_the_eval_file_and_trains_on_all_of_the_train_file(tmp_path, eval_size, held):
    train, heldout = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    _write(train, "train-", 12)
    _write(heldout, "eval-", 5)
    base = ["data.dataset=jsonl", f"data.path={train}", "data.prompt_field=q", "data.answer_field=a",
            f"data.eval_size={eval_size}", "reward.kind=synthetic"]
    task = build_task(load_config(None, base + [f"data.eval_path={heldout}"]), ByteTokenizer(), with_reward=False)
    assert [(r.prompt, r.reference) for r in task.eval_records()] == [(f"eval-{i}?", str(i)) for i in range(held)]
    assert sorted(r.prompt for r in task.train) == sorted(f"train-{i}?" for i in range(12))
    drawn = {r.prompt for k in range(6) for r in task.train_batch(k, 4)}
    assert drawn == {f"train-{i}?" for i in range(12)}  # training draws only train records, all of them
    if eval_size < 12:  # without data.eval_path the held-out problems come out of the train file
        one_file = build_task(load_config(None, base), ByteTokenizer(), with_reward=False)
        assert [r.prompt for r in one_file.eval_records()] == [f"train-{i}?" for i in range(eval_size)]


def test_a_missing_eval_path_is_an_error_naming_the_file(tmp_path):
    train = tmp_path / "train.jsonl"
    _write(train, "train-", 12)
    cfg = load_config(None, ["data.dataset=jsonl", f"data.path={train}", "data.prompt_field=q",
                             "data.answer_field=a", f"data.eval_path={tmp_path / 'nope.jsonl'}",
                             "reward.kind=synthetic"])
    with pytest.raises(DataError, match="nope.jsonl: no such file"):
        build_task(cfg, ByteTokenizer(), with_reward=False)


def test_a_guarded_step_that_the_guard_lets_be_is_the_optimizers_own_step_bit_for_bit(tmp_path):
    """The step guard measures the gradient norm before the update and finishes the step itself with that norm
    (`TrainEngine._step_measured`), instead of letting Megatron-Core's `optimizer.step` prepare and measure the
    gradients again: where it neither skips nor scales, the weights after 4 steps are bit-equal to those of an
    engine without the guard, with clipping on every step and with none, on DP2 (the distributed optimizer's
    shards: the norm is reduced over them)."""
    from options_workers import measured_step_worker

    path = tmp_path / "full.pt"
    torch.save(random_full_state(seed=3), path)
    ranks = run_local(measured_step_worker, 2, [*RL_OPTIONS, "trainer.tp=1", "trainer.dp=2"], str(path), 4)
    for out in ranks:
        for clip in (0.05, 1e6):
            (norms, guarded), (own_norms, own) = out[(clip, 5.0)], out[(clip, 0.0)]
            assert norms == own_norms and (min(norms) > clip) == (clip < 1)  # the small clip acts on every step
            assert guarded.keys() == own.keys() and all(torch.equal(guarded[n], own[n]) for n in own), clip


def test_the_step_guard_clips_a_planted_gradient_spike_skips_a_gap_spike_and_stops_at_max_guarded_steps(rl_run):
    g = rl_run["guard"]
    assert g["taken"] == [0.0] * len(g["taken"])  # no step is guarded before its history exists
    # The norm the guard measured before the update is the one each step reports (and clipped its gradient with).
    assert g["history_norms"] == pytest.approx(g["reported_norms"], rel=1e-6)
    median = sorted(g["history_norms"])[len(g["history_norms"]) // 2 - 1:len(g["history_norms"]) // 2 + 1]
    median = sum(median) / 2
    # A gradient 1000x its history's: taken, with the gradient the optimizer sees scaled to 5x the median.
    spike = g["spike"]
    assert spike["guarded"] == 1.0 and spike["skipped"] is False and spike["optimizer_steps"] == 1
    assert spike["reason"].startswith("the gradient norm (grad_norm ") and "trainer.spike_factor=5" in spike["reason"]
    assert spike["reason"].endswith(f"; its gradient scaled to {5 * median:.4g} (taken)")
    ratio = float(spike["reason"].split(" is ")[1].split("x")[0])
    assert 500 < ratio < 2000  # the planted 1000x, against the median of the history
    assert spike["seen_norm"] == pytest.approx(5 * median, rel=1e-4)
    assert spike["norm_joined"] == pytest.approx(5 * median, rel=1e-12)  # the clipped norm joins the history
    # A gap of 0.5 nats (125x the history's): skipped, the next normal step taken at half the scheduler's rate (the
    # scheduler's own rate left as it was).
    assert g["gap_skip"]["skipped"] is True and g["gap_skip"]["unchanged"] and g["gap_skip"]["optimizer_steps"] == 0
    assert g["gap_skip"]["reason"].endswith("; skipped, the next steps at 0.5x the learning rate")
    guarded, scale, used, scheduled, after = g["after_gap"]
    assert guarded == 0.0 and scale == 0.5 and used == pytest.approx([0.5 * r for r in scheduled], rel=1e-12)
    assert after == scheduled == pytest.approx([0.01] * len(scheduled))
    # More gaps: skipped, halving again; at 3 halvings net (the step taken restored 2^0.1 of one) the guard stops the
    # run (trainer.max_guarded_steps=3).
    assert g["gaps"] == [1.0, 1.0]
    assert g["collapse"].startswith("the collapse guard skipped 4 RL steps (3 in a row) and halved the step size to "
                                    "1/15 of the learning rate (limit trainer.max_guarded_steps=3 halvings)")
    assert "trainer-generator log-prob gap (logp_diff_mean 0.5)" in g["collapse"]
    assert g["restored"] == g["saved"] and g["saved"][:3] == (0, 1, pytest.approx(0.5 * 2 ** 0.1))


def test_a_guarded_step_is_one_line_and_a_collapse_names_the_checkpoint_to_resume_from():
    from megatron_rl.controller.executors import TrainerExecutor
    from megatron_rl.training.guard import CollapseError

    lines: list = []
    ex = TrainerExecutor.__new__(TrainerExecutor)  # the step's reporting alone, around a stand-in RL step
    ex.echo, ex.last_checkpoint = lines.append, lambda: "step_00000350"
    ex.rl = SimpleNamespace(step=lambda batch: {"loss": 0.1, "skipped": True, "guarded": 1.0, "guard_reason": "why"})
    metrics = ex.step(None, 55)
    assert lines == ["megatron-rl: warning: step 55, collapse guard: why"]
    assert "guard_reason" not in metrics and metrics["guarded"] == 1.0  # the row keeps numbers only
    ex.rl = SimpleNamespace(step=lambda batch: {"loss": 0.1, "skipped": False, "guarded": 0.0})
    ex.step(None, 56)
    assert len(lines) == 1  # a step taken prints nothing

    def collapsing(batch):
        raise CollapseError("5 RL steps in a row were skipped by the collapse guard")

    ex.rl = SimpleNamespace(step=collapsing)
    with pytest.raises(CollapseError, match=r"in a row were skipped .*; the last checkpoint, step_00000350, holds "
                                            r"the weights before it: resume from it with a lower trainer.lr$"):
        ex.step(None, 57)
    ex.last_checkpoint = lambda: None
    with pytest.raises(CollapseError, match="no checkpoint was saved before it$"):
        ex.step(None, 57)

"""Jobs beyond the built-in task: datasets (GSM8K, MATH-500, JSONL), initial weights from a checkpoint or a HF
model, the model's own tokenizer and a user reward function; and the built-in task's demonstrations."""

import json
import os
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config, validate
from megatron_rl.controller.tasks import AdditionTask, DatasetTask, build_task
from megatron_rl.data import PromptRecord, ResumableSampler
from megatron_rl.tokenizers import ByteTokenizer
import warm_cli

REPO = Path(__file__).resolve().parents[1]


# ---- the built-in task's demonstrations --------------------------------------------------------------------------
def test_careless_demonstrations_are_right_at_the_given_rate_and_off_by_one_otherwise():
    task = AdditionTask(eval_size=64, seed=3, demo_accuracy=0.4)
    demos = [d for i in range(50) for d in task.demonstrations(i, 32)]
    errors = [int(answer) - eval(prompt[:-1]) for prompt, answer in demos]
    assert set(errors) <= {-1, 0, 1} and all(int(a) >= 0 for _, a in demos)
    right = errors.count(0) / len(errors)
    assert abs(right - 0.4) < 0.03, right  # 1,600 draws: 3 standard deviations is 0.037
    assert task.demonstrations(7, 32) == task.demonstrations(7, 32)  # a pure function of the index
    exact = AdditionTask(eval_size=64, seed=3)
    assert all(int(a) == eval(p[:-1]) for p, a in exact.demonstrations(0, 64))
    held = {r.prompt for r in task.eval_records()}
    assert not held & {p for p, _ in demos}


# ---- dataset tasks -----------------------------------------------------------------------------------------------
def _records(n, prefix="q"):
    return [PromptRecord(id=f"{prefix}{i}", prompt=f"{prefix} {i}" + " x" * (i % 7), reference=str(i)) for i in range(n)]


class _Exact:
    def score(self, items):
        return [1.0 if resp.strip() == ref else 0.0 for _, resp, ref, *_ in items]

    def close(self):
        pass


class _Counting(ByteTokenizer):
    """The byte tokenizer, counting the texts it encodes."""

    encoded = 0

    def encode_batch(self, texts, add_bos=False):
        self.encoded += len(texts)
        return super().encode_batch(texts, add_bos)


def test_dataset_batches_are_pure_epochs_measured_as_drawn_and_long_prompts_are_left_out():
    train = _records(30)
    long = PromptRecord(id="long", prompt="y" * 100, reference="0")
    records = train[:4] + [long] + train[4:]

    def make():
        task = DatasetTask(records, _records(3, "e"), "plain", _Counting(), _Exact(), chat=False,
                           max_prompt_tokens=40, seed=1)
        task.MEASURE_CHUNK = 4
        return task

    def epoch(e):  # the reference: the seeded order of every record, the long one left out
        return [records[j].id for j in ResumableSampler(31, seed=1).epoch_order(e) if records[j] is not long]

    task = make()
    assert task.tok.encoded == 3 and task.skipped == {"train": 0, "eval": 0}  # the held-out prompts only
    batches = [task.train_batch(0, 4)]
    assert task.tok.encoded - 3 <= 8  # the first batch measured a chunk or two of the 31 training prompts
    batches += [task.train_batch(k, 4) for k in range(1, 15)]  # 60 items = two epochs of 30
    assert task.tok.encoded - 3 == 31 and task.skipped == {"train": 1, "eval": 0}  # each prompt measured once
    ids = [r.id for b in batches for r in b]
    assert ids == epoch(0) + epoch(1) and ids[:30] != ids[30:]
    assert [r.id for r in make().train_batch(9, 4)] == ids[36:40]  # a resumed run's first batch, in epoch 1
    assert task.score(train[:2], [" 0", "7"]) == [1.0, 0.0]
    assert task.prompt_text(train[1]) == "q 1 x"


def test_gsm8k_trains_on_train_and_holds_out_test_through_the_chat_template(shared_data):

    class Chat(ByteTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=True):
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    class Tok(Chat):
        has_chat_template = True

    cfg = load_config(None, ["data.dataset=gsm8k", "data.eval_size=5", "rollout.max_prompt_length=2000"])
    task = build_task(cfg, Tok())
    test_lines = (shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()
    test_questions = [json.loads(line)["question"] for line in test_lines[:5]]
    assert [r.prompt for r in task.eval_records()] == test_questions
    assert len(task.train) == 7473 and task.eval_records()[0].reference == "18"
    text = task.prompt_text(task.eval_records()[0])
    assert text.startswith("<user>Solve the following") and "####" in text and text.endswith("<assistant>")
    assert task.score(task.eval_records()[:2], ["so #### 18", "#### 4"]) == [1.0, 0.0]


def test_one_file_holds_out_its_first_records(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"q": f"{i}+1=", "a": str(i + 1)}) + "\n" for i in range(12)))
    cfg = load_config(None, ["data.dataset=jsonl", f"data.path={f}", "data.prompt_field=q", "data.answer_field=a",
                             "data.eval_size=4", "reward.kind=synthetic"])
    task = build_task(cfg, ByteTokenizer())
    assert [r.prompt for r in task.eval_records()] == ["0+1=", "1+1=", "2+1=", "3+1="]
    assert sorted(r.prompt for r in task.train) == sorted(f"{i}+1=" for i in range(4, 12))
    assert task.score(task.eval_records()[:2], ["1", "5"]) == [1.0, 0.0]


@pytest.mark.parametrize("overrides,message", [
    (["data.dataset=gsm8k"], r"trainer.sft_warmup_steps=1500: the supervised warm start needs demonstrations"),
    (["data.dataset=squad", "trainer.sft_warmup_steps=0"],
     r"unknown dataset 'squad'; expected one of synthetic-arithmetic, gsm8k"),
    (["data.dataset=jsonl", "trainer.sft_warmup_steps=0"], r"data.dataset='jsonl' needs data.path"),
    (["data.dataset=jsonl", "data.path=x.jsonl", "trainer.sft_warmup_steps=0"],
     r"reward.kind='auto' cannot choose a verifier for dataset 'jsonl'"),
    (["reward.kind=reward-model"], r"reward.model must be set"),
    (["reward.kind=reward-model", "reward.model=/nonexistent"], r"'/nonexistent' is not a Hugging Face model directory"),
    (["reward.kind=gsm8k"], r"the built-in synthetic task has its own exact-match reward"),
    (["model.checkpoint=/nonexistent/ckpt"], r"model.checkpoint='/nonexistent/ckpt' does not exist"),
    (["data.eval_samples=0"], r"data.eval_samples=0 must be >= 1"),
])
def test_jobs_that_cannot_run_fail_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, overrides), 3)


# ---- a job from a HF model, on a JSONL dataset, scored by a user function ---------------------------------------
def _weights(ckpt_model_dir):
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(str(ckpt_model_dir), f"{d}/m.pt")
        sd = torch.load(f"{d}/m.pt", weights_only=False)
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def test_job_starts_from_a_hf_model_with_its_tokenizer_and_a_user_reward(tmp_path):
    pytest.importorskip("transformers")
    import torch
    from tiny_hf import WORDS, save_tiny_llama, save_word_tokenizer

    hf = tmp_path / "hf"
    save_tiny_llama(hf, vocab_size=16)
    save_word_tokenizer(hf)
    data = tmp_path / "words.jsonl"
    data.write_text("".join(json.dumps({"question": " ".join(WORDS[i % 5: i % 5 + 3])}) + "\n" for i in range(20)))
    args = [f"model.checkpoint={hf}", "data.dataset=jsonl", f"data.path={data}",
            "data.answer_field=null", "data.eval_size=4", "data.eval_samples=2", "reward.kind=function",
            "reward.function=reward_fns:says_mat", "trainer.sft_warmup_steps=0", "trainer.tp=2", "generator.tp=1",
            "trainer.dtype=fp32",  # the step-0 checkpoint must equal the converted weights exactly
            "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4",
            "run.eval_interval=1", "checkpoint.save_interval=2", f"checkpoint.dir={tmp_path}", "run.name=w"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}

    def train(steps):
        return warm_cli.run(["train", *args, f"run.steps={steps}"], cwd=REPO, env=env)

    out = train(2)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "w"
    assert "converting" in out.stderr and (run / "initial_model" / "megatron_rl.json").is_file()
    # The trainer started from the HF weights: the checkpoint written before the first step holds them exactly
    # (written at trainer TP=2, converted at TP=1: the vocabulary is padded to 256 and 128 rows; 16 are real).
    start, initial = _weights(run / "step_00000000" / "model"), _weights(run / "initial_model" / "model")
    assert start.keys() == initial.keys() and len(start) >= 9
    for k in start:
        real = slice(0, 16) if k.startswith(("embedding", "output_layer")) else slice(None)
        assert torch.equal(start[k][real], initial[k][real]), k
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    words = set(WORDS)
    for r in rows:  # the model's own tokenizer decoded the responses; the user function scored them
        assert all(set(t.split()) <= words for t in r["samples"])
        assert all(0.0 <= r["reward"] <= 1.0 for r in rows) and 0.0 <= r["eval/reward"] <= 1.0
    from megatron_rl.checkpointing.tokenizer import load_checkpoint_tokenizer

    tok = load_checkpoint_tokenizer(run)  # the run's latest checkpoint carries the tokenizer
    assert (run / "step_00000002" / "tokenizer").is_dir() and tok.encode("cat mat") == [4, 8]

    again = train(3)  # resumes from step 2; the initial model is not converted again
    assert again.returncode == 0, again.stderr[-3000:]
    assert "converting" not in again.stderr and "resumed from" in again.stderr
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_smollm2_job_on_gsm8k_prompts_through_its_chat_template(smollm2, tmp_path):
    """The real model from a converted checkpoint: GSM8K train prompts in its chat template, its tokenizer's stop
    ids, the GSM8K verifier; the generator (weights from DDMA) and the trainer agree on every log-prob."""
    from megatron_rl.controller.train import RANK_MODULES, rank_preload
    from megatron_rl.tokenizers import HF_TOKENIZER_MODULES

    ckpt = smollm2[0]
    # the local launcher's fork server imports transformers' tokenizer modules for such a job, once for its ranks
    assert rank_preload(load_config(None, [f"model.checkpoint={ckpt}"])) == RANK_MODULES + HF_TOKENIZER_MODULES
    assert rank_preload(load_config(None, [])) == RANK_MODULES  # the byte tokenizer
    out = warm_cli.run(["train", f"model.checkpoint={ckpt}", "data.dataset=gsm8k", "data.eval_size=1",
                        "data.eval_samples=1", "trainer.tp=1", "trainer.sft_warmup_steps=0", "trainer.lr=1e-6",
                        "rollout.mode=sync", "trainer.dtype=fp32", "generator.dtype=fp32",  # agreement to fp32 rounding
                        "rollout.prompts_per_step=1", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
                        "rollout.max_prompt_length=320", "run.steps=1", "run.eval_interval=1",
                        "checkpoint.save_interval=0", "checkpoint.save_final=false", f"checkpoint.dir={tmp_path}",
                        "run.name=s"],
                       timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0]
    assert not list((tmp_path / "s").glob("step_*"))  # checkpoint.save_final=false: the 2.1 GB save is skipped
    for r in rows:
        assert r["skipped"] == 0.0 and abs(r["is_weight_mean"] - 1) < 1e-4 and abs(r["kl_mu_pi"]) < 1e-4
        assert r["logp_diff_max"] < 1e-3  # every token, not only on average
        assert 1 <= r["response_length"] <= 12 and all(isinstance(t, str) for t in r["samples"])
    # English from the model's own tokenizer, not byte soup: the responses decode to words.
    text = " ".join(t for r in rows for t in r["samples"])
    assert sum(w.isalpha() for w in text.split()) >= 4, text

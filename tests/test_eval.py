"""`megatron-rl eval`: SmolLM2-135M-Instruct converted to a Megatron checkpoint, greedy on GSM8K, against
transformers' greedy generation of the same prompts scored with the same verifier; one-line errors."""

import json

import pytest
import torch

from megatron_rl.cli import main
from megatron_rl.data import GSM8K_INSTRUCTION, MATH_INSTRUCTION, default_data_dir
from megatron_rl.evaluation import EvalError, resolve_checkpoint
from megatron_rl.evaluation.eval import build_prompts, load_problems
from megatron_rl.rewards import gsm8k_reward

transformers = pytest.importorskip("transformers")

DATA = default_data_dir()
LIMIT, NEW = 3, 16  # a partial batch of 2 + 1; 16 greedy tokens after prompts of 83-123


def _reference(hf, tok, limit, new):
    """transformers' greedy generation of GSM8K's first problems, prompts built here with the HF tokenizer."""
    rows = [json.loads(line) for line in (DATA / "gsm8k" / "test.jsonl").read_text().splitlines()[:limit]]
    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 cores shared with other processes: one thread is faster
    try:
        for row in rows:
            messages = [{"role": "user", "content": GSM8K_INSTRUCTION.replace("{question}", row["question"])}]
            prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = torch.tensor([tok(prompt, add_special_tokens=False).input_ids])
            with torch.no_grad():
                gen = hf.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.eos_token_id)
            text = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
            reference = row["answer"].split("####")[-1].strip().replace(",", "")
            out.append({"prompt": prompt, "output": text, "score": gsm8k_reward(text, reference)})
    finally:
        torch.set_num_threads(threads)
    return out


def test_eval_matches_transformers_greedy_on_gsm8k(smollm2, tmp_path, capsys):
    ckpt, hf, tok, _ = smollm2
    samples = tmp_path / "samples.jsonl"
    # no --tokenizer: eval reads the one the conversion recorded in the checkpoint
    rc = main(["eval", str(ckpt), "--dataset", "gsm8k", "--limit", str(LIMIT), "--max-new-tokens", str(NEW),
               "--batch-size", "2", "--samples-out", str(samples)])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    lines = out.out.strip().splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert set(summary) == {"dataset", "checkpoint", "dtype", "n", "correct", "accuracy", "time_s", "tokens_per_s"}
    assert summary["dtype"] == "float32"  # the converted checkpoint's own
    assert summary["dataset"] == "gsm8k" and summary["checkpoint"] == str(ckpt) and summary["n"] == LIMIT
    assert summary["tokens_per_s"] > 0 and summary["time_s"] > 0
    got = [json.loads(line) for line in samples.read_text().splitlines()]
    want = _reference(hf, tok, LIMIT, NEW)
    assert [g["prompt"] for g in got] == [w["prompt"] for w in want]
    assert [g["output"] for g in got] == [w["output"] for w in want]
    assert [g["score"] for g in got] == [w["score"] for w in want]
    assert summary["correct"] == sum(w["score"] == 1.0 for w in want)
    assert summary["accuracy"] == pytest.approx(summary["correct"] / LIMIT)


def test_eval_errors_are_one_line(smollm2, tmp_path, capsys):
    smollm2_ckpt = smollm2[0]
    def run(*args):
        rc = main(["eval", *map(str, args)])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1, err
        return err

    assert "does not exist" in run(tmp_path / "nope")
    assert "not a megatron-rl checkpoint" in run(tmp_path)
    assert "unknown dataset 'mmlu'; expected one of gsm8k, math500" in run(smollm2_ckpt, "--dataset", "mmlu")
    err = run(smollm2_ckpt, "--data-dir", tmp_path / "empty")
    assert "GSM8K test split not found at" in err and "--data-dir" in err
    err = run(smollm2_ckpt, "--dataset", "math500", "--data-dir", tmp_path / "empty")
    assert "MATH-500 not found at" in err
    assert "--tp=2 does not divide the model's num_attention_heads=9" in run(smollm2_ckpt, "--tp", "2")
    assert "--pp=4 does not divide the model's num_layers=30" in run(smollm2_ckpt, "--pp", "4")
    assert "--tokenizer" in run(smollm2_ckpt, "--tokenizer", tmp_path / "missing.gguf")
    assert "--dtype 'fp16' is not one of fp32, bf16, auto" in run(smollm2_ckpt, "--dtype", "fp16")
    # A checkpoint that records no tokenizer, evaluated without --tokenizer.
    bare = tmp_path / "bare"
    (bare / "model").mkdir(parents=True)
    meta = json.loads((smollm2_ckpt / "megatron_rl.json").read_text())
    for key in ("tokenizer", "files", "checksums"):  # (no manifest: its files are not what this checks)
        meta.pop(key, None)
    (bare / "megatron_rl.json").write_text(json.dumps(meta))
    assert "tokenizer" in run(bare, "--limit", "1")


def test_eval_at_tp2_and_pp2_equals_tp1(shared_data, tmp_path, capsys):
    """A small random Llama with the byte tokenizer: `--tp 2` and `--pp 2` decode what `--tp 1` decodes."""
    from megatron_rl.checkpointing.convert import convert

    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ckpt", to="megatron")
    samples = {}
    layouts = ((1, 1), (2, 1), (1, 2))
    for tp, pp in layouts:
        samples[tp, pp] = tmp_path / f"tp{tp}pp{pp}.jsonl"
        assert main(["eval", str(tmp_path / "ckpt"), "--tokenizer", "byte", "--no-chat", "--limit", "2",
                     "--max-new-tokens", "6", "--tp", str(tp), "--pp", str(pp),
                     "--samples-out", str(samples[tp, pp])]) == 0
        assert json.loads(capsys.readouterr().out)["n"] == 2
    rows = {k: [json.loads(line) for line in samples[k].read_text().splitlines()] for k in layouts}
    assert rows[1, 1] == rows[2, 1] == rows[1, 2] and all(r["new_tokens"] == 6 for r in rows[1, 1])
    assert rows[1, 1][0]["prompt"].startswith("Solve the following math problem")  # --no-chat: the bare instruction
    # --dtype bf16 on the fp32 checkpoint runs the model that converting to bf16 gives, in that checkpoint's own dtype.
    convert(tmp_path / "hf", tmp_path / "ckpt-bf16", to="megatron", dtype="bfloat16")
    for name, ckpt, extra in (("cast", "ckpt", ["--dtype", "bf16"]), ("stored", "ckpt-bf16", [])):
        assert main(["eval", str(tmp_path / ckpt), "--tokenizer", "byte", "--no-chat", "--limit", "2",
                     "--max-new-tokens", "6", "--samples-out", str(tmp_path / f"{name}.jsonl"), *extra]) == 0
        assert json.loads(capsys.readouterr().out)["dtype"] == "bfloat16"
    cast, stored = ([json.loads(line) for line in (tmp_path / f"{n}.jsonl").read_text().splitlines()]
                    for n in ("cast", "stored"))
    assert cast == stored


def test_checkpoint_root_resolves_through_latest(tmp_path):
    step = tmp_path / "run" / "step_00000007"
    (step / "model").mkdir(parents=True)
    (step / "megatron_rl.json").write_text("{}")
    (tmp_path / "run" / "latest").write_text("step_00000007\n")
    assert resolve_checkpoint(tmp_path / "run") == step
    assert resolve_checkpoint(step) == step
    (tmp_path / "run" / "latest").write_text("step_00000009\n")
    with pytest.raises(EvalError, match="names step_00000009, which does not exist"):
        resolve_checkpoint(tmp_path / "run")
    from megatron_rl.evaluation.eval import checkpoint_tokenizer
    from megatron_rl.tokenizers import ByteTokenizer

    (step / "megatron_rl.json").write_text(json.dumps({"tokenizer": {"type": "byte"}}))
    assert isinstance(checkpoint_tokenizer(step), ByteTokenizer)


def test_prompts_carry_each_datasets_instruction(shared_data):
    from megatron_rl.tokenizers import ByteTokenizer

    math = load_problems("math500", limit=2)
    assert len(math) == 2 and all(r.reference for r in math)
    plain = build_prompts(math, ByteTokenizer(), "math", chat=False)
    assert plain[0] == MATH_INSTRUCTION.replace("{question}", math[0].prompt)
    chat = build_prompts(math, ByteTokenizer(), "math", chat=True)
    assert chat[0].startswith("user: ") and chat[0].endswith("assistant: ")
    gsm = load_problems("gsm8k", str(shared_data), limit=1)
    assert gsm[0].reference == "18"


@pytest.mark.parametrize("pp", [1, 2])
def test_eval_plays_episodes_as_transformers_replaying_each_whole_conversation_does(tmp_path, capsys, pp):
    """`--dataset guess-number` (its own environment) on a small random Llama with the byte tokenizer: each greedy
    episode (the generator keeping its cache between turns, each observation prefilled alone; one stage, or two
    pipelined) equals transformers' greedy decoding of the whole conversation at every turn, with the game stepped
    here; returns and turns too."""
    from megatron_rl.checkpointing.convert import convert
    from megatron_rl.environments import GuessNumber
    from megatron_rl.environments.play import TurnTemplate
    from megatron_rl.tokenizers import load_tokenizer

    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ckpt", to="megatron")
    turns, new = 3, 4
    assert main(["eval", str(tmp_path / "ckpt"), "--dataset", "guess", "--tokenizer", "byte", "--limit", "3",
                 "--max-new-tokens", str(new), "--max-turns", str(turns), "--max-tokens", "64",
                 "--samples-out", str(tmp_path / "s.jsonl"), "--pp", str(pp)]) == 0
    summary = json.loads(capsys.readouterr().out)
    rows = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    tok = load_tokenizer("byte")
    template = TurnTemplate(tok, chat=False)
    for rec, row in zip(load_problems("guess-number", limit=3), rows):
        env = GuessNumber(rec.as_dict(), 0)
        prompt = template.prompt({"role": "user", "content": env.reset()})
        ids, ret, played = list(prompt), 0.0, 0
        while played < turns:
            reply = []
            with torch.no_grad():
                while len(reply) < new and (not reply or reply[-1] not in tok.stop_ids):
                    reply.append(int(hf(torch.tensor([ids + reply])).logits[0, -1].argmax()))
            ids, played = ids + reply, played + 1
            message, reward, done = env.step(tok.decode([t for t in reply if t not in tok.stop_ids]))
            ret += reward
            if done:
                break
            if played < turns:
                ids += template.observation({"role": "user", "content": message})
        assert (row["output"], row["return"], row["turns"]) == (tok.decode(ids[len(prompt):]), ret, played)
    assert summary["n"] == 3 and summary["correct"] == sum(r["return"] >= 1 for r in rows)
    assert summary["turns_per_episode"] == sum(r["turns"] for r in rows) / 3 > 1
    if pp == 1:  # the same game played by an agent through the checkpoint's endpoint: the same episodes
        pytest.importorskip("openai")
        assert main(["eval", str(tmp_path / "ckpt"), "--dataset", "guess", "--tokenizer", "byte", "--limit", "3",
                     "--max-new-tokens", str(new), "--max-turns", str(turns), "--max-tokens", "64",
                     "--samples-out", str(tmp_path / "a.jsonl"), "--agent", "megatron_rl.agents.guess:play"]) == 0
        agent = json.loads(capsys.readouterr().out)
        assert agent["agent"] == "megatron_rl.agents.guess:play" and "env" not in agent
        same = ("n", "correct", "mean_return", "turns_per_episode", "env_failures")
        assert {k: agent[k] for k in same} == {k: summary[k] for k in same}
        keep = ("output", "return", "turns")
        assert [{k: json.loads(line)[k] for k in keep} for line in (tmp_path / "a.jsonl").read_text().splitlines()] \
            == [{k: r[k] for k in keep} for r in rows]

"""Prompt data: JSONL with a field mapping and clear errors, the GSM8K and MATH-500 loaders against the shared files,
chat prompts, the synthetic arithmetic task (curriculum, held-out split) and the resumable sharded sampler."""

import json
from pathlib import Path

import pytest

from megatron_rl.data import (ChatPromptBuilder, DataError, JsonlPromptDataset, PromptRecord,
                              ResumableSampler, UnknownDatasetError, default_data_dir, load_gsm8k, load_math500,
                              load_prompt_dataset, registry, resolve_dataset)
from megatron_rl.tokenizers.byte import ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


def _write(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


# ---- records and JSONL ------------------------------------------------------------------------------------------


def test_prompt_record_validates_chat_messages():
    r = PromptRecord("a", [{"role": "user", "content": "hi"}], "1")
    assert r.is_chat and not PromptRecord("b", "hi").is_chat
    with pytest.raises(DataError, match="chat message 0"):
        PromptRecord("c", [{"role": "user"}])
    with pytest.raises(DataError, match="non-empty list"):
        PromptRecord("d", [])


def test_jsonl_field_mapping(tmp_path):
    f = _write(tmp_path / "mine.jsonl", [
        {"q": "What is 2+2?", "sol": {"final": 4}, "uid": "x1", "topic": "add"},
        "",  # blank lines are skipped
        {"q": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+3?"}],
         "sol": {"final": "6"}, "uid": "x2", "topic": "add"},
    ])
    ds = JsonlPromptDataset(f, prompt_field="q", answer_field="sol.final", id_field="uid")
    assert len(ds) == 2
    # Metadata keeps the other top-level fields (a dotted answer path leaves its parent object in place).
    assert ds[0] == PromptRecord("x1", "What is 2+2?", "4", {"sol": {"final": 4}, "topic": "add", "source": f"{f}:1"})
    assert ds[1].is_chat and ds[1].reference == "6" and ds[1].metadata["source"] == f"{f}:3"
    no_answers = JsonlPromptDataset(f, prompt_field="q", answer_field=None)
    assert no_answers[0].reference is None and no_answers[0].id == "mine/1"


@pytest.mark.parametrize("lines,pattern", [
    ([{"question": "a", "answer": "1"}, '{"question": "b", "answer": '], r"bad\.jsonl:2: invalid JSON"),
    ([{"question": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}],
     r"bad\.jsonl:2: no prompt field 'question' \(the row has: answer, prompt\)"),
    ([{"question": "a"}], r"bad\.jsonl:1: no answer field 'answer' \(the row has: question\)"),
    ([[1, 2]], r"bad\.jsonl:1: expected a JSON object, got list"),
    ([{"question": "  ", "answer": "1"}], r"bad\.jsonl:1: the prompt field 'question' is empty"),
    ([{"question": "a", "answer": [1]}], r"bad\.jsonl:1: field 'answer': expected a string or a number"),
    ([{"question": [{"role": "user"}], "answer": "1"}], r"bad\.jsonl:1: field 'question': chat message 0"),
    (["", ""], r"bad\.jsonl: no records"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, lines, pattern):
    f = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError, match=pattern) as e:
        JsonlPromptDataset(f, prompt_field="question", answer_field="answer")
    assert "\n" not in str(e.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_gsm8k(path=tmp_path / "missing.jsonl")


# ---- GSM8K and MATH-500 -------------------------------------------------------------------------------------------


def test_default_data_dir_is_the_shared_folder_beside_the_repo(monkeypatch):
    monkeypatch.delenv("MEGATRON_RL_DATA_DIR", raising=False)
    assert default_data_dir() == DATA


def test_megatron_rl_data_dir_moves_every_default_file(tmp_path, monkeypatch):
    """A cluster keeps its data elsewhere: the variable moves the default files of train jobs, of config
    validation and of `eval` together, and the errors name it."""
    from megatron_rl.config import ConfigError, load_config, validate
    from megatron_rl.data.datasets import dataset_files
    from megatron_rl.evaluation.eval import EvalError, load_problems

    monkeypatch.setenv("MEGATRON_RL_DATA_DIR", str(tmp_path))
    assert default_data_dir() == tmp_path
    assert dataset_files("gsm8k") == (tmp_path / "gsm8k" / "train.jsonl", tmp_path / "gsm8k" / "test.jsonl")
    with pytest.raises(EvalError, match="MEGATRON_RL_DATA_DIR"):
        load_problems("gsm8k")
    cfg = load_config(None, ["data.dataset=gsm8k", "trainer.sft_warmup_steps=0"])
    with pytest.raises(ConfigError, match=r"set data.path, or MEGATRON_RL_DATA_DIR to the folder holding gsm8k/train"):
        validate(cfg)
    (tmp_path / "gsm8k").mkdir()
    for split in ("train", "test"):
        (tmp_path / "gsm8k" / f"{split}.jsonl").write_text(
            json.dumps({"question": f"{split}: 2 + 3?", "answer": "5 #### 5"}) + "\n")
    assert [r.prompt for r in load_problems("gsm8k")] == ["test: 2 + 3?"]
    validate(cfg)


def test_gsm8k_loader_matches_the_file(shared_data):
    lines = (shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()
    raw = [json.loads(line) for line in lines if line.strip()]
    ds = load_gsm8k("test")
    assert len(ds) == len(raw) == 1319
    for record, row in zip(ds, raw):
        assert record.prompt == row["question"]
        assert record.reference == row["answer"].split("#### ")[1].replace(",", "")
        assert record.metadata["solution"] == row["answer"]
    assert ds[0].reference == "18"  # Janet's ducks: 16 - 3 - 4 = 9 eggs at $2
    assert "," not in "".join(r.reference for r in ds) and {"-10", "-3"} <= {r.reference for r in ds}
    assert len({r.id for r in ds}) == len(ds)
    assert len(load_gsm8k("train", limit=10)) == 10
    with pytest.raises(ValueError, match="split 'dev'"):
        load_gsm8k("dev")


def test_gsm8k_loader_from_a_user_path(tmp_path):
    f = _write(tmp_path / "g.jsonl", [{"question": "q1", "answer": "1 + 1 = 2\n#### 1,234"},
                                      {"question": "q2", "answer": "no final line"}])
    with pytest.raises(DataError, match=r"g\.jsonl:2: field 'answer': a GSM8K answer must end with '#### <number>'"):
        load_gsm8k(path=f)
    ds = load_gsm8k(path=f, limit=1)
    assert ds[0].reference == "1234"


def test_math500_loader_matches_the_file(shared_data):
    lines = (shared_data / "math500" / "test.jsonl").read_text().splitlines()
    raw = [json.loads(line) for line in lines if line.strip()]
    ds = load_math500()
    assert len(ds) == 500
    for record, row in zip(ds, raw):
        assert (record.id, record.prompt, record.reference) == (row["unique_id"], row["problem"], row["answer"])
        assert record.metadata["subject"] == row["subject"] and record.metadata["level"] == row["level"]
    assert ds[0].reference == r"\left( 3, \frac{\pi}{2} \right)"


def test_load_prompt_dataset_by_name(shared_data, tmp_path):
    assert len(load_prompt_dataset("math-500", limit=3)) == 3
    assert load_prompt_dataset("gsm8k", limit=2)[1].reference == load_gsm8k(limit=2)[1].reference
    f = _write(tmp_path / "p.jsonl", [{"prompt": "hi", "target": "1"}])
    assert load_prompt_dataset("jsonl", path=f, prompt_field="prompt", answer_field="target")[0].reference == "1"
    with pytest.raises(ValueError, match="needs a path"):
        load_prompt_dataset("jsonl")
    with pytest.raises(ValueError, match="synthetic task"):
        load_prompt_dataset("synthetic-arithmetic")
    with pytest.raises(ValueError, match="synthetic task"):
        load_prompt_dataset("word-problems")
    with pytest.raises(ValueError, match="unknown dataset 'gsm9k'"):
        load_prompt_dataset("gsm9k")


# ---- the dataset registry -----------------------------------------------------------------------------------------
def test_registry_resolves_names_and_aliases_in_any_case():
    assert [resolve_dataset(n).name for n in ("GSM8K", "gsm8k-test", " math ", "MATH-500", "arithmetic")] == [
        "gsm8k", "gsm8k", "math500", "math500", "synthetic-arithmetic"]
    with pytest.raises(UnknownDatasetError, match=r"unknown dataset 'gsm9k' \(did you mean 'gsm8k'\?\); expected "
                                                  r"one of synthetic-arithmetic, gsm8k, math500, jsonl, word-problems"):
        resolve_dataset("gsm9k")
    assert resolve_dataset("Math-500", among=("gsm8k", "math500")).name == "math500"
    with pytest.raises(UnknownDatasetError, match=r"unknown dataset 'jsonl'; expected one of gsm8k, math500$"):
        resolve_dataset("jsonl", among=("gsm8k", "math500"))


def test_train_eval_and_rewards_read_one_table(shared_data):
    from megatron_rl.controller.tasks import dataset_key as train_key
    from megatron_rl.evaluation.eval import dataset_key as eval_key
    from megatron_rl.rewards import REWARD_KINDS, kind_for_dataset

    for spec in registry.DATASETS.values():
        assert spec.verifier is None or spec.verifier in REWARD_KINDS
        for name in (spec.name, *spec.aliases):
            assert train_key(name) == (None if spec.name == registry.SYNTHETIC else spec.name)
            if spec.verifier:
                assert kind_for_dataset(name) == spec.verifier
            if spec.test_file:  # what eval scores, it names as training does
                assert eval_key(name) == spec.name
                assert (shared_data / spec.test_file).is_file()
    with pytest.raises(ValueError, match="cannot choose a verifier for dataset 'jsonl'"):
        kind_for_dataset("jsonl")


# ---- chat prompts -------------------------------------------------------------------------------------------------


class RecordingTokenizer:
    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, add_generation_prompt=True):
        self.calls.append((messages, add_generation_prompt))
        return "<chat>"


def test_chat_prompt_builder_with_the_byte_tokenizer():
    builder = ChatPromptBuilder("Solve: {question} Put the final answer after ####.")
    record = PromptRecord("1", "What is 2+3?", "5")
    # ByteTokenizer uses the base class's plain template: "role: content\n" per message, then "assistant: ".
    assert builder.build(record, ByteTokenizer()) == \
        "user: Solve: What is 2+3? Put the final answer after ####.\nassistant: "
    with_system = ChatPromptBuilder("{question}", system="Be brief.")
    assert with_system.build("2+3?", ByteTokenizer()) == "system: Be brief.\nuser: 2+3?\nassistant: "
    assert with_system.build("2+3?") == "Be brief.\n\n2+3?"  # no tokenizer: plain text for base models


def test_chat_prompt_builder_messages_and_templates():
    tok = RecordingTokenizer()
    math = ChatPromptBuilder.for_task("math")
    assert math.build(PromptRecord("1", "Find $x$ if {x} = 2."), tok) == "<chat>"
    (messages, gen), = tok.calls
    assert gen is True and messages[0]["role"] == "user"
    # The problem's own braces survive and the template's \boxed{} needs no escaping.
    assert messages[0]["content"].endswith("Find $x$ if {x} = 2.") and "\\boxed{}" in messages[0]["content"]
    chat = PromptRecord("2", [{"role": "user", "content": "hi"}])
    assert ChatPromptBuilder("Q: {question}", system="S").messages(chat) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="must contain '{question}'"):
        ChatPromptBuilder("Solve the problem.")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        ChatPromptBuilder().build(chat)
    with pytest.raises(ValueError, match="no instruction for task 'physics'"):
        ChatPromptBuilder.for_task("physics")


def test_sampler_epochs_are_seeded_permutations():
    s = ResumableSampler(10, seed=1)
    e0, e1 = s.next_indices(10), s.next_indices(10)
    assert sorted(e0) == sorted(e1) == list(range(10)) and e0 != e1 and s.epoch == 1
    assert ResumableSampler(10, seed=1).next_indices(20) == e0 + e1
    assert ResumableSampler(10, seed=2).next_indices(10) != e0
    assert ResumableSampler(10, shuffle=False).next_indices(12) == list(range(10)) + [0, 1]


def test_sampler_shards_over_ranks():
    ranks = [ResumableSampler(12, seed=5, rank=r, world_size=3) for r in range(3)]
    shards = [s.next_indices(4) for s in ranks]
    assert sorted(sum(shards, [])) == list(range(12))  # one epoch, split without overlap
    assert all(len(s) == 4 for s in ranks)
    # 10 items over 4 ranks: padded to 12 by repeating items, every rank gets 3.
    padded = [ResumableSampler(10, seed=5, rank=r, world_size=4) for r in range(4)]
    taken = sum((s.next_indices(3) for s in padded), [])
    assert set(taken) == set(range(10)) and len(taken) == 12
    dropped = [ResumableSampler(10, seed=5, rank=r, world_size=4, drop_last=True) for r in range(4)]
    taken = sum((s.next_indices(2) for s in dropped), [])
    assert len(set(taken)) == 8
    with pytest.raises(ValueError, match="rank=4"):
        ResumableSampler(10, rank=4, world_size=4)


def test_sampler_resume_continues_exactly():
    full = ResumableSampler(7, seed=3, rank=1, world_size=2)
    expected = full.next_indices(25)
    first = ResumableSampler(7, seed=3, rank=1, world_size=2)
    head = first.next_indices(11)
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints store it as plain data
    resumed = ResumableSampler(7, seed=3, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert head + resumed.next_indices(14) == expected
    with pytest.raises(ValueError, match="num_items=7 but this sampler has num_items=8"):
        ResumableSampler(8, seed=3).load_state_dict(state)


def test_sampler_resume_on_a_different_world_size():
    two = [ResumableSampler(12, seed=9, rank=r, world_size=2) for r in range(2)]
    for s in two:
        s.next_indices(3)  # 6 global items consumed
    three = [ResumableSampler(12, seed=9, rank=r, world_size=3) for r in range(3)]
    for s in three:
        s.load_state_dict(two[0].state_dict())
    rest = sum((s.next_indices(2) for s in three), [])
    order = ResumableSampler(12, seed=9, shuffle=True).epoch_order(0)
    assert sorted(rest) == sorted(order[6:])  # the new ranks take exactly the rest of the epoch

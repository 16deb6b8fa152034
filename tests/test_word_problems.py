"""Generated word problems: answers right (re-read from the text), splits disjoint and fixed, the job's task."""

import re

import pytest

from megatron_rl.data.word_problems import WordProblems

_GAIN = re.compile(r"(buys|finds|gets|gives \w+) (\d+)")
_LOSS = re.compile(r"(gives|loses|uses|sells) (\d+)")


def _solve(text: str) -> int:
    """An independent reading of a problem: the starting quantity, then each sentence's change."""
    sentences = [s for s in text.split(". ") if s]
    x = int(re.search(r"has (\d+)", sentences[0]).group(1))
    for s in sentences[1:]:
        if s.startswith("How many"):
            break
        if re.search(r"friend gives \w+ (\d+)", s):
            x += int(re.search(r"friend gives \w+ (\d+)", s).group(1))
        elif _LOSS.search(s):
            x -= int(_LOSS.search(s).group(2))
        else:
            x += int(_GAIN.search(s).group(2))
    return x


def test_answers_match_an_independent_reading_and_stay_non_negative():
    wp = WordProblems(max_steps=3)
    for rec in wp.records("train", 300) + wp.records("eval", 100):
        assert int(rec.reference) == _solve(rec.prompt), rec.prompt
        assert int(rec.reference) >= 1


def test_splits_are_disjoint_deterministic_and_sized():
    wp = WordProblems()
    train, heldout = wp.records("train", 2000), wp.records("eval", 100)
    assert len({r.prompt for r in train}) == 2000 and len(heldout) == 100
    assert not {r.prompt for r in train} & {r.prompt for r in heldout}
    assert [r.prompt for r in WordProblems().records("eval", 100)] == [r.prompt for r in heldout]
    assert [r.prompt for r in WordProblems(seed=1).records("eval", 100)] != [r.prompt for r in heldout]
    assert {len(r.prompt.split(". ")) - 2 for r in train} == {1}  # one change by default
    two = WordProblems(max_steps=2).records("train", 200)
    assert {len(r.prompt.split(". ")) - 2 for r in two} == {1, 2}


def test_bad_settings_and_a_too_small_space_are_refused():
    with pytest.raises(ValueError, match="min_steps"):
        WordProblems(min_steps=3, max_steps=2)
    with pytest.raises(ValueError, match="too small"):
        WordProblems(min_steps=1, max_steps=1, max_number=2).records("eval", 1_000)  # 223 held out in all


def test_the_job_task_uses_them_with_the_number_verifier():
    from megatron_rl.config import load_config
    from megatron_rl.controller.tasks import build_task
    from megatron_rl.tokenizers import ByteTokenizer

    cfg = load_config(None, ["data.dataset=word-problems", "trainer.sft_warmup_steps=0", "data.eval_size=8",
                             "rollout.max_prompt_length=200", "reward.num_workers=1"])
    task = build_task(cfg, ByteTokenizer())
    try:
        rec = task.eval_records()[0]
        assert task.prompt_text(rec).endswith("Answer with a single number.")
        right, wrong = f"So the answer is {rec.reference}.", f"#### {int(rec.reference) + 1}"
        assert task.score([rec, rec], [right, wrong]) == [1.0, 0.0]
        assert {r.prompt for r in task.train_batch(0, 16)}.isdisjoint({r.prompt for r in task.eval_records()})
    finally:
        task.close()

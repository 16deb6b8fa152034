"""Reward functions: GSM8K and MATH verifiers against the shared data files and hand-written cases, user functions
in worker processes (hangs, crashes, exceptions score 0 and are logged), and the registry.

The module-level functions below are reward functions and checkers that the worker processes import by name
("test_rewards:<name>"), so keep this module cheap to import.
"""

import json
import logging
import os
import time

import pytest

from megatron_rl.rewards import (FunctionReward, GSM8KReward, MathReward, SyntheticReward,
                                 extract_gsm8k_answer, get_reward_fn, gsm8k_reward, last_boxed, leading_integer,
                                 normalize_answer, synthetic_reward)
from megatron_rl.sandbox import SpecError


# ---- functions run inside worker processes ------------------------------------------------------------------------


def length_reward(prompt, response, reference):
    return float(len(response))


def quarter_reward(prompt, response, reference):
    return 0.25


def pid_reward(prompt, response, reference):
    return float(os.getpid())


def misbehaving_reward(prompt, response, reference):
    """Does what the response says."""
    if response == "hang":
        time.sleep(600)
    if response == "crash":
        os._exit(3)
    if response == "raise":
        raise RuntimeError("boom")
    if response == "exit":
        raise SystemExit(2)
    if response == "nan":
        return float("nan")
    if response == "text":
        return "1.0"
    if response == "none":
        return None
    return 1.0 if response == reference else 0.0


def hanging_checker(pred, ref):
    """A stand-in MATH equivalence checker: never returns for the answer "hang" (like a sympy blow-up), accepts
    anything else at once (so the test does not depend on how fast sympy imports under a 1 s limit)."""
    if pred == "hang":
        time.sleep(600)
    return True


def _rows(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---- GSM8K --------------------------------------------------------------------------------------------------------


def test_every_gsm8k_test_answer_scores_one_and_off_by_one_scores_zero(shared_data):
    rows = _rows(shared_data / "gsm8k" / "test.jsonl")
    assert len(rows) == 1319
    fn = GSM8KReward()
    items, expected = [], []
    for row in rows:
        final = row["answer"].split("#### ")[-1].strip()  # as written in the dataset, e.g. "1,600" or "-10"
        n = int(final.replace(",", ""))
        for ref in (final, final.replace(",", ""), row["answer"]):  # raw, loader-style, and full solution
            items.append(("q", f"Let me think step by step... The answer is #### {final}", ref))
            expected.append(1.0)
            items.append(("q", f"... The answer is #### {n}", ref))
            expected.append(1.0)
            items.append(("q", f"... The answer is #### {n + 1}", ref))
            expected.append(0.0)
        # The dataset's own worked solution, given as a response, is right.
        items.append(("q", row["answer"], final))
        expected.append(1.0)
    assert fn.score(items) == expected


@pytest.mark.parametrize("response,reference,expected", [
    ("The answer is #### 1,000", "1000", 1.0),
    ("#### $1,000.00.", "1000", 1.0),
    ("#### 1000 dollars", "1,000", 1.0),
    ("She pays 3 * 6 = $18.", "18", 1.0),
    ("So the total is \\boxed{18}", "18", 1.0),
    ("So the total is \\boxed{\\$18.00}.", "18", 1.0),
    ("#### -10", "-10", 1.0),
    ("The temperature drops to -10 degrees", "-10", 1.0),
    ("#### 10", "-10", 0.0),
    ("#### 3/4", "0.75", 1.0),
    ("#### 0.75", "3/4", 1.0),
    ("#### \\frac{3}{4}", "0.75", 1.0),
    ("The answer is 18. That was problem 2.", "18", 1.0),
    ("#### 18\nCheck: 20 - 2 = 18 eggs, 2 left over", "18", 1.0),
    ("There were 5 apples, then 7 more.", "5", 0.0),
    ("10-3=7", "7", 1.0),
    ("I do not know.", "7", 0.0),
    ("#### 17", "18", 0.0),
    ("#### 1,000", "100", 0.0),
    ("18.5", "18", 0.0),
    ("The cost is 1,000.00", "1000", 1.0),
    ("#### 1600", "She earns 2 * 800 = <<2*800=1600>>1600.\n#### 1,600", 1.0),
    ("\u2212 the answer is \u221212", "-12", 1.0),
])
def test_gsm8k_hand_cases(response, reference, expected):
    assert gsm8k_reward(response, reference) == expected


def test_gsm8k_extraction_prefers_hashes_then_boxed():
    assert extract_gsm8k_answer("\\boxed{5} ... #### 6 ... 7") == 6
    assert extract_gsm8k_answer("first 4, \\boxed{5}, then 7") == 5
    assert extract_gsm8k_answer("nothing numeric") is None


# ---- MATH: boxed extraction and normalisation ---------------------------------------------------------------------


def test_last_boxed_balances_braces():
    assert last_boxed(r"a \boxed{\frac{1}{2}} b \boxed{x^{2}} c") == "x^{2}"
    assert last_boxed(r"so $\boxed{\left( 3, \frac{\pi}{2} \right)}$.") == r"\left( 3, \frac{\pi}{2} \right)"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"$\boxed 5$") == "5"
    assert last_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"
    assert last_boxed(r"\boxed{a} and then \boxed{b") == "a"  # an unclosed box is not an answer
    assert last_boxed("no box here") is None


@pytest.mark.parametrize("raw,expected", [
    (r"\left( 3, \frac{\pi}{2} \right)", r"( 3, \frac{\pi}{2} )"),
    (r"\dfrac{14}{3}", r"\frac{14}{3}"),
    (r"\frac12", r"\frac{1}{2}"),
    (r"\frac 59", r"\frac{5}{9}"),
    (r"\frac9{19}", r"\frac{9}{19}"),
    (r"11\sqrt2", r"11\sqrt{2}"),
    (r"90^\circ", "90"),
    (r"90^{\circ}", "90"),
    (r"\text{Evelyn}", "Evelyn"),
    (r"10,\!080", "10080"),
    (r"11,\! 111,\! 111,\! 100", "11111111100"),
    (r"\$32,\!348", "32348"),
    ("58,500", "58500"),
    ("1,-2", "1,-2"),
    (r"5.4 \text{ cents}", "5.4"),
    (r"864 \mbox{ inches}^2", "864"),
    (r"\frac{270}7\text{ degrees}", r"\frac{270}{7}"),
    (r"x \in [-2,7]", "[-2,7]"),
    ("x=5", "5"),
    ("5x - 7y + 11z + 4 = 0", "5x - 7y + 11z + 4 = 0"),
    (".0000672", "0.0000672"),
    (r"\text{(B)}", "B"),
    ("2516_8", "2516"),
    ("50\\%", "50"),
    ("7.", "7"),
])
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


# ---- MATH: equivalence on real MATH-500 answers -------------------------------------------------------------------

# answer as it appears in math500/test.jsonl -> equivalent forms a model might write
EQUIVALENT = {
    r"\frac{14}{3}": [r"14/3", r"\dfrac{14}{3}", r"\frac{28}{6}", r"4\frac{2}{3}", r"\tfrac{14}{3}"],
    r"3\sqrt{13}": [r"\sqrt{117}", r"3 \sqrt{13}", r"\sqrt{13}\cdot 3"],
    r"\left( 3, \frac{\pi}{2} \right)": [r"(3,\pi/2)", r"(3, \frac{\pi}2)", r"\left(3,\dfrac{\pi}{2}\right)"],
    r"90^\circ": ["90", r"90^{\circ}", "90\u00b0"],
    r"\text{Evelyn}": ["Evelyn", r"\textbf{Evelyn}", "evelyn"],
    r"10,\!080": ["10080", "10,080"],
    r"1 \pm \sqrt{19}": [r"1+\sqrt{19}, 1-\sqrt{19}", r"1-\sqrt{19},1+\sqrt{19}", r"1\pm\sqrt{19}"],
    r"(-\infty, 2) \cup (3, \infty)": [r"(3,\infty)\cup(-\infty,2)", r"\left(-\infty,2\right)\cup\left(3,\infty\right)"],
    r"\begin{pmatrix} -1/3 \\ 2/3 \\ 5/3 \end{pmatrix}": [
        r"\begin{pmatrix} -\frac{1}{3} \\ \frac{2}{3} \\ \frac{5}{3} \end{pmatrix}"],
    r"5x - 7y + 11z + 4 = 0": [r"-5x + 7y - 11z - 4 = 0", r"5x-7y+11z=-4", r"10x - 14y + 22z + 8 = 0"],
    r"x^5 - x^4 + x^3 - x^2 + x - 1": [r"(x-1)(x^4+x^2+1)", r"-1 + x - x^2 + x^3 - x^4 + x^5"],
    r"(a+5)(b+2)": ["ab+2a+5b+10", "(b+2)(a+5)"],
    "0.15": [r"\frac{3}{20}", "3/20", ".15", "0.150"],
    r"\$18.90": ["18.9", r"\$18.90", "18.90 dollars"],
    "6 - 5i": ["-5i+6", "6-5i"],
    r"\frac{\sqrt{3}}{3}": [r"\frac{1}{\sqrt{3}}", r"\frac{\sqrt3}{3}", r"\sqrt{3}/3"],
    r"1\frac{4}{5}": [r"\frac{9}{5}", "1.8", "9/5"],
    "y = 2x + 3": ["2x+3", "y=3+2x"],
    r"\text{(C)}": ["C", "(C)", r"\text{C}"],
    r"x \in [-2,7]": ["[-2, 7]", r"\left[-2,7\right]"],
    ".0000672": ["0.0000672", r"6.72\times 10^{-5}"],
    "2516_8": ["2516_{8}", "2516"],
    r"-\frac{\pi}{6}": [r"-\pi/6", r"\frac{-\pi}{6}"],
    r"\{1\pm\sqrt{5},-2\}": [r"-2, 1+\sqrt{5}, 1-\sqrt{5}", r"\{1-\sqrt5, -2, 1+\sqrt5\}"],
    r"864 \mbox{ inches}^2": ["864", r"864 \text{ square inches}"],
    r"12\pi": [r"12 \pi", r"\pi \cdot 12"],
    r"11\sqrt2": [r"11\sqrt{2}", r"\sqrt{242}"],
    r"\frac{270}7\text{ degrees}": [r"\frac{270}{7}", "270/7"],
    r"\cot x": [r"\frac{\cos x}{\sin x}"],
    "-2,1": ["1,-2", "x=1, x=-2"],
    r"\left[ \frac{\pi^2}{8}, \frac{5 \pi^2}{4} \right]": [r"[\pi^2/8, 5\pi^2/4]"],
}

NOT_EQUIVALENT = {
    r"\frac{14}{3}": [r"\frac{3}{14}", "14/4", "4.67"],
    r"3\sqrt{13}": [r"\sqrt{39}", r"13\sqrt{3}"],
    r"\left( 3, \frac{\pi}{2} \right)": [r"(\frac{\pi}{2}, 3)", r"(3, \pi)"],
    r"90^\circ": ["180", "-90"],
    r"\text{Evelyn}": ["Navin"],
    r"1 \pm \sqrt{19}": [r"1+\sqrt{19}"],
    r"(-\infty, 2) \cup (3, \infty)": [r"(-\infty, 2] \cup (3, \infty)", r"(-\infty, 3)"],
    "(3,4]": ["(3,4)", "[3,4]"],
    r"5x - 7y + 11z + 4 = 0": [r"5x - 7y + 11z - 4 = 0"],
    r"(a+5)(b+2)": ["(a+2)(b+5)"],
    r"\text{(C)}": ["B"],
    "6 - 5i": ["6+5i"],
    "0.15": ["0.16", r"\frac{3}{2}"],
    r"x^5 - x^4 + x^3 - x^2 + x - 1": [r"x^5 + x^4 + x^3 + x^2 + x + 1"],
    "-2,1": ["-2", "(-2,1)"],
    r"\begin{pmatrix} -1/3 \\ 2/3 \\ 5/3 \end{pmatrix}": [r"\begin{pmatrix} 1/3 \\ 2/3 \\ 5/3 \end{pmatrix}"],
}


@pytest.fixture(scope="module")
def math_reward():
    fn = MathReward(timeout_s=20.0, num_workers=2)
    yield fn
    fn.close()


def test_hand_cases_use_real_math500_answers(shared_data):
    answers = {row["answer"] for row in _rows(shared_data / "math500" / "test.jsonl")}
    assert set(EQUIVALENT) <= answers and set(NOT_EQUIVALENT) <= answers
    assert len(EQUIVALENT) >= 15


def _respond(answer: str) -> str:
    # An earlier wrong box, then the final one: only the last box counts.
    return f"First try: $\\boxed{{0}}$. On reflection the answer is $\\boxed{{{answer}}}$."


def test_math_equivalent_forms_score_one(math_reward):
    items = [("", _respond(form), ref) for ref, forms in EQUIVALENT.items() for form in forms]
    scores = math_reward.score(items)
    wrong = [(it[2], last_boxed(it[1])) for it, s in zip(items, scores) if s != 1.0]
    assert not wrong


def test_math_wrong_answers_score_zero(math_reward):
    items = [("", _respond(form), ref) for ref, forms in NOT_EQUIVALENT.items() for form in forms]
    items += [("", "The answer is 14/3.", r"\frac{14}{3}"),  # no box: not an answer for MATH
              ("", r"\boxed{}", r"\frac{14}{3}"),
              ("", r"\boxed{10^{10^{10}}}", "1")]  # must not try to build a 10-billion-digit number
    scores = math_reward.score(items)
    accepted = [(it[2], last_boxed(it[1])) for it, s in zip(items, scores) if s != 0.0]
    assert not accepted


def test_math500_solutions_match_their_answers(shared_data, math_reward):
    """The measured rate on MATH-500: the boxed answer of each reference solution against the answer field."""
    rows = _rows(shared_data / "math500" / "test.jsonl")
    scores = math_reward.score([(r["problem"], r["solution"], r["answer"]) for r in rows])
    assert len(scores) == 500 and sum(scores) == 500
    # A full solution as the reference works too (its last box is the answer).
    assert math_reward.score([("", _respond(rows[0]["answer"]), rows[0]["solution"])]) == [1.0]


def test_latex_to_sympy_converter():
    import sympy
    from megatron_rl.rewards.symbolic import LatexParseError, expressions_equal, to_sympy

    x, a, b = sympy.symbols("x a b")
    assert to_sympy(r"\frac{1}{2}") == sympy.Rational(1, 2)
    assert to_sympy("x^23") == 3 * x ** 2  # TeX: the superscript is one token
    assert to_sympy(r"1\frac{4}{5}") == sympy.Rational(9, 5)  # mixed number
    assert to_sympy(r"2\frac{\pi}{3}") == 2 * sympy.pi / 3  # not a mixed number: a product
    assert to_sympy(r"\sqrt[3]{27}") == 3
    assert to_sympy("0.15") == sympy.Rational(3, 20)  # decimals are exact
    assert sympy.expand(to_sympy("(a+5)(b+2)") - (a * b + 2 * a + 5 * b + 10)) == 0
    assert to_sympy("-2 + 7i") == -2 + 7 * sympy.I
    assert to_sympy(r"\log_2 8") == 3
    assert to_sympy("|-3|") == 3
    assert to_sympy("5!") == 120
    assert expressions_equal(to_sympy(r"\sin^2 x + \cos^2 x"), sympy.Integer(1))
    with pytest.raises(LatexParseError):
        to_sympy(r"\foo{3}")
    with pytest.raises(LatexParseError):
        to_sympy("10^{10^{10}}")


def test_math_checker_hang_is_cut_off_and_logged(caplog):
    caplog.set_level(logging.WARNING)
    fn = MathReward(timeout_s=1.0, checker="test_rewards:hanging_checker")
    try:
        t0 = time.monotonic()
        scores = fn.score([("", r"\boxed{hang}", "5"), ("", r"\boxed{\sqrt{117}}", r"3\sqrt{13}")])
        elapsed = time.monotonic() - t0
        assert scores == [0.0, 1.0]
        assert elapsed < 15  # worker start-up and restart included; the hang itself is cut at 1 s
        assert any("timed out after 1 s" in r.getMessage() for r in caplog.records)
        assert fn.score([("", r"\boxed{x}", "y")]) == [1.0]  # the replaced worker serves the next batch
    finally:
        fn.close()


def test_math_without_symbolic_stage_starts_no_process():
    fn = MathReward(symbolic=False)
    assert fn.score([("", r"\boxed{\dfrac{14}{3}}", r"\frac{14}{3}"), ("", r"\boxed{0.15}", r"\frac{3}{20}"),
                     ("", r"\boxed{\sqrt{117}}", r"3\sqrt{13}")]) == [1.0, 1.0, 0.0]
    assert fn._pool is None


# ---- user functions in workers ------------------------------------------------------------------------------------


def test_user_function_misbehaviour_scores_zero_and_is_logged(caplog):
    caplog.set_level(logging.WARNING)
    fn = FunctionReward("test_rewards:misbehaving_reward", timeout_s=1.0, num_workers=2)
    try:
        responses = ["ok", "hang", "ok", "raise", "crash", "nan", "text", "none", "exit", "ok", "bad"]
        t0 = time.monotonic()
        scores = fn.score([("p", r, "ok") for r in responses])
        assert time.monotonic() - t0 < 15
        assert scores == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        messages = " | ".join(r.getMessage() for r in caplog.records)
        for needle in ("timed out after 1 s", "RuntimeError: boom", "worker died (exit code 3)", "SystemExit",
                       "not a finite number"):
            assert needle in messages
        assert fn.stats["timeouts"] == 1 and fn.stats["crashes"] == 1 and fn.stats["restarts"] == 2
        # The pool was repaired: the run goes on.
        assert fn.score([("p", "ok", "ok"), ("p", "x", "ok")]) == [1.0, 0.0]
    finally:
        fn.close()


def test_user_function_pool_uses_all_workers():
    with FunctionReward("test_rewards:pid_reward", num_workers=2) as fn:
        pids = set(fn.score([("p", "r", None)] * 6))
        assert len(pids) == 2 and os.getpid() not in pids


def test_user_function_from_a_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def score(prompt, response, reference):\n    return 0.5 if reference in response else -1\n")
    with get_reward_fn("function", function=f"{path}:score", timeout_s=5.0) as fn:
        assert fn.score([("p", "the answer is 4", "4"), ("p", "no", "4")]) == [0.5, -1.0]
        assert fn("p", "4", "4") == 0.5


@pytest.mark.parametrize("spec,message", [
    ("no_such_module_xyz:f", "no module named 'no_such_module_xyz'"),
    ("test_rewards:no_such_function", "has no attribute 'no_such_function'"),
    ("os:sep", "is not callable"),
    ("just_a_name", "must look like 'module:function'"),
    ("/nonexistent/reward.py:f", "not found"),
])
def test_bad_reward_function_fails_fast_with_one_line(spec, message):
    with pytest.raises(SpecError) as e:
        FunctionReward(spec)
    assert message in str(e.value) and "\n" not in str(e.value)


# ---- synthetic task reward and the registry -----------------------------------------------------------------------


@pytest.mark.parametrize("response,reference,expected", [
    ("19", "19", 1.0), (" 19\n7+1=8", "19", 1.0), ("19<eos>garbage", "19", 1.0), ("190", "19", 0.0),
    ("1 9", "19", 0.0), ("-3", "-3", 1.0), ("3", "-3", 0.0), ("", "3", 0.0), ("abc 19", "19", 0.0),
])
def test_synthetic_reward(response, reference, expected):
    assert synthetic_reward(response, reference) == expected
    assert SyntheticReward()("12+7=", response, reference) == expected


def test_leading_integer():
    assert leading_integer("  42 and more") == 42 and leading_integer("x42") is None


def test_registry():
    assert isinstance(get_reward_fn("auto", dataset="gsm8k"), GSM8KReward)
    assert isinstance(get_reward_fn("auto", dataset="math500"), MathReward)
    assert isinstance(get_reward_fn("auto", dataset="synthetic-arithmetic"), SyntheticReward)
    assert isinstance(get_reward_fn("synthetic"), SyntheticReward)
    assert get_reward_fn("gsm8k")("q", "#### 4", "4") == 1.0
    with pytest.raises(ValueError, match=r"did you mean 'gsm8k'"):
        get_reward_fn("gsm8")
    with pytest.raises(ValueError, match="cannot choose a verifier for dataset 'my-data'"):
        get_reward_fn("auto", dataset="my-data")
    with pytest.raises(ValueError, match="needs function='module:function'"):
        get_reward_fn("function")
    with pytest.raises(ValueError, match="use kind 'function'"):
        get_reward_fn("gsm8k", function="m:f")
    with pytest.raises(ValueError, match="needs model=DIR"):
        get_reward_fn("reward-model")
    with get_reward_fn("function", function="test_rewards:length_reward") as fn:
        assert fn.score([("p", "abc", None), ("p", "", None)]) == [3.0, 0.0]


def _tiny_reward_model(d, num_labels=1):
    """A random transformers LlamaForSequenceClassification with the tests' word tokenizer, saved into `d`."""
    import torch
    import transformers
    from tiny_hf import save_word_tokenizer

    cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=num_labels,
                                   pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(cfg).eval()
    model.save_pretrained(d, safe_serialization=True)
    save_word_tokenizer(d)
    return model


def test_reward_model_scores_batches_as_one_text_at_a_time(tmp_path):
    """Right-padded batches give each text the score the model gives it alone (read at its last real token)."""
    pytest.importorskip("transformers")
    import torch
    import transformers

    model = _tiny_reward_model(tmp_path / "rm")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "rm")
    items = [("the cat ", "sat", None), ("a mat ", "and the cat ran on a mat", None), ("the ", "", None),
             ("cat ", "ran ran", None)]
    want = []
    for prompt, response, _ in items:
        ids = tok(prompt + response, return_tensors="pt")
        with torch.no_grad():
            want.append(float(model(**ids).logits[0, 0]))
    rm = get_reward_fn("reward-model", model=str(tmp_path / "rm"))
    rm.batch_size = 3  # two batches, padded differently
    got = rm.score(items)
    assert len(set(round(w, 6) for w in want)) == len(want)  # the texts score differently
    assert got == pytest.approx(want, abs=1e-5)
    _tiny_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(ValueError, match="has 2 outputs; a reward model has one"):
        get_reward_fn("reward-model", model=str(tmp_path / "two"))
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        get_reward_fn("reward-model", model=str(tmp_path))


# ---- a reward function that hangs or fails on every call ----------------------------------------------------------


def test_a_hanging_function_costs_a_batch_its_batch_timeout_not_one_timeout_per_response(caplog):
    caplog.set_level(logging.WARNING)
    with FunctionReward("reward_fns:sleeps_forever", timeout_s=1.0, num_workers=2, batch_timeout_s=2.0) as fn:
        t0 = time.monotonic()
        assert fn.score([("p", str(i), None) for i in range(12)]) == [0.0] * 12
        elapsed = time.monotonic() - t0
        assert elapsed < 6, elapsed  # 12 responses x 1 s one after another on 2 workers would be 6 s and more
        assert fn.failures == 12 and fn.failing_batches == 1
        messages = " | ".join(r.getMessage() for r in caplog.records)
        assert "timed out after 1 s" in messages and "batch timed out after 2 s" in messages


def test_a_function_failing_on_most_responses_stops_after_three_batches_in_a_row():
    from megatron_rl.rewards.function import MAX_FAILING_BATCHES, RewardFailureError

    with FunctionReward("test_rewards:misbehaving_reward", num_workers=2) as fn:
        mostly_bad = [("p", r, "ok") for r in ("raise", "raise", "ok")]
        assert fn.score(mostly_bad) == [0.0, 0.0, 1.0] and fn.failures == 2 and fn.failing_batches == 1
        assert fn.score([("p", r, "ok") for r in ("raise", "ok")]) == [0.0, 1.0]  # half is not more than half
        assert fn.failures == 1 and fn.failing_batches == 0
        for _ in range(MAX_FAILING_BATCHES - 1):
            fn.score(mostly_bad)
        with pytest.raises(RewardFailureError) as e:
            fn.score(mostly_bad)
    assert str(e.value) == ("reward function 'test_rewards:misbehaving_reward' failed on 2 of 3 responses, and on "
                            "more than half in each of the last 3 batches (last error: RuntimeError: boom); "
                            "stopping: fix the function, or raise reward.timeout_s / reward.num_workers")


def test_a_reward_function_that_takes_the_record_gets_every_field_of_it(tmp_path):
    """A JSONL record's fields beyond prompt and answer reach a reward function that asks for them (a fourth
    argument, `record`); a function of three arguments is called as before."""
    from megatron_rl.data import JsonlPromptDataset
    from megatron_rl.rewards.function import takes_record

    path = tmp_path / "p.jsonl"
    path.write_text('{"question": "q1", "answer": "a", "tests": ["x", "y"]}\n'
                    '{"question": "q2", "answer": "b", "tests": ["z"]}\n')
    records = list(JsonlPromptDataset(path, prompt_field="question", answer_field="answer"))
    assert records[0].as_dict()["tests"] == ["x", "y"] and records[0].as_dict()["reference"] == "a"
    items = [("q1", "x alone", "a", records[0].as_dict()), ("q2", "z", "b", records[1].as_dict())]
    with FunctionReward("reward_fns:passes_its_tests", num_workers=1) as fn:
        assert fn.score(items) == [0.5, 1.0]
    with FunctionReward("reward_fns:says_mat", num_workers=1) as fn:
        assert fn.score([("p", "the mat", None, {}), ("p", "no", None)]) == [1.0, 0.0]
    assert takes_record(lambda p, r, ref, record: 0) and not takes_record(lambda p, r, ref: 0)


def test_a_workers_log_holds_their_prints_and_stays_bounded(tmp_path):
    """What a reward function prints goes to the pool's log, not the caller's console, and a log past its bound is
    emptied before the next batch (a function printing on every call would fill the run's disk)."""
    from megatron_rl.sandbox import WorkerPool

    log = tmp_path / "workers.log"
    with WorkerPool("reward_fns:always_raises", num_workers=1, timeout_s=5.0, log_path=str(log),
                    log_max_bytes=5_000) as pool:
        outcomes = pool.map([("p", "r", None)])
        assert not outcomes[0].ok and outcomes[0].error == "ValueError: cannot score 'r'"
        first = log.read_text()
        assert "reward noise 199 on stdout\n" in first and "Traceback (most recent call last)" in first
        assert log.stat().st_size > 5_000
        pool.map([("p", "again", None)])
    text = log.read_text()
    assert text.startswith("---- ") and "emptied: over 5000 bytes" in text.splitlines()[0]
    assert "cannot score 'again'" in text and "cannot score 'r'" not in text

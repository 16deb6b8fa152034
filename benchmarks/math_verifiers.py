"""MATH answer checking: our verifier (`megatron_rl.rewards`) against Hugging Face's math-verify, on labelled sets.

    pip install math-verify==0.9.0      # not a dependency of megatron-rl: only this comparison needs it
    python benchmarks/math_verifiers.py [--show-wrong]

Every verifier answers the question the MATH reward asks: is the final answer of this response equivalent to this
reference answer? Four labelled sets:
- `math500_own`: each MATH-500 solution (the full text, as a response) against its own `answer` field: all equal;
- `math500_shifted`: solution i against the answer of problem i + 1: all different, except the pairs listed in
  `SHIFTED_EQUAL`, whose two reference answers are the same number (checked by hand; they are left out);
- `hand`: `HAND`, equivalent rewritings and near-misses by category, labelled by hand with MATH's grading
  conventions (units, `\\text{}`, a degree sign and a percent sign do not change an answer; a rounded decimal is
  not a fraction; an interval's brackets matter). It grew from the cases ours was developed against
  (tests/test_rewards.py), so it favours ours;
- `hand_blind`: `HAND_BLIND`, more of the same, written before running either verifier on them.
Cases where graders disagree (0.5 vs 50%, radians vs degrees, eight digits of pi) are in neither table.

Verifiers, all in the main thread of this process (math-verify's time limits are signal-based and work only there):
- `ours`: what `MathReward` runs: the last boxed answer, the plain-Python stage (`quick_equal`), then the
  sympy stage (`answers_equivalent`, in-process here; the reward runs it in worker processes);
- `math_verify`: the library as its README uses it: `verify(parse(gold), parse(response))`, with the reference
  given as `\\boxed{answer}`, default extraction and time limits;
- `math_verify_lastbox`: math-verify's comparison alone: both sides parsed from `\\boxed{...}` of our last boxed
  answer, so extraction differences do not count.
Time per check: wall time of one (response, reference) check, imports excluded, over the whole set: the fastest
of `--repeat` passes after one untimed warm-up pass. Ends with one JSON line: accuracy and ms per check of each
verifier per set and over all, and ratios (each math-verify variant over ours).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"

# math500_shifted pairs (index i: solution i vs answer i + 1) whose two reference answers are the same value.
SHIFTED_EQUAL = {
    22: ("5", "x=5"),
    186: ("7", "7"),
    403: ("3", "3"),
}

# (category, reference answer, answer as a model might box it, equivalent?)
HAND = [
    # fractions and decimals
    ("fraction-decimal", r"\frac{1}{4}", "0.25", True),
    ("fraction-decimal", r"\frac{1}{4}", "1/4", True),
    ("fraction-decimal", r"\frac{1}{4}", r"\frac{2}{8}", True),
    ("fraction-decimal", r"\frac{1}{4}", "0.24", False),
    ("fraction-decimal", r"\frac{1}{4}", r"\frac{1}{5}", False),
    ("fraction-decimal", r"\frac{1}{4}", "25", False),
    ("fraction-decimal", "0.15", r"\frac{3}{20}", True),
    ("fraction-decimal", "0.15", ".15", True),
    ("fraction-decimal", "0.15", "0.1500", True),
    ("fraction-decimal", "0.15", "0.16", False),
    ("fraction-decimal", "0.15", "15", False),
    ("fraction-decimal", r"\frac{7}{2}", "3.5", True),
    ("fraction-decimal", r"\frac{7}{2}", r"3\frac{1}{2}", True),
    ("fraction-decimal", r"\frac{7}{2}", r"\dfrac72", True),
    ("fraction-decimal", r"\frac{7}{2}", "3.4", False),
    ("fraction-decimal", r"\frac{7}{2}", r"\frac{2}{7}", False),
    ("fraction-decimal", r"1\frac{4}{5}", "9/5", True),
    ("fraction-decimal", r"1\frac{4}{5}", "1.8", True),
    ("fraction-decimal", r"1\frac{4}{5}", r"\frac{4}{5}", False),
    ("fraction-decimal", r"-\frac{3}{4}", "-0.75", True),
    ("fraction-decimal", r"-\frac{3}{4}", r"\frac{-3}{4}", True),
    ("fraction-decimal", r"-\frac{3}{4}", r"-\frac34", True),
    ("fraction-decimal", r"-\frac{3}{4}", "0.75", False),
    ("fraction-decimal", r"\frac{14}{3}", "4.67", False),
    ("fraction-decimal", r"\frac{14}{3}", r"4\frac{2}{3}", True),
    ("fraction-decimal", r"\frac{1}{3}", "0.33", False),
    ("fraction-decimal", r"\frac{1}{3}", "0.333", False),
    ("fraction-decimal", "2.5", r"\frac{5}{2}", True),
    ("fraction-decimal", "2.5", "2.05", False),
    ("fraction-decimal", ".0000672", r"6.72\times 10^{-5}", True),
    ("fraction-decimal", ".0000672", r"6.72\times 10^{-4}", False),
    # intervals
    ("interval", "[-2,7]", "[-2, 7]", True),
    ("interval", "[-2,7]", r"\left[-2,7\right]", True),
    ("interval", "[-2,7]", r"x \in [-2,7]", True),
    ("interval", "[-2,7]", "(-2,7)", False),
    ("interval", "[-2,7]", "[-2,7)", False),
    ("interval", "[-2,7]", "[2,7]", False),
    ("interval", r"(-\infty, 2) \cup (3, \infty)", r"(3,\infty)\cup(-\infty,2)", True),
    ("interval", r"(-\infty, 2) \cup (3, \infty)", r"\left(-\infty,2\right)\cup\left(3,\infty\right)", True),
    ("interval", r"(-\infty, 2) \cup (3, \infty)", r"(-\infty, 2] \cup (3, \infty)", False),
    ("interval", r"(-\infty, 2) \cup (3, \infty)", r"(-\infty, 3)", False),
    ("interval", "(3,4]", r"\left(3,4\right]", True),
    ("interval", "(3,4]", "(3,4)", False),
    ("interval", "(3,4]", "[3,4]", False),
    ("interval", r"[0,\infty)", r"[0, \infty)", True),
    ("interval", r"[0,\infty)", r"(0,\infty)", False),
    # units
    ("units", r"864 \mbox{ inches}^2", "864", True),
    ("units", r"864 \mbox{ inches}^2", r"864 \text{ square inches}", True),
    ("units", r"864 \mbox{ inches}^2", "846", False),
    ("units", r"5.4 \text{ cents}", "5.4", True),
    ("units", r"5.4 \text{ cents}", r"5.4\text{ cents}", True),
    ("units", r"5.4 \text{ cents}", "54", False),
    ("units", r"20\text{ cm}", "20", True),
    ("units", r"20\text{ cm}", r"20 \text{cm}", True),
    ("units", r"20\text{ cm}", "2", False),
    ("units", r"\$18.90", "18.9", True),
    ("units", r"\$18.90", r"\$18.90", True),
    ("units", r"\$18.90", "18.09", False),
    ("units", r"10,\!080", "10080", True),
    ("units", r"10,\!080", "10,080", True),
    ("units", r"10,\!080", "1008", False),
    # \text{} answers
    ("text", r"\text{Evelyn}", "Evelyn", True),
    ("text", r"\text{Evelyn}", r"\textbf{Evelyn}", True),
    ("text", r"\text{Evelyn}", "Navin", False),
    ("text", r"\text{(C)}", "C", True),
    ("text", r"\text{(C)}", "(C)", True),
    ("text", r"\text{(C)}", r"\text{C}", True),
    ("text", r"\text{(C)}", "B", False),
    ("text", r"\text{(C)}", "(B)", False),
    ("text", r"\text{even}", "even", True),
    ("text", r"\text{even}", r"\text{ even }", True),
    ("text", r"\text{even}", "odd", False),
    ("text", r"\text{even}", r"\text{neither}", False),
    # matrices and vectors
    ("matrix", r"\begin{pmatrix} -1/3 \\ 2/3 \\ 5/3 \end{pmatrix}",
     r"\begin{pmatrix} -\frac{1}{3} \\ \frac{2}{3} \\ \frac{5}{3} \end{pmatrix}", True),
    ("matrix", r"\begin{pmatrix} -1/3 \\ 2/3 \\ 5/3 \end{pmatrix}",
     r"\begin{bmatrix} -1/3 \\ 2/3 \\ 5/3 \end{bmatrix}", True),
    ("matrix", r"\begin{pmatrix} -1/3 \\ 2/3 \\ 5/3 \end{pmatrix}",
     r"\begin{pmatrix} 1/3 \\ 2/3 \\ 5/3 \end{pmatrix}", False),
    ("matrix", r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}",
     r"\begin{pmatrix} 2/2 & 2 \\ 3 & 4 \end{pmatrix}", True),
    ("matrix", r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", r"\begin{pmatrix} 1 & 3 \\ 2 & 4 \end{pmatrix}", False),
    ("matrix", r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", r"\begin{pmatrix} 1 & 2 \\ 3 & 5 \end{pmatrix}", False),
    ("matrix", r"\begin{pmatrix} 0.6 \\ -0.8 \end{pmatrix}", r"\begin{pmatrix} 3/5 \\ -4/5 \end{pmatrix}", True),
    ("matrix", r"\begin{pmatrix} 0.6 \\ -0.8 \end{pmatrix}", r"\begin{pmatrix} -0.8 \\ 0.6 \end{pmatrix}", False),
    # several answers
    ("multiple", r"1 \pm \sqrt{19}", r"1+\sqrt{19}, 1-\sqrt{19}", True),
    ("multiple", r"1 \pm \sqrt{19}", r"1-\sqrt{19},1+\sqrt{19}", True),
    ("multiple", r"1 \pm \sqrt{19}", r"1+\sqrt{19}", False),
    ("multiple", r"1 \pm \sqrt{19}", r"1 \pm \sqrt{18}", False),
    ("multiple", "-2,1", "1,-2", True),
    ("multiple", "-2,1", "x=1, x=-2", True),
    ("multiple", "-2,1", "-2", False),
    ("multiple", "-2,1", "(-2,1)", False),
    ("multiple", r"\{1\pm\sqrt{5},-2\}", r"-2, 1+\sqrt{5}, 1-\sqrt{5}", True),
    ("multiple", r"\{1\pm\sqrt{5},-2\}", r"1+\sqrt5, -2", False),
    ("multiple", "3, 5, 7", "7, 5, 3", True),
    ("multiple", "3, 5, 7", "3, 5", False),
    ("multiple", "3, 5, 7", "3, 5, 7, 9", False),
    ("multiple", "(1,2), (3,4)", "(3,4), (1,2)", True),
    ("multiple", "(1,2), (3,4)", "(2,1), (3,4)", False),
    # degrees
    ("degrees", r"90^\circ", "90", True),
    ("degrees", r"90^\circ", r"90^{\circ}", True),
    ("degrees", r"90^\circ", "90\u00b0", True),
    ("degrees", r"90^\circ", "180", False),
    ("degrees", r"30^\circ", r"30 \text{ degrees}", True),
    ("degrees", r"30^\circ", r"60^\circ", False),
    ("degrees", r"\frac{270}7\text{ degrees}", r"\frac{270}{7}", True),
    ("degrees", r"\frac{270}7\text{ degrees}", "270/7", True),
    ("degrees", r"\frac{270}7\text{ degrees}", r"\frac{7}{270}", False),
    # percent
    ("percent", r"50\%", "50", True),
    ("percent", r"50\%", r"50\%", True),
    ("percent", r"50\%", r"50 \text{ percent}", True),
    ("percent", r"50\%", r"5\%", False),
    ("percent", r"50\%", "500", False),
    ("percent", r"12.5\%", "12.5", True),
    ("percent", r"12.5\%", r"\frac{25}{2}\%", True),
    ("percent", r"12.5\%", r"12\%", False),
    # expressions
    ("expression", r"3\sqrt{13}", r"\sqrt{117}", True),
    ("expression", r"3\sqrt{13}", r"\sqrt{39}", False),
    ("expression", r"\frac{\sqrt{3}}{3}", r"\frac{1}{\sqrt{3}}", True),
    ("expression", r"\frac{\sqrt{3}}{3}", r"\sqrt{3}", False),
    ("expression", "6 - 5i", "-5i+6", True),
    ("expression", "6 - 5i", "6+5i", False),
    ("expression", r"x^5 - x^4 + x^3 - x^2 + x - 1", "(x-1)(x^4+x^2+1)", True),
    ("expression", r"x^5 - x^4 + x^3 - x^2 + x - 1", r"x^5 + x^4 + x^3 + x^2 + x + 1", False),
    ("expression", "(a+5)(b+2)", "ab+2a+5b+10", True),
    ("expression", "(a+5)(b+2)", "(a+2)(b+5)", False),
    ("expression", r"5x - 7y + 11z + 4 = 0", r"10x - 14y + 22z + 8 = 0", True),
    ("expression", r"5x - 7y + 11z + 4 = 0", r"5x - 7y + 11z - 4 = 0", False),
    ("expression", "y = 2x + 3", "2x+3", True),
    ("expression", "y = 2x + 3", "y=3+2x", True),
    ("expression", "y = 2x + 3", "y = 2x - 3", False),
    ("expression", r"\left( 3, \frac{\pi}{2} \right)", r"(3,\pi/2)", True),
    ("expression", r"\left( 3, \frac{\pi}{2} \right)", r"(\frac{\pi}{2}, 3)", False),
    ("expression", r"-\frac{\pi}{6}", r"\frac{-\pi}{6}", True),
    ("expression", r"-\frac{\pi}{6}", r"\frac{\pi}{6}", False),
    ("expression", "2^{10}", "1024", True),
    ("expression", "2^{10}", "2^{11}", False),
    ("expression", r"\pi", "3.14", False),
    ("expression", r"\sqrt{2}", "1.414", False),
    ("expression", r"\cot x", r"\frac{\cos x}{\sin x}", True),
    ("expression", r"\cot x", r"\tan x", False),
]

# Written after the first table and before running either verifier on them (the first table grew from the cases
# that ours was developed against, in tests/test_rewards.py): the fairer half of the hand-built set.
HAND_BLIND = [
    ("interval", r"(-\infty,3]", r"x \le 3", True),
    ("interval", "[-2,7]", r"-2 \le x \le 7", True),
    ("interval", r"(-\infty, 2) \cup (3, \infty)", r"x<2 \text{ or } x>3", True),
    ("interval", "(1,2)", "[1,2]", False),
    ("fraction-decimal", r"\frac{1}{3}", r"0.\overline{3}", True),
    ("fraction-decimal", r"\frac{14}{3}", r"4.\overline{6}", True),
    ("fraction-decimal", r"\frac{4}{33}", r"0.\overline{12}", True),
    ("fraction-decimal", r"\frac{9}{4}", "2.25", True),
    ("fraction-decimal", r"\frac{9}{4}", r"2\frac{1}{4}", True),
    ("fraction-decimal", "12", "12.0", True),
    ("fraction-decimal", "12", "12.01", False),
    ("fraction-decimal", r"-\sqrt{3}", "-1.732", False),
    ("fraction-decimal", "0.001", "10^{-3}", True),
    ("units", r"1,\!000,\!000", "10^6", True),
    ("units", r"300,\!000,\!000", r"3\times 10^8", True),
    ("units", "5", r"5 \text{ units}", True),
    ("units", r"\$5.50", "5.5", True),
    ("percent", r"0.5\%", r"\frac{1}{2}\%", True),
    ("text", r"\text{(A)}", "A", True),
    ("text", r"\text{(A)}", r"\text{(D)}", False),
    ("multiple", r"\{2,3\}", r"\{3,2\}", True),
    ("multiple", r"\{1,2\}", r"\{1,2,3\}", False),
    ("multiple", "2, 3", r"2 \text{ and } 3", True),
    ("multiple", "2, 3", r"x=2 \text{ or } x=3", True),
    ("expression", r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", True),
    ("expression", r"\frac{\sqrt{2}}{2}", r"\frac{\sqrt{2}}{4}", False),
    ("expression", r"2\sqrt{2}", r"\sqrt{8}", True),
    ("expression", "(x+1)^2", "x^2+2x+1", True),
    ("expression", "(x+1)^2", "x^2+1", False),
    ("expression", "10", r"\binom{5}{2}", True),
    ("expression", "120", "5!", True),
    ("expression", "3", r"\log_2 8", True),
    ("expression", r"\sqrt[3]{2}", "2^{1/3}", True),
    ("expression", r"\pi r^2", r"r^2\pi", True),
    ("expression", r"\pi r^2", r"2\pi r", False),
    ("expression", r"\frac{1}{2}", r"\frac{x}{2}", False),
    ("expression", r"y=-\frac{1}{2}x+3", "y = 3 - 0.5x", True),
    ("expression", "4", r"\sqrt{16}", True),
    ("expression", "-4", r"\sqrt{16}", False),
    ("expression", "x^2", "x^{2}", True),
    ("expression", r"\sin x", r"\cos x", False),
    ("expression", "2x+3", "3+2x", True),
]


def respond(answer: str) -> str:
    """A response as a model writes it: some working, an earlier wrong box, the final boxed answer last."""
    return f"First try: $\\boxed{{0}}$. On reflection, the answer is $\\boxed{{{answer}}}$."


def rows() -> list[dict]:
    with open(DATA / "math500" / "test.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def labelled_sets() -> dict[str, list[tuple[str, str, bool, str]]]:
    """set name -> [(response, reference answer, equivalent?, category)]."""
    data = rows()
    own = [(r["solution"], r["answer"], True, "own") for r in data]
    shifted = []
    for i, r in enumerate(data):
        nxt = data[(i + 1) % len(data)]["answer"]
        if i in SHIFTED_EQUAL:
            assert SHIFTED_EQUAL[i] == (r["answer"], nxt), f"SHIFTED_EQUAL[{i}] does not match the data file"
            continue
        shifted.append((r["solution"], nxt, False, "shifted"))
    hand = [(respond(answer), ref, label, cat) for cat, ref, answer, label in HAND]
    blind = [(respond(answer), ref, label, cat) for cat, ref, answer, label in HAND_BLIND]
    return {"math500_own": own, "math500_shifted": shifted, "hand": hand, "hand_blind": blind}


def load_ours():
    from megatron_rl.rewards import last_boxed, quick_equal, reference_answer
    from megatron_rl.rewards.symbolic import answers_equivalent

    def check(response: str, reference: str) -> bool:
        pred = last_boxed(response)
        if pred is None:
            return False
        ref = reference_answer(reference)
        decided = quick_equal(pred, ref)
        return decided if decided is not None else bool(answers_equivalent(pred, ref))

    return check


def load_math_verify(own_extraction: bool):
    from math_verify import parse, verify

    from megatron_rl.rewards import last_boxed

    def check(response: str, reference: str) -> bool:
        gold = parse(reference if "\\boxed" in reference else "\\boxed{" + reference + "}")
        if own_extraction:
            return verify(gold, parse(response))
        pred = last_boxed(response)
        return pred is not None and verify(gold, parse("\\boxed{" + pred + "}"))

    return check


def measure(check, items, repeat: int) -> dict:
    """Accuracy, and the fastest of `repeat` timed passes (after one untimed warm-up pass) per check."""
    for response, reference, _, _ in items:  # warm-up: lazy imports, regex compilation, sympy caches
        check(response, reference)
    best, wrong = float("inf"), []
    for _ in range(repeat):
        wrong = []
        t = time.perf_counter()
        for response, reference, label, category in items:
            if check(response, reference) != label:
                wrong.append((category, reference, response[-120:], label))
        best = min(best, time.perf_counter() - t)
    return {"n": len(items), "correct": len(items) - len(wrong), "accuracy": (len(items) - len(wrong)) / len(items),
            "ms_per_check": 1e3 * best / len(items), "wrong": wrong}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--show-wrong", action="store_true", help="print every misjudged case")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes per set; the fastest counts")
    args = parser.parse_args()

    sets = labelled_sets()
    try:
        verifiers = {"ours": load_ours(), "math_verify": load_math_verify(own_extraction=True),
                     "math_verify_lastbox": load_math_verify(own_extraction=False)}
    except ImportError as e:
        raise SystemExit(f"{e}: this comparison needs `pip install math-verify`")
    from importlib.metadata import version

    result: dict = {"math_verify_version": version("math-verify"), "repeat": args.repeat}
    for vname, check in verifiers.items():
        total_n = total_correct = 0
        total_s = 0.0
        for sname, items in sets.items():
            m = measure(check, items, args.repeat)
            total_n += m["n"]
            total_correct += m["correct"]
            total_s += m["ms_per_check"] * m["n"] / 1e3
            result[f"{vname}_{sname}_accuracy"] = round(m["accuracy"], 4)
            result[f"{vname}_{sname}_correct"] = m["correct"]
            result[f"{sname}_n"] = m["n"]
            result[f"{vname}_{sname}_ms_per_check"] = round(m["ms_per_check"], 3)
            for category, reference, response, label in m["wrong"]:
                if args.show_wrong or sname.startswith("hand"):
                    print(f"{vname} misjudged [{sname}/{category}] ref={reference!r} label={label} "
                          f"response=...{response!r}", file=sys.stderr)
            if sname.startswith("hand"):
                by_cat: dict[str, int] = {}
                for category, *_ in m["wrong"]:
                    by_cat[category] = by_cat.get(category, 0) + 1
                result[f"{vname}_{sname}_wrong_by_category"] = by_cat
        result[f"{vname}_all_accuracy"] = round(total_correct / total_n, 4)
        result[f"{vname}_all_ms_per_check"] = round(1e3 * total_s / total_n, 3)
    for variant in ("math_verify", "math_verify_lastbox"):
        for key in [k for k in result if k.startswith(variant + "_")]:
            rest = key[len(variant) + 1:]
            ours = result.get("ours_" + rest)
            if rest.endswith(("_accuracy", "_ms_per_check")) and ours:
                result[f"ratio_{variant}_over_ours_{rest}"] = round(result[key] / ours, 3)
    emit(result)


if __name__ == "__main__":
    main()

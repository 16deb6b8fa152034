"""GSM8K verifier: the final number of a response against the reference number.

GSM8K answers are numbers, but models write them many ways: `#### 1,000`, `$1000.00`, `\\boxed{1000}`,
`The answer is 1000 dollars.`, `3/4` for `0.75`. Everything is parsed into an exact `Fraction`, so formatting
never matters and no float tolerance is needed.

Where the answer is taken from, in order (the first that is present wins, because it is the most explicit):
1. the first number after the last `####` (the format GSM8K solutions and our prompts use);
2. the first number in the last `\\boxed{...}`;
3. the number after the last "answer is" / "answer:";
4. the last number in the text.
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction
from typing import Optional

from megatron_rl.rewards.base import PerItemReward
from megatron_rl.rewards.latex import last_boxed

log = logging.getLogger(__name__)

# A number: optional sign (only when not glued to a preceding word/number, so "10-3" is 10 and 3), optional
# currency, digits with proper thousands groups or plain digits, optional decimals, optional "/denominator".
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>-)?\s?\$?\s?(?P<sign2>-)?"
    r"(?P<num>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:\s?/\s?(?P<den>\d+(?:\.\d+)?))?"
)
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*:?", re.IGNORECASE)
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*(-?[\d.,]+)\s*\}\s*\{\s*([\d.,]+)\s*\}")


def _clean(text: str) -> str:
    """Unicode minus, LaTeX fractions and escaped dollars, so the number pattern sees plain text."""
    text = text.replace("\u2212", "-").replace("\\$", "$").replace("\\!", "").replace("\\,", "")
    return _LATEX_FRAC.sub(r"\1/\2", text)


_MAX_DIGITS = 100  # a longer "number" is degenerate output, not an answer (and int() refuses > 4300 digits)


def _value(m: re.Match) -> Optional[Fraction]:
    if len(m.group("num")) > _MAX_DIGITS or len(m.group("den") or "") > _MAX_DIGITS:
        return None
    value = Fraction(m.group("num").replace(",", ""))
    if m.group("den"):
        den = Fraction(m.group("den"))
        if den == 0:
            return None
        value /= den
    return -value if (m.group("sign") or m.group("sign2")) else value


def first_number(text: str) -> Optional[Fraction]:
    m = _NUMBER.search(_clean(text))
    return _value(m) if m else None


def last_number(text: str) -> Optional[Fraction]:
    matches = list(_NUMBER.finditer(_clean(text)))
    return _value(matches[-1]) if matches else None


def extract_gsm8k_answer(response: str) -> Optional[Fraction]:
    """The number a response gives as its final answer (see the module docstring for the order), or None."""
    if "####" in response:
        return first_number(response.rsplit("####", 1)[1])
    boxed = last_boxed(response)
    if boxed is not None:
        return first_number(boxed)
    answer_is = list(_ANSWER_IS.finditer(response))
    if answer_is:
        value = first_number(response[answer_is[-1].end():][:80])
        if value is not None:
            return value
    return last_number(response)


def parse_reference(reference: str) -> Optional[Fraction]:
    """The reference number: a bare number (commas allowed) or a full GSM8K solution ending in `#### n`."""
    if "####" in reference:
        reference = reference.rsplit("####", 1)[1]
    return first_number(reference)


def gsm8k_reward(response: str, reference: str) -> float:
    """1.0 if the response's final number equals the reference number exactly, else 0.0."""
    ref = parse_reference(reference)
    if ref is None:
        log.warning("GSM8K reference %r is not a number; scored 0.0", reference)
        return 0.0
    got = extract_gsm8k_answer(response)
    return 1.0 if got is not None and got == ref else 0.0


class GSM8KReward(PerItemReward):
    name = "gsm8k"

    def score_one(self, prompt: str, response: str, reference: Optional[str]) -> float:
        if reference is None:
            raise ValueError("the GSM8K verifier needs a reference answer")
        return gsm8k_reward(response, reference)

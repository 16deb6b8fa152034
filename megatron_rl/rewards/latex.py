"""String-level handling of LaTeX answers: find the boxed answer, normalise it, split it into parts.

Everything here is plain Python (no sympy), fast and safe to run in the controller: it decides the common cases
(identical after normalisation, or two plain numbers) on its own. Only what remains goes to the symbolic check in
`megatron_rl.rewards.symbolic`, which runs in a worker process under a time limit.

Normalisation removes what does not change the value: `\\left`/`\\right`, spacing commands, `\\text{}` wrappers,
degree signs, dollar signs, percent signs, trailing unit words and periods, thousands separators, `\\dfrac`, and
rewrites TeX shorthand (`\\frac12`, `\\sqrt2`) with explicit braces.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Optional

# ---- boxed answers ------------------------------------------------------------------------------------------------


def _balanced(text: str, start: int) -> Optional[int]:
    """Index just past the group that opens with '{' at `start`, or None if it never closes."""
    depth = 0
    i = start
    while i < len(text):
        c = text[i]
        if c == "\\":  # an escaped brace (\{ or \}) does not count
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


_BOX = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")


def last_boxed(text: str) -> Optional[str]:
    """The content of the last `\\boxed{...}` or `\\fbox{...}` (braces balanced), or None.

    `\\boxed 5` (TeX's one-token form) gives "5". An unclosed last box is skipped in favour of an earlier one.
    """
    for m in reversed(list(_BOX.finditer(text))):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            end = _balanced(text, i)
            if end is not None:
                return text[i + 1:end - 1]
            continue
        token = re.match(r"[^\s$]+", text[i:])
        if token:
            return token.group(0)
    return None


# ---- normalisation ------------------------------------------------------------------------------------------------

_WRAPPERS = ("text", "textbf", "textit", "textrm", "mathrm", "mathbf", "mathit", "mbox", "textnormal", "boxed")
_SIZE_CMDS = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|biggl|biggr|big|Big|bigg|Bigg)(?![a-zA-Z])")
_UNITS = (
    "degrees", "degree", "deg", "cm", "mm", "km", "m", "meters", "meter", "metres", "centimeters", "inches", "inch",
    "feet", "foot", "ft", "yards", "yard", "miles", "mile", "units", "unit", "cents", "cent", "dollars", "dollar",
    "hours", "hour", "hrs", "minutes", "minute", "min", "seconds", "second", "sec", "days", "day", "weeks", "week",
    "years", "year", "mph", "pounds", "pound", "lbs", "ounces", "ounce", "oz", "grams", "gram", "kg", "liters",
    "liter", "gallons", "gallon", "percent", "people", "students", "ways", "square", "sq", "cubic", "points",
)
_UNIT_SUFFIX = re.compile(
    r"\s*(?:square\s+|sq\.?\s+|cubic\s+)?\b(?:" + "|".join(sorted(_UNITS, key=len, reverse=True)) +
    r")\b\.?\s*(?:\^\s*\{?\s*[23]\s*\}?)?\s*$", re.IGNORECASE)
_UNICODE = {"\n": " ", "\u2212": "-", "\u00b0": "^\\circ", "\u03c0": "\\pi", "\u00d7": "\\times", "\u00b7": "\\cdot",
            "\u2264": "\\le ", "\u2265": "\\ge ", "\u221e": "\\infty", "\u221a": "\\sqrt "}
_SHORT_LHS = re.compile(r"^\s*(?:[a-zA-Z](?:_\{?\w+\}?)?|\\[a-zA-Z]+)\s*$")


def _unwrap(s: str, names: tuple[str, ...]) -> str:
    """Replace `\\name{content}` by `content` for each wrapper command (balanced braces, nested allowed)."""
    pattern = re.compile(r"\\(?:" + "|".join(names) + r")\s*(?=\{)")
    while True:
        m = pattern.search(s)
        if not m:
            return s
        end = _balanced(s, m.end())
        if end is None:
            return s[:m.start()] + s[m.end() + 1:]
        s = s[:m.start()] + s[m.end() + 1:end - 1] + s[end:]


def _tex_arg(s: str, i: int) -> tuple[Optional[str], int]:
    """One TeX macro argument at s[i:]: a braced group or a single token; (text, index after) or (None, i)."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        return None, i
    if s[i] == "{":
        end = _balanced(s, i)
        return (None, i) if end is None else (s[i + 1:end - 1], end)
    if s[i] == "\\":
        m = re.match(r"\\[a-zA-Z]+", s[i:])
        if m:
            return m.group(0), i + m.end()
        return None, i
    if s[i] in "}^_":
        return None, i
    return s[i], i + 1


def _brace_shorthand(s: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac 59` -> `\\frac{5}{9}`, `\\sqrt2` -> `\\sqrt{2}` (TeX reads one token)."""
    out = []
    i = 0
    macro = re.compile(r"\\(frac|sqrt)(?![a-zA-Z])")
    while True:
        m = macro.search(s, i)
        if not m:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i:m.start()])
        j = m.end()
        if m.group(1) == "sqrt":
            out.append("\\sqrt")
            while j < len(s) and s[j] == " ":
                j += 1
            if j < len(s) and s[j] == "[":  # \sqrt[n]{x}: keep the index, then the radicand
                close = s.find("]", j)
                if close == -1:
                    out.append(s[j:])
                    return "".join(out)
                out.append(s[j:close + 1])
                j = close + 1
            arg, j2 = _tex_arg(s, j)
            if arg is None:
                i = j
                continue
            out.append("{" + _brace_shorthand(arg) + "}")
            i = j2
        else:
            a, j2 = _tex_arg(s, j)
            b, j3 = _tex_arg(s, j2) if a is not None else (None, j2)
            if a is None or b is None:
                out.append("\\frac")
                i = j
                continue
            out.append("\\frac{" + _brace_shorthand(a) + "}{" + _brace_shorthand(b) + "}")
            i = j3


def _inside_command(s: str, i: int, sep: str) -> bool:
    """True when a command separator at s[i] is only the start of a longer command (`\\cupx` is not `\\cup`)."""
    return sep[0] == "\\" and s[i + len(sep):i + len(sep) + 1].isalpha()


def _top_level_split(s: str, sep: str) -> list[str]:
    """Split on `sep` outside (), [], {} (and \\{ \\}); brackets may be mismatched, as in intervals like (3,4]."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        if s.startswith("\\{", i) or s.startswith("\\}", i):
            depth += 1 if s[i + 1] == "{" else -1
            i += 2
            continue
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and s.startswith(sep, i) and not _inside_command(s, i, sep):
            parts.append(s[start:i])
            i += len(sep)
            start = i
            continue
        i += 1
    parts.append(s[start:])
    return parts


def _strip_short_lhs(s: str) -> str:
    """`x = 5` -> `5`, `y = 2x + 3` -> `2x + 3`: a one-symbol left side only names the answer."""
    parts = _top_level_split(s, "=")
    if len(parts) == 2 and _SHORT_LHS.match(parts[0]) and parts[1].strip():
        return parts[1].strip()
    return s


def normalize_answer(answer: str) -> str:
    """A normalised form of a LaTeX answer that keeps single spaces (they separate tokens like `\\cot x`)."""
    s = answer.strip()
    for plain, tex in _UNICODE.items():
        s = s.replace(plain, tex)
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"^\\\(|\\\)$", "", s).strip()
    s = re.sub(r"^\\\[|\\\]$", "", s).strip()
    s = re.sub(r"(\d)\s*,\s*\\[!,]\s*(?=\d)", r"\1", s)  # 10,\!080 -> 10080 (TeX thousands separator)
    s = re.sub(r"(\d)\\[!,](?=\d{3})", r"\1", s)  # 10\,000 -> 10000
    s = re.sub(r"(?<!\\)\\(?:[!,;:> ]|q?quad(?![a-zA-Z]))|~", " ", s)  # spacing (not the \\ row break)
    s = _SIZE_CMDS.sub("", s)
    s = re.sub(r"\\[dtc]frac(?![a-zA-Z])", r"\\frac", s)
    s = re.sub(r"\\displaystyle(?![a-zA-Z])", "", s)
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![a-zA-Z])|\\degree(?![a-zA-Z])", "", s)
    s = _unwrap(s, _WRAPPERS)
    s = s.replace("\\%", "").replace("%", "")
    s = re.sub(r"\s+", " ", s).strip()
    while True:  # trailing unit words, only when a value remains before them
        m = _UNIT_SUFFIX.search(s)
        if not m or not re.search(r"[\d}]|\\pi", s[:m.start()]):
            break
        s = s[:m.start()].rstrip()
    s = re.sub(r"^[a-zA-Z]\s*\\in(?![a-zA-Z])\s*", "", s)  # x \in [-2, 7]
    s = re.sub(r"\s+(?:and|or)\s+", ", ", s)
    s = s.rstrip(" .")
    s = re.sub(r"^\(([A-E])\)$", r"\1", s)  # multiple choice (B) -> B
    s = re.sub(r"^(\d+)_\{?\d+\}?$", r"\1", s)  # 2516_8: the base is in the question
    s = _brace_shorthand(s)
    s = re.sub(r"(?<![\d}])\.(?=\d)", "0.", s)  # .35 -> 0.35
    s = re.sub(r"\^\{\s*(\w)\s*\}", r"^\1", s)  # x^{2} -> x^2
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):  # 58,500 (a lone number, not a list)
        s = s.replace(",", "")
    s = _strip_short_lhs(s)
    return re.sub(r"\s+", " ", s).strip()


def canonical(answer: str) -> str:
    """The comparison key for plain string equality: normalised, spaces removed, word answers lower-cased."""
    s = normalize_answer(answer).replace(" ", "")
    if re.fullmatch(r"[A-Za-z]{2,}", s):
        s = s.lower()
    return s


_RATIONAL = re.compile(r"-?\d+(?:\.\d+)?")
_FRAC = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}")
_SLASH = re.compile(r"(-?\d+)/(\d+)")
_MIXED = re.compile(r"(-?)(\d+)\\frac\{(\d+)\}\{(\d+)\}")


def parse_rational(canon: str) -> Optional[Fraction]:
    """An exact value for a canonical answer that is a plain number (`-3`, `0.15`, `\\frac{3}{20}`, `3/20`,
    `1\\frac{4}{5}`), else None. Lets the controller decide most answers without sympy."""
    try:
        if _RATIONAL.fullmatch(canon):
            return Fraction(canon)
        m = _FRAC.fullmatch(canon)
        if m and int(m.group(3)) != 0:
            v = Fraction(int(m.group(2)), int(m.group(3)))
            return -v if m.group(1) else v
        m = _SLASH.fullmatch(canon)
        if m and int(m.group(2)) != 0:
            return Fraction(int(m.group(1)), int(m.group(2)))
        m = _MIXED.fullmatch(canon)
        if m and int(m.group(4)) != 0:
            v = int(m.group(2)) + Fraction(int(m.group(3)), int(m.group(4)))
            return -v if m.group(1) else v
    except (ValueError, ZeroDivisionError):
        return None
    return None


def quick_equal(pred: str, ref: str) -> Optional[bool]:
    """True/False when plain string or number comparison decides; None when a symbolic check is needed."""
    a, b = canonical(pred), canonical(ref)
    if a == b:
        return True
    if not a:
        return False
    x, y = parse_rational(a), parse_rational(b)
    if x is not None and y is not None:
        return x == y
    return None


# ---- structure --------------------------------------------------------------------------------------------------


@dataclass
class Answer:
    """A normalised answer split into its parts, so each part can be compared on its own.

    kind: "expr" (one expression), "set" (unordered: a bare list, `\\{...\\}`, or an expression with `\\pm`),
    "seq" (ordered, with brackets: tuples, points, intervals), "union" (of intervals), "matrix", "eq" (equation).
    """

    kind: str
    text: str = ""
    items: list = field(default_factory=list)
    brackets: str = ""


def _expand_pm(s: str) -> list[str]:
    """`1 \\pm \\sqrt{19}` -> [`1 + \\sqrt{19}`, `1 - \\sqrt{19}`]; `\\mp` takes the opposite sign."""
    if "\\pm" not in s and "\\mp" not in s:
        return [s]
    pm = re.compile(r"\\pm(?![a-zA-Z])")
    mp = re.compile(r"\\mp(?![a-zA-Z])")
    return [mp.sub(" - ", pm.sub(" + ", s)), mp.sub(" + ", pm.sub(" - ", s))]


def _matching_close(s: str) -> Optional[int]:
    """Index of the bracket that closes the one at s[0] (any of ( [ vs ) ], so intervals work), or None."""
    depth = 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return None


def split_answer(answer: str) -> Answer:
    """Parse a normalised answer into an `Answer` tree (strings at the leaves)."""
    s = _strip_short_lhs(answer.strip())
    m = re.fullmatch(r"\\begin\{([pbvBV]?matrix|array)\}(?:\{[^}]*\})?(.*)\\end\{\1\}", s, re.S)
    if m:
        rows = [r for r in re.split(r"\\\\", m.group(2)) if r.strip()]
        return Answer("matrix", items=[[c.strip() for c in r.split("&")] for r in rows])
    unions = _top_level_split(s, "\\cup")
    if len(unions) > 1:
        return Answer("union", items=[split_answer(u) for u in unions])
    sides = _top_level_split(s, "=")
    if len(sides) == 2:
        return Answer("eq", items=[sides[0].strip(), sides[1].strip()])
    if s.startswith("\\{") and s.endswith("\\}"):
        inner = s[2:-2]
        parts = [p for p in _top_level_split(inner, ",") if p.strip()]
        return Answer("set", items=[split_answer(e) for p in parts for e in _expand_pm(p)])
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _matching_close(s) == len(s) - 1:
        parts = _top_level_split(s[1:-1], ",")
        if len(parts) > 1:
            return Answer("seq", items=[split_answer(p) for p in parts], brackets=s[0] + s[-1])
    parts = _top_level_split(s, ",")
    if len(parts) > 1:
        return Answer("set", items=[split_answer(e) for p in parts if p.strip() for e in _expand_pm(p)])
    variants = _expand_pm(s)
    if len(variants) > 1:
        return Answer("set", items=[Answer("expr", text=v.strip()) for v in variants])
    return Answer("expr", text=s)

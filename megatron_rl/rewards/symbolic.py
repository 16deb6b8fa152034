"""Symbolic equivalence of two normalised LaTeX answers, with a small LaTeX -> sympy converter.

This module imports sympy and can take unbounded time on hostile input (simplify is not guaranteed to finish), so
the MATH verifier calls `answers_equivalent` only inside a worker process with a deadline (see `workers.py`).

The converter is a recursive-descent parser for the LaTeX that final answers use: numbers (decimals become exact
rationals), single-letter variables (`i` is the imaginary unit, `e` Euler's number), Greek letters, `\\frac`,
`\\sqrt[n]{}`, `\\pi`, `\\infty`, powers, implicit multiplication (`2\\sqrt{5}`, `3x`, `(a+5)(b+2)`),
`\\cdot`/`\\times`/`\\div`, factorial, `|x|`, `\\binom`, floor/ceil, and the usual functions (`\\sin x`,
`\\log_2 8`). TeX reads `x^23` as `x^2 \\cdot 3` and `1\\frac{4}{5}` in a MATH answer is the mixed number 9/5;
the parser follows both.
"""

from __future__ import annotations

import random
import re
from typing import Optional

import sympy

from megatron_rl.rewards.latex import Answer, canonical, normalize_answer, parse_rational, split_answer


class LatexParseError(ValueError):
    """The text is not an expression this converter understands."""


_TOKEN = re.compile(r"\s*(?:(?P<num>\d+\.\d+|\d+)|(?P<cmd>\\[a-zA-Z]+|\\[{}|])|(?P<letter>[a-zA-Z])|(?P<sym>\S))")
_FUNCS = {
    "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "cot": sympy.cot, "sec": sympy.sec, "csc": sympy.csc,
    "arcsin": sympy.asin, "arccos": sympy.acos, "arctan": sympy.atan, "sinh": sympy.sinh, "cosh": sympy.cosh,
    "tanh": sympy.tanh, "ln": sympy.log, "log": sympy.log, "exp": sympy.exp,
}
_GREEK = {
    "alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta", "vartheta", "iota", "kappa",
    "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "upsilon", "phi", "varphi", "chi", "psi", "omega",
    "Gamma", "Delta", "Theta", "Lambda", "Xi", "Sigma", "Phi", "Psi", "Omega",
}
_MAX_EXPONENT = 10_000  # 10^{10^{10}} must fail to parse, not try to build a 10-billion-digit integer


class _Parser:
    def __init__(self, text: str):
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        text = text.replace("**", "^")
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m:
                break
            kind = m.lastgroup
            self.tokens.append((kind, m.group(kind)))
            pos = m.end()
        self.i = 0
        self.abs_depth = 0

    # ---- token helpers

    def peek(self) -> Optional[tuple[str, str]]:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        tok = self.peek()
        if tok is None:
            raise LatexParseError("unexpected end of expression")
        self.i += 1
        return tok

    def accept(self, value: str) -> bool:
        tok = self.peek()
        if tok is not None and tok[1] == value:
            self.i += 1
            return True
        return False

    def expect(self, value: str) -> None:
        if not self.accept(value):
            raise LatexParseError(f"expected {value!r} at token {self.i}")

    # ---- grammar

    def parse(self) -> sympy.Expr:
        expr = self.expr()
        if self.peek() is not None:
            raise LatexParseError(f"unexpected {self.peek()[1]!r}")
        return expr

    def expr(self) -> sympy.Expr:
        value = self.term()
        while True:
            if self.accept("+"):
                value = value + self.term()
            elif self.accept("-"):
                value = value - self.term()
            else:
                return value

    def starts_factor(self) -> bool:
        tok = self.peek()
        if tok is None:
            return False
        kind, value = tok
        if kind in ("num", "letter"):
            return True
        if kind == "cmd":
            name = value[1:]
            return (name in _FUNCS or name in _GREEK or
                    name in ("frac", "sqrt", "pi", "infty", "infinity", "binom", "lfloor", "lceil", "{"))
        return value in "([{" or (value == "|" and self.abs_depth == 0)

    def term(self) -> sympy.Expr:
        if self.accept("-"):
            return -self.term()
        if self.accept("+"):
            return self.term()
        first_tok, start = self.peek(), self.i
        value = self.power()
        lone_integer = (first_tok is not None and first_tok[0] == "num" and "." not in first_tok[1]
                        and self.i == start + 1)
        while True:
            tok = self.peek()
            if tok is None:
                return value
            if tok[1] in ("*", "\\cdot", "\\times"):
                self.take()
                value = value * self.power()
            elif tok[1] in ("/", "\\div"):
                self.take()
                value = value / self.power()
            elif self.starts_factor():
                if lone_integer and tok[1] == "\\frac":
                    frac = self.power()
                    if frac.is_Rational and value.is_Integer and value >= 0 and 0 < frac < 1:
                        value = value + frac  # mixed number: 1\frac{4}{5} = 9/5
                    else:
                        value = value * frac
                else:
                    value = value * self.power()
            else:
                return value
            lone_integer = False

    def power(self) -> sympy.Expr:
        base = self.postfix()
        if self.accept("^"):
            exponent = self.exponent()
            if exponent.is_number and abs(exponent) > _MAX_EXPONENT and base.is_number and abs(base) != 1:
                raise LatexParseError("exponent too large")
            return sympy.Pow(base, exponent)
        return base

    def exponent(self) -> sympy.Expr:
        tok = self.peek()
        if tok is None:
            raise LatexParseError("missing exponent")
        if tok[1] == "{":
            self.take()
            value = self.expr()
            self.expect("}")
            return value
        if tok[1] in ("-", "+"):
            self.take()
            value = self.exponent()
            return -value if tok[1] == "-" else value
        if tok[0] == "num" and len(tok[1]) > 1 and "." not in tok[1]:
            # TeX superscripts take one token: x^23 is x^2 * 3. Split the digits and leave the rest.
            self.tokens[self.i] = ("num", tok[1][1:])
            return sympy.Integer(tok[1][0])
        return self.postfix()

    def postfix(self) -> sympy.Expr:
        value = self.atom()
        while self.accept("!"):
            if value.is_Integer and value > 1000:
                raise LatexParseError("factorial too large")
            value = sympy.factorial(value)
        return value

    def group(self) -> sympy.Expr:
        """A braced argument, or a single token (TeX's one-token argument)."""
        if self.accept("{"):
            value = self.expr()
            self.expect("}")
            return value
        return self.postfix()

    def atom(self) -> sympy.Expr:
        kind, value = self.take()
        if kind == "num":
            return sympy.Rational(value)
        if kind == "letter":
            if value == "i":
                return sympy.I
            if value == "e":
                return sympy.E
            name = value
            if self.accept("_"):
                tok = self.take()
                if tok[1] == "{":
                    sub = []
                    while not self.accept("}"):
                        sub.append(self.take()[1])
                    name += "_" + "".join(sub)
                else:
                    name += "_" + tok[1]
            return sympy.Symbol(name)
        if value in ("(", "[", "{", "\\{"):
            close = {"(": ")", "[": "]", "{": "}", "\\{": "\\}"}[value]
            saved, self.abs_depth = self.abs_depth, 0
            inner = self.expr()
            self.abs_depth = saved
            self.expect(close)
            return inner
        if value == "|" and self.abs_depth == 0:
            self.abs_depth += 1
            inner = self.expr()
            self.abs_depth -= 1
            self.expect("|")
            return sympy.Abs(inner)
        if kind == "cmd":
            return self.command(value[1:])
        raise LatexParseError(f"unexpected {value!r}")

    def command(self, name: str) -> sympy.Expr:
        if name == "frac":
            num = self.group()
            den = self.group()
            return num / den
        if name == "binom":
            return sympy.binomial(self.group(), self.group())
        if name == "sqrt":
            if self.accept("["):
                index = self.expr()
                self.expect("]")
                return sympy.root(self.group(), index)
            return sympy.sqrt(self.group())
        if name == "pi":
            return sympy.pi
        if name in ("infty", "infinity"):
            return sympy.oo
        if name in _GREEK:
            return sympy.Symbol(name)
        if name in ("lfloor", "lceil"):
            inner = self.expr()
            self.expect("\\r" + name[1:])
            return sympy.floor(inner) if name == "lfloor" else sympy.ceiling(inner)
        if name in _FUNCS:
            return self.function(name)
        raise LatexParseError(f"unsupported command \\{name}")

    def function(self, name: str) -> sympy.Expr:
        base = None
        if name == "log" and self.accept("_"):
            base = self.group()
        power = None
        if self.accept("^"):  # \sin^2 x = (\sin x)^2
            power = self.exponent()
        tok = self.peek()
        if tok is not None and tok[1] in ("(", "{"):
            arg = self.atom()
        else:  # \sin 2x: TeX convention, the argument runs over the following product
            arg = self.power()
            while self.starts_factor() and not (self.peek()[0] == "cmd" and self.peek()[1][1:] in _FUNCS):
                arg = arg * self.power()
        value = sympy.log(arg, base) if base is not None else _FUNCS[name](arg)
        return value ** power if power is not None else value


def to_sympy(text: str) -> sympy.Expr:
    """A sympy expression for a normalised LaTeX expression (no commas, brackets pairs or `=`)."""
    if not text.strip():
        raise LatexParseError("empty expression")
    try:
        return _Parser(text).parse()
    except LatexParseError:
        raise
    except (TypeError, ValueError, ZeroDivisionError, AttributeError, RecursionError) as e:
        raise LatexParseError(f"{type(e).__name__}: {e}") from None


# ---- equivalence --------------------------------------------------------------------------------------------------


def _is_zero(d: sympy.Expr, rng: random.Random) -> bool:
    if d == 0:
        return True
    try:
        if sympy.simplify(d) == 0:
            return True
    except Exception:
        pass
    # Numeric check: closed-form constants simplify cannot always settle (nested radicals, trig values), and for
    # expressions with variables, an identity holds at random points; a coincidence at 3 points is negligible.
    symbols = sorted(d.free_symbols, key=str)
    trials = [{}] if not symbols else [{s: sympy.Rational(rng.randint(-900, 900), rng.randint(7, 97)) for s in symbols}
                                      for _ in range(3)]
    for subs in trials:
        try:
            value = complex(sympy.N(d.subs(subs), 30))
        except (TypeError, ValueError, ZeroDivisionError):
            return False
        if not (abs(value) <= 1e-10):
            return False
    return True


def expressions_equal(a: sympy.Expr, b: sympy.Expr) -> bool:
    if a == b:
        return True
    if a.has(sympy.oo, -sympy.oo, sympy.zoo) or b.has(sympy.oo, -sympy.oo, sympy.zoo):
        return False  # inf - inf is nan: infinities are equal only structurally (checked above)
    return _is_zero(a - b, random.Random(0))


def _expr_equal(a: str, b: str) -> bool:
    ca, cb = canonical(a), canonical(b)
    if ca == cb:
        return True
    x, y = parse_rational(ca), parse_rational(cb)
    if x is not None and y is not None:
        return x == y
    try:
        return expressions_equal(to_sympy(a), to_sympy(b))
    except LatexParseError:
        return False


def _equations_equal(a: list[str], b: list[str]) -> bool:
    """l1 = r1 and l2 = r2 describe the same set when l1 - r1 is a nonzero constant multiple of l2 - r2."""
    try:
        d1 = to_sympy(a[0]) - to_sympy(a[1])
        d2 = to_sympy(b[0]) - to_sympy(b[1])
    except LatexParseError:
        return False
    if d2 == 0 or d1 == 0:
        return d1 == d2
    ratio = sympy.simplify(d1 / d2)
    return not ratio.free_symbols and ratio.is_number and ratio != 0 and ratio.is_finite is not False


def _matching(xs: list, ys: list) -> bool:
    """A perfect matching between two lists of parts under `_equal` (order-free comparison of sets)."""
    if len(xs) != len(ys):
        return False
    used = [False] * len(ys)

    def search(k: int) -> bool:
        if k == len(xs):
            return True
        for j, y in enumerate(ys):
            if not used[j] and _equal(xs[k], y):
                used[j] = True
                if search(k + 1):
                    return True
                used[j] = False
        return False

    return search(0)


def _equal(a: Answer, b: Answer) -> bool:
    if a.kind == "set" and len(a.items) == 1:
        a = a.items[0]
    if b.kind == "set" and len(b.items) == 1:
        b = b.items[0]
    if a.kind != b.kind:
        return False
    if a.kind == "expr":
        return _expr_equal(a.text, b.text)
    if a.kind == "eq":
        return _equations_equal(a.items, b.items)
    if a.kind == "seq":
        return (a.brackets == b.brackets and len(a.items) == len(b.items)
                and all(_equal(x, y) for x, y in zip(a.items, b.items)))
    if a.kind in ("set", "union"):
        return _matching(a.items, b.items)
    if a.kind == "matrix":
        return ([len(r) for r in a.items] == [len(r) for r in b.items]
                and all(_expr_equal(x, y) for ra, rb in zip(a.items, b.items) for x, y in zip(ra, rb)))
    return False


def answers_equivalent(pred: str, ref: str) -> bool:
    """True if two raw answer strings (boxed contents, not whole responses) are mathematically the same answer.

    Unbounded in time on hostile input: call it through a worker with a deadline.
    """
    a, b = normalize_answer(pred), normalize_answer(ref)
    if canonical(a) == canonical(b):
        return True
    if not a or not b:
        return False
    return _equal(split_answer(a), split_answer(b))

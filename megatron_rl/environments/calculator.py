"""A tool-use environment: arithmetic word problems with a calculator the model calls in its replies.

The model reads a word problem ("Mia has 37 shells. Then Mia finds 48 shells. Mia gives 19 shells to a friend. How
many ...?") and may reply with a call, `<calc>37+48-19</calc>`; the environment answers with the result, as a
message of its own ("calculator: 66"), and the model replies again. The first reply without a call is the answer:
its first integer is compared with the record's reference, reward 1 when equal, and the episode ends. So one
episode is either one turn (an answer from the model's own arithmetic) or two or more (calls, then an answer), and
the mean number of turns says how often the model uses the tool.

`calculate` evaluates only arithmetic (integers, + - * /, parentheses, unary minus) by walking Python's syntax
tree, never `eval`: a reply is model output, which may hold anything.
"""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction
from typing import Optional, Union

from megatron_rl.environments.guess import first_integer

CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
MAX_EXPRESSION = 80  # characters: longer calls are refused ("calculator: error") rather than evaluated
MAX_CALLS = 3  # calls per episode; the next reply after them must answer
INSTRUCTION = ("Use the calculator for arithmetic: reply with <calc>expression</calc> and wait for its result. "
               "Then reply with the final answer as a single number.")

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> Optional[Union[int, Fraction]]:
    """The value of an arithmetic expression (an int, or a Fraction when a division leaves one), None when it is not
    one: anything but integers, + - * /, parentheses and unary minus, a division by zero, or longer than
    MAX_EXPRESSION characters."""
    text = expression.strip()
    if not text or len(text) > MAX_EXPRESSION:
        return None
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        return None

    def value(node) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("not arithmetic")

    try:
        v = value(tree.body)
    except (ValueError, ZeroDivisionError):
        return None
    return int(v) if v.denominator == 1 else v


def show(v: Union[int, Fraction]) -> str:
    """How the calculator writes a value: an integer as it is, a fraction as a decimal of up to 4 places."""
    if isinstance(v, int):
        return str(v)
    return f"{float(v):.4f}".rstrip("0").rstrip(".")


def call_text(expression: str) -> str:
    """A reply that calls the calculator on `expression`."""
    return f"<calc>{expression}</calc>"


def result_message(expression: str) -> str:
    """The environment's answer to a call of `expression`."""
    v = calculate(expression)
    return f"calculator: {'error' if v is None else show(v)}"


def result_value(message: str) -> str:
    """The value a `result_message` shows ("66" from "calculator: 66")."""
    return message.split(": ", 1)[1]


class Calculator:
    """One word problem (`record["prompt"]`, answer `record["reference"]`) with a calculator: see the module
    docstring. Deterministic: `seed` is not used."""

    def __init__(self, record: dict, seed: int):
        self.prompt = f"{record['prompt']} {INSTRUCTION}"
        self.answer = int(record["reference"])
        self.calls = 0

    def reset(self) -> str:
        return self.prompt

    def step(self, response: str) -> tuple[Optional[dict], float, bool]:
        call = CALL.search(response)
        if call is not None and self.calls < MAX_CALLS:
            self.calls += 1
            return {"role": "user", "content": result_message(call.group(1))}, 0.0, False
        if call is not None:  # out of calls: the episode ends unanswered
            return None, 0.0, True
        return None, float(first_integer(response) == self.answer), True

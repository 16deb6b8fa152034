"""The built-in tool-use task as an agent on the OpenAI client: word problems with a calculator the model calls as a
function tool, `calculator(expression)`, through OpenAI's `tools` and `tool_calls` (the environment twin,
`environments/calculator.py`, reads `<calc>...</calc>` out of the reply text instead).

    megatron-rl train -c configs/smollm2-calculator-agent.yaml

The agent sends the problem with the tool; a reply with tool calls gets each call's result as a `tool` message (the
calculator evaluates arithmetic only, never `eval`), and the first reply without one is the answer: reward 1 when
its first integer is the record's reference. At most MAX_CALLS calls; the next reply must answer.
"""

from __future__ import annotations

import json

from megatron_rl.environments.calculator import MAX_CALLS, calculate, show
from megatron_rl.environments.guess import first_integer

INSTRUCTION = "Use the calculator tool for arithmetic. Then reply with the final answer as a single number."
TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "The value of an arithmetic expression: integers, + - * /, parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def question(record: dict) -> dict:
    """The agent's first message."""
    return {"role": "user", "content": f"{record['prompt']} {INSTRUCTION}"}


def call_text(expression: str) -> str:
    """A call of the tool as the model writes it (the Hermes form `serving/tool_calls.py` reads, and what the tool
    description asks a template without tools for)."""
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


def result(arguments: str) -> str:
    """The tool's answer to a call's arguments (a JSON object with "expression"): the value, or "error"."""
    try:
        expression = json.loads(arguments).get("expression", "")
    except (ValueError, AttributeError):
        return "error"
    v = calculate(expression) if isinstance(expression, str) else None
    return "error" if v is None else show(v)


def solve(record: dict, seed: int, client) -> float:
    messages = [question(record)]
    for _ in range(MAX_CALLS + 1):
        r = client.chat.completions.create(model="policy", messages=messages, tools=[TOOL])
        if (r.model_extra or {}).get("episode_done"):
            return 0.0
        msg = r.choices[0].message
        if not msg.tool_calls:
            return float(first_integer(msg.content or "") == int(record["reference"]))
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result(call.function.arguments)})
    return 0.0

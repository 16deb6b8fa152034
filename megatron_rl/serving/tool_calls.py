"""Tool calls read out of a model's generated text, for the families we ship.

- Hermes / Qwen2.5 / Qwen3 (and what `tokenizers/turns.py` asks a template without tools for):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call, text around them is the content.
- Llama 3.1 / 3.2 JSON calls: the whole reply is one JSON object `{"name": ..., "parameters": {...}}` (or
  `"arguments"`), optionally after `<|python_tag|>`; several calls separated by `;`.

A reply that looks like neither is plain content. A block that names no tool or whose arguments are not a JSON
object is left in the content, not turned into a call: the agent sees what the model wrote. Ids are given by the
caller (deterministic per episode and turn, so that a replayed agent sees the same ids).
"""

from __future__ import annotations

import json
import re
from typing import Optional

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def _call(obj) -> Optional[tuple[str, str]]:
    """(name, arguments as a JSON string) of one parsed call object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_tool_calls(text: str) -> tuple[Optional[str], list[tuple[str, str]]]:
    """(the content left, [(tool name, arguments JSON)]) of a generated reply; the content is None when the reply
    is only calls."""
    calls, kept, at = [], [], 0
    for m in _HERMES.finditer(text):
        call = _call(_json(m.group(1)))
        if call is None:
            continue
        kept.append(text[at:m.start()])
        at = m.end()
        calls.append(call)
    if calls:
        kept.append(text[at:])
        content = "".join(kept).strip()
        return content or None, calls
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if body.startswith("{"):
        parts = [_call(_json(p)) for p in body.split(";")] if ";" in body else [_call(_json(body))]
        if parts and all(p is not None for p in parts):
            return None, parts
    return text, []


def openai_tool_calls(calls: list[tuple[str, str]], id_prefix: str) -> list[dict]:
    """The calls as the `tool_calls` of an OpenAI assistant message."""
    return [{"id": f"{id_prefix}_{k}", "type": "function", "function": {"name": n, "arguments": a}}
            for k, (n, a) in enumerate(calls)]

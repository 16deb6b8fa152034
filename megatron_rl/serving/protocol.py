"""The OpenAI API's request and response bodies, as far as the endpoint serves them: chat completions, text
completions, the model list, errors. Plain dicts in, plain dicts out; no HTTP here (`serving/server.py`).

Every completion also carries the ids it was sampled with, as Megatron-LM's RL endpoint returns them:
`prompt_token_ids` (what the model read), `generation_token_ids` (what it sampled) and `generation_log_probs` (each
sampled token's behaviour log-prob, log softmax(logits / T), the quantity the trainer's correction uses). An
OpenAI client reads them from the response's extra fields (`response.model_extra`, or as attributes).

What is refused, with a 400 and one line: streaming, n > 1, a message of an unknown role, content that is not text.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Optional

from megatron_rl.serving.tool_calls import openai_tool_calls, parse_tool_calls

ROLES = ("system", "developer", "user", "assistant", "tool")
_ids = itertools.count()


class ProtocolError(Exception):
    """A request the endpoint refuses: the HTTP status and one line for the client."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.code = status, code


def error_body(message: str, code: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": code, "param": None, "code": code}}


def _text(content, where: str) -> str:
    """A message's content as text: a str, None (an assistant's tool call), or a list of {"type": "text"} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ProtocolError(400, f"{where}.content must be text (a string or a list of text parts)")


def normalize_message(m, where: str) -> dict:
    """A request's message as the chat template renders it: role, text content, and an assistant's tool calls
    (name and arguments only) or a tool result's id."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise ProtocolError(400, f"{where} must be an object with a role in {', '.join(ROLES)}")
    role = "system" if m["role"] == "developer" else m["role"]
    out = {"role": role, "content": _text(m.get("content"), where)}
    if role == "assistant" and m.get("tool_calls"):
        calls = m["tool_calls"]
        if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                  for c in calls):
            raise ProtocolError(400, f"{where}.tool_calls must be a list of function calls")
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"].get("name"),
                                           "arguments": c["function"].get("arguments")}} for c in calls]
    if role == "tool" and m.get("tool_call_id") is not None:
        out["tool_call_id"] = str(m["tool_call_id"])
    return out


@dataclass
class Sampling:
    """A request's sampling fields (None where it sets none), honoured where the server samples as asked (`serve`;
    a training run samples with its own settings), and whether it asks for per-token log-probs."""

    max_tokens: Optional[int]
    temperature: Optional[float]
    top_p: Optional[float]
    seed: Optional[int]
    logprobs: bool

    @classmethod
    def of(cls, body: dict, logprobs: bool) -> "Sampling":
        def number(key, kind, check, what):
            v = body.get(key)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, kind) or not check(v):
                raise ProtocolError(400, f"{key}={v!r} must be {what}")
            return v

        max_tokens = number("max_completion_tokens", int, lambda v: v >= 1, "an integer >= 1")
        if max_tokens is None:
            max_tokens = number("max_tokens", int, lambda v: v >= 1, "an integer >= 1")
        return cls(max_tokens, number("temperature", (int, float), lambda v: 0 <= v <= 2, "in [0, 2]"),
                   number("top_p", (int, float), lambda v: 0 < v <= 1, "in (0, 1]"),
                   number("seed", int, lambda v: 0 <= v < 2**63, "an integer in [0, 2**63)"), logprobs)


def _body(body) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError(400, "the body must be a JSON object")
    if body.get("stream"):
        raise ProtocolError(400, "stream=true is not supported: send the request without it")
    if body.get("n", 1) != 1:
        raise ProtocolError(400, f"n={body.get('n')!r}: one choice per request (send n requests)")
    return body


@dataclass
class ChatRequest:
    """A chat completion's body: its messages (`normalize_message`), the tools to render, its sampling."""

    messages: list[dict]
    tools: Optional[list]
    sampling: Sampling

    @classmethod
    def parse(cls, body) -> "ChatRequest":
        body = _body(body)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ProtocolError(400, "messages must be a non-empty list")
        tools = body.get("tools") or None
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise ProtocolError(400, "tools must be a list of tool objects")
        if body.get("tool_choice") == "none":
            tools = None
        return cls([normalize_message(m, f"messages[{i}]") for i, m in enumerate(msgs)], tools,
                   Sampling.of(body, bool(body.get("logprobs"))))


@dataclass
class CompletionRequest:
    """A text completion's body: the prompt as text or as token ids (then nothing is tokenized), its sampling."""

    prompt: object  # str or list[int]
    sampling: Sampling
    tools = None

    @classmethod
    def parse(cls, body) -> "CompletionRequest":
        body = _body(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        ok = (isinstance(prompt, str) and prompt) or (isinstance(prompt, list) and prompt and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in prompt))
        if not ok:
            raise ProtocolError(400, "prompt must be a non-empty string or a list of token ids")
        return cls(prompt, Sampling.of(body, body.get("logprobs") not in (None, False, 0)))


# ---- responses ------------------------------------------------------------------------------------------------------
def _finish(reason: str, calls: list) -> str:
    if calls:
        return "tool_calls"
    return "stop" if reason in ("stop", "done") else "length"


def _usage(prompt_ids: list, token_ids: list) -> dict:
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(token_ids),
            "total_tokens": len(prompt_ids) + len(token_ids)}


def chat_body(model: str, prompt_ids: list, token_ids: list, logprobs: list, reason: str, content: Optional[str],
              tool_calls: list, token_texts: Optional[list] = None) -> dict:
    """A chat completion: the assistant's message (content and tool calls), why it ended, and the ids and log-probs
    it was sampled with; `token_texts` (each token's text) adds OpenAI's per-token `logprobs.content`."""
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    lp = None
    if token_texts is not None:
        lp = {"content": [{"token": t, "logprob": float(p), "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                          for t, p in zip(token_texts, logprobs)]}
    return {"id": f"chatcmpl-{next(_ids)}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "logprobs": lp,
                                         "finish_reason": _finish(reason, tool_calls)}],
            "usage": _usage(prompt_ids, token_ids), "prompt_token_ids": list(prompt_ids),
            "generation_token_ids": list(token_ids), "generation_log_probs": [float(p) for p in logprobs]}


def completion_body(model: str, prompt_ids: list, token_ids: list, logprobs: list, reason: str, text: str,
                    token_texts: Optional[list] = None) -> dict:
    lp = None
    if token_texts is not None:
        offsets = list(itertools.accumulate((len(t) for t in token_texts[:-1]), initial=0)) if token_texts else []
        lp = {"tokens": token_texts, "token_logprobs": [float(p) for p in logprobs], "top_logprobs": None,
              "text_offset": offsets}
    return {"id": f"cmpl-{next(_ids)}", "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": _finish(reason, [])}],
            "usage": _usage(prompt_ids, token_ids), "prompt_token_ids": list(prompt_ids),
            "generation_token_ids": list(token_ids), "generation_log_probs": [float(p) for p in logprobs]}


def models_body(model: str) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "megatron-rl"}]}


def reply_body(model: str, tok, kind: str, req, prompt_ids: list, token_ids: list, logprobs: list, finish: str,
               call_prefix: str) -> dict:
    """The response to `req` (a ChatRequest or CompletionRequest) of a sampled reply: its text without the stop
    token (which stays in the ids), an assistant's tool calls parsed where the request gave tools (ids
    `call_prefix`_k), per-token logprobs where asked."""
    shown = token_ids[:-1] if token_ids and token_ids[-1] in tok.stop_ids else token_ids
    text = tok.decode(shown)
    texts = [tok.decode([t]) for t in token_ids] if req.sampling.logprobs else None
    if kind == "completion":
        return completion_body(model, prompt_ids, token_ids, logprobs, finish, text, texts)
    content, calls = parse_tool_calls(text) if req.tools else (text, [])
    return chat_body(model, prompt_ids, token_ids, logprobs, finish, content, openai_tool_calls(calls, call_prefix),
                     texts)

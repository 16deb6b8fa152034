"""A conversation's token ids rendered one turn at a time, so that nothing sampled is ever decoded and encoded again.

An episode's (or an agent's) tokens are the first prompt's ids, then each reply's sampled ids, then the ids of the
messages that answer it, rendered alone, then the next reply's, and so on. Rendering the whole conversation again
at every turn would re-tokenize the replies, and decode-then-encode is not the identity (a reply that ends inside a
multi-byte character, a merge across the reply's boundary, a template that strips whitespace): the trainer would
then learn from ids the generator never sampled. `TurnTemplate` renders only what is new.

Tools (an OpenAI `tools` list) are rendered by the model's chat template where it renders them; where it does not
(the fallback formats, a template that ignores them), a system message describes them and asks for Hermes-style
calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), the form `serving/tool_calls.py` parses first.
"""

from __future__ import annotations

import json
from typing import Optional

# What an episode's observation looks like with a tokenizer that has no chat template (the tiny model's bytes):
# the message on a line of its own after the reply's stop token.
PLAIN_SEPARATOR = "\n"


def tools_message(tools: list) -> dict:
    """A system message describing `tools` (OpenAI's function-tool dicts: each one's name, description and
    parameters, whatever else a client adds) for a template that cannot render them."""
    described = "\n".join(json.dumps({k: v for k, v in t.get("function", t).items()
                                      if k in ("name", "description", "parameters")}, sort_keys=True) for t in tools)
    return {"role": "system", "content": "You may call these tools:\n" + described + "\nTo call one, reply with "
            "<tool_call>{\"name\": <tool name>, \"arguments\": <its arguments as an object>}</tool_call>."}


class TurnTemplate:
    """The token ids of one turn of a conversation, rendered alone: the first messages (the prompt, as the chat
    template wraps prompts, with the tools), and each later run of messages (a user's, a tool's) as the template
    renders new turns after the assistant's reply, from the reply's stop token on. Without a chat template
    (`chat=False`), plain text: the messages' contents, each later one after PLAIN_SEPARATOR."""

    def __init__(self, tokenizer, chat: bool):
        self.tok, self.chat = tokenizer, chat
        self._turn_start: Optional[tuple[list, str, int]] = None  # (the conversation before, its text, the cut)

    def prompt(self, message, tools: Optional[list] = None) -> list[int]:
        """The ids of a conversation's first messages (one message dict, or a list), ready for the reply."""
        messages = [message] if isinstance(message, dict) else list(message)
        if self.chat:
            return self.tok.encode(self._render(messages, tools), add_bos=False)
        if tools:
            messages = [tools_message(tools)] + messages
        return self.tok.encode(PLAIN_SEPARATOR.join(m["content"] for m in messages),
                               add_bos=self.tok.bos_id is not None)

    def observation(self, message) -> list[int]:
        """The ids of the messages that follow an assistant's reply (one message dict, or a list)."""
        messages = [message] if isinstance(message, dict) else list(message)
        return self.tok.encode(self._observation_text(messages), add_bos=False)

    def _render(self, messages: list, tools: Optional[list]) -> str:
        if not tools:
            return self.tok.apply_chat_template(messages, add_generation_prompt=True)
        with_tools = self.tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        if with_tools != self.tok.apply_chat_template(messages, add_generation_prompt=True):
            return with_tools
        return self.tok.apply_chat_template([tools_message(tools)] + messages, add_generation_prompt=True)

    def _observation_text(self, messages: list) -> str:
        if not self.chat:
            return "".join(PLAIN_SEPARATOR + m["content"] for m in messages)
        # The template's text for the new turns: a conversation with and without them, cut after the assistant's
        # end-of-turn marker (the reply's stop token, which the generator has already sampled).
        before, base, cut = self._turn_start or self._find_turn_start()
        full = self.tok.apply_chat_template(before + messages, add_generation_prompt=True)
        if not full.startswith(base):
            raise ValueError("the chat template renders an earlier turn differently once a turn follows it: its "
                             "turns cannot be rendered one at a time")
        return full[cut:]

    def _find_turn_start(self) -> tuple[list, str, int]:
        """A conversation of one exchange, its text, and where in it a following turn's text starts (after the
        assistant's end-of-turn marker): found once per template."""
        before = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        base = self.tok.apply_chat_template(before, add_generation_prompt=False)
        cut = base.rfind("a") + 1
        for stop in sorted({self.tok.decode([i], skip_special_tokens=False) for i in self.tok.stop_ids}, key=len,
                           reverse=True):
            at = base.find(stop, cut) if stop else -1
            if at >= 0:
                cut = at + len(stop)
                break
        self._turn_start = (before, base, cut)
        return self._turn_start

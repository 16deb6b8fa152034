"""Agent functions for the agent tests (imported by agent worker processes as `agent_cases:NAME`). Each plays a
counting game through the OpenAI client: the prompt, then after each reply a tool message naming the turn, for
`record["turns"]` replies; `record["how"]` says how to misbehave."""

import os
import time


def counting(record, seed, client):
    how = record.get("how", "ok")
    if how == "no-request":
        return 0.5
    messages = [{"role": "user", "content": record["prompt"]}]
    seen = []
    for turn in range(record.get("turns", 2)):
        r = client.chat.completions.create(model="policy", messages=messages, logprobs=True)
        extra = r.model_extra
        if extra.get("episode_done"):
            break
        seen.append((extra["prompt_token_ids"], extra["generation_token_ids"], extra["generation_log_probs"]))
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        if how == "rewrite" and turn == 0:
            messages[0] = {"role": "user", "content": "something else"}
        messages.append({"role": "tool", "content": f"turn {turn}"})
        if how == "raise" and turn == 0:
            raise RuntimeError("the agent broke")
        if how == "hang" and turn == 0:
            time.sleep(3600)
        if how == "die" and turn == 0:
            os._exit(3)
    record_seen(record, seen)
    if how == "ill-typed":
        return "a lot"
    if how == "rewrite":
        return 9.0
    return [0.25] * len(seen)


def record_seen(record, seen):
    """What the endpoint returned, written beside the test (the agent runs in another process)."""
    path = record.get("out")
    if path:
        import json

        with open(path, "w") as f:
            json.dump(seen, f)


async def async_counting(record, seed, client):
    messages = [{"role": "user", "content": record["prompt"]}]
    r = await client.chat.completions.create(model="policy", messages=messages)
    return 1.0 if r.choices[0].message is not None else 0.0


class NotAFunction:
    pass


def wrong_arity(record):
    return 0.0


def always_raises(record, seed, client):
    """Asks once, prints, then raises: every episode fails."""
    r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": record["prompt"]}])
    print("agent noise on stdout", r.choices[0].finish_reason)
    raise ValueError("the agent gave up")

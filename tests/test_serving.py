"""The OpenAI-compatible endpoint (`serving/`), asked by the real `openai` client: chat and text completions carry the
ids and log-probs they were sampled with, equal to the generator's own for the same prompt and seed (and to a
teacher-forced score of those ids); tools are rendered (by a template that knows them, or in a system message) and
tool calls parsed; a request without the run's key, a stream, n > 1 and a prompt that does not fit are refused with
one line each; an `async def` agent gets an AsyncOpenAI client; `megatron-rl serve` answers over a checkpoint."""

import pytest

from megatron_rl.launch.spawn import run_local
from megatron_rl.serving.tool_calls import parse_tool_calls

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")


def _chats(url, key):
    import openai

    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
    out, replay = {}, []
    out["models"] = [m.id for m in client.models.list().data]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model="tiny-test", messages=messages, seed=7, temperature=1.0, top_p=0.9,
                                       max_tokens=12, logprobs=True)
    extra = r.model_extra
    out["chat"] = (r.choices[0].message.content, r.choices[0].finish_reason, extra["prompt_token_ids"],
                   extra["generation_token_ids"], extra["generation_log_probs"],
                   [c.logprob for c in r.choices[0].logprobs.content], r.usage.completion_tokens)
    replay.append((extra["prompt_token_ids"], extra["generation_token_ids"], 1.0, 7, 0.9, 12))
    g = client.completions.create(model="tiny-test", prompt=[257, 104, 105], max_tokens=10, temperature=0)
    out["greedy"] = (g.choices[0].text, g.model_extra["prompt_token_ids"], g.model_extra["generation_token_ids"],
                     g.model_extra["generation_log_probs"])
    replay.append(([257, 104, 105], g.model_extra["generation_token_ids"], 0.0, None, 1.0, 10))
    tools = [{"type": "function", "function": {"name": "add", "description": "add two numbers",
                                                "parameters": {"type": "object", "properties": {}}}}]
    t = client.chat.completions.create(model="tiny-test", messages=messages, tools=tools, seed=7, max_tokens=12,
                                       temperature=1.0, top_p=0.9)
    out["tools_prompt"] = t.model_extra["prompt_token_ids"]
    errors = {}
    for name, call in [
        ("key", lambda: openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()),
        ("stream", lambda: client.chat.completions.create(model="m", messages=messages, stream=True)),
        ("n", lambda: client.chat.completions.create(model="m", messages=messages, n=2)),
        ("long", lambda: client.completions.create(model="m", prompt="x" * 400, max_tokens=4)),
        ("role", lambda: client.chat.completions.create(model="m", messages=[{"role": "robot", "content": "x"}])),
    ]:
        try:
            call()
            errors[name] = None
        except openai.APIStatusError as e:
            errors[name] = (e.status_code, str(e.body["message"] if isinstance(e.body, dict) else e.body))
    out["errors"] = errors
    out["replay"] = replay
    from agent_cases import async_counting
    from megatron_rl.agents.workers import _run_agent

    out["async"] = _run_agent(async_counting, {"prompt": "hi"}, 0, url, key)  # an async agent gets an AsyncOpenAI
    return out


def test_the_openai_client_gets_the_generators_own_ids_and_log_probs(tiny_hf):
    _, cfg, full = tiny_hf
    got = run_local(_serve, 1, cfg, full)[0]
    assert "error" not in got, got.get("error")
    seen, refs = got["result"], got["refs"]
    assert seen["models"] == ["tiny-test"]
    content, finish, prompt, ids, lps, per_token, n = seen["chat"]
    assert prompt == [257] + list(b"be brief\nhello")  # no template: the contents on lines of their own
    assert n == len(ids) and len(per_token) == len(ids) and per_token == pytest.approx(lps)
    (ref_ids, ref_lps, forced), (g_ids, g_lps, g_forced) = refs
    assert ids == ref_ids and lps == ref_lps  # the generator's own tokens for this prompt and seed, bit for bit
    assert lps == pytest.approx(forced, abs=1e-5)  # and the teacher-forced score of them
    assert finish in ("stop", "length")
    text, g_prompt, greedy_ids, greedy_lps = seen["greedy"]
    assert g_prompt == [257, 104, 105] and greedy_ids == g_ids and greedy_lps == g_lps
    assert greedy_lps == pytest.approx(g_forced, abs=1e-5)
    # Tools the template cannot render are described in a system message before the conversation.
    assert len(seen["tools_prompt"]) > len(prompt) and bytes(seen["tools_prompt"][1:]).decode().startswith(
        "You may call these tools:")
    errors = seen["errors"]
    assert errors["key"][0] == 401
    assert errors["stream"][0] == 400 and "stream" in errors["stream"][1]
    assert errors["n"][0] == 400 and "one choice" in errors["n"][1]
    assert errors["long"][0] == 400
    assert errors["role"][0] == 400 and "role" in errors["role"][1]
    assert seen["async"] == 1.0


def _serve(rank, world_size, cfg, full):
    from serving_workers import serve_worker

    return serve_worker(rank, world_size, cfg, full, _chats)


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', None,
     [("add", '{"a": 1, "b": 2}')]),
    ('Let me add. <tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', "Let me add.",
     [("add", '{"a": 1}')]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', None,
     [("a", "{}"), ("b", '{"x": 1}')]),
    ('<tool_call>{"arguments": {}}</tool_call> no name', '<tool_call>{"arguments": {}}</tool_call> no name', []),
    ("{not json", "{not json", []),
    ("12 + 3 = 15", "12 + 3 = 15", []),
], ids=["hermes", "hermes-in-text", "llama-json", "llama-python-tag", "no-name", "bad-json", "plain"])
def test_tool_calls_are_read_from_the_families_formats(text, content, calls):
    assert parse_tool_calls(text) == (content, calls)


def test_serve_answers_the_openai_client_over_a_checkpoint_until_stopped(tmp_path):
    """`megatron-rl serve CKPT` (a small random Llama converted to a checkpoint, the byte tokenizer): the address and
    key on one line, the `openai` client's chat completion answered greedily as the checkpoint's own generator
    decodes it, SIGTERM ends it with the summary (exit 0), and a taken port is one line."""
    import json
    import os
    import re
    import signal
    import socket
    import subprocess
    import sys

    import torch

    from megatron_rl.checkpointing.convert import convert
    from tiny_hf import save_tiny_llama

    hf = save_tiny_llama(tmp_path / "hf", seed=1)
    convert(tmp_path / "hf", tmp_path / "ckpt", to="megatron")
    cmd = [sys.executable, "-m", "megatron_rl.cli", "serve", str(tmp_path / "ckpt"), "--tokenizer", "byte",
           "--key", "k", "--max-tokens", "6"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = subprocess.run([*cmd, "--port", str(taken.getsockname()[1])], capture_output=True, text=True)
    assert busy.returncode == 2 and busy.stderr.strip().count("\n") == 0 and "cannot listen on" in busy.stderr
    proc = subprocess.Popen([*cmd, "--port", "0"], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = None
        for line in proc.stderr:
            m = re.search(r"at (http://127\.0\.0\.1:\d+/v1) \(model", line)
            if m:
                url = m.group(1)
                break
        assert url is not None
        client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
        r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], temperature=0)
        prompt, ids = r.model_extra["prompt_token_ids"], r.model_extra["generation_token_ids"]
        assert prompt == [257] + list(b"hi") and 1 <= len(ids) <= 6
        greedy = []
        with torch.no_grad():  # transformers' greedy decoding of the same prompt
            while len(greedy) < len(ids):
                greedy.append(int(hf(torch.tensor([prompt + greedy])).logits[0, -1].argmax()))
        assert ids == greedy
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert json.loads(out)["served"] == 1


QWEN_LIKE = (  # Qwen2.5's shape: tools in a system turn, tool results as <tool_response> user turns, calls as blocks
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}"
    "</tool_response><|im_end|>\n{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_renders_tools_renders_them_and_tool_results_as_new_turns(tmp_path):
    """With a chat template that knows tools, the prompt is the template's own rendering with them; a tool result
    after a reply is the template's text of that new turn alone (what follows the reply's end-of-turn token in the
    whole conversation rendered), and a reply's tool-call block comes back as a call."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from megatron_rl.tokenizers import load_tokenizer
    from megatron_rl.tokenizers.turns import TurnTemplate

    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator([f"what is {i} plus {i}? add tool response system user" for i in range(100)],
                            trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = QWEN_LIKE
    fast.save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    template = TurnTemplate(tok, chat=True)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    user = {"role": "user", "content": "what is 2 plus 2?"}
    prompt = template.prompt([user], tools)
    assert tok.decode(prompt, skip_special_tokens=False) == (
        "<|im_start|>system\nTools: add<|im_end|>\n<|im_start|>user\nwhat is 2 plus 2?<|im_end|>\n"
        "<|im_start|>assistant\n")
    result = {"role": "tool", "content": "4"}
    obs = template.observation([result])
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": "{}"}}]}
    whole = tok.apply_chat_template([user, call, result], add_generation_prompt=True, tools=tools)
    assert whole.endswith(tok.decode(obs, skip_special_tokens=False))
    assert tok.decode(obs, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>4</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>') == (
        None, [("add", '{"a": 2, "b": 2}')])

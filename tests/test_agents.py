"""Agent episodes (`env.agent`, `agents/`) on a generator replica, through the job's own `Agents` and the real `openai`
client: the ids an episode trains on are exactly the ids each response returned and the ids of the messages between
them, though decoding the replies and encoding them again gives other ids; an agent that raises, returns something
that is not a reward, hangs, kills its process, makes no request or rewrites its conversation ends its episode with
one line (or its reward), and the other episodes are unaffected."""

import json

import pytest

from megatron_rl.launch.spawn import run_local
from megatron_rl.tokenizers.byte import ByteTokenizer

pytest.importorskip("transformers")
pytest.importorskip("openai")

CASES = [("count:", {"turns": 2}), ("count:", {"how": "raise"}), ("count:", {"how": "ill-typed"}),
         ("count:", {"how": "hang"}), ("count:", {"how": "die"}), ("count:", {"how": "no-request"}),
         ("count:", {"how": "rewrite"}), ("count:", {"turns": 5})]


def _agents(rank, world_size, cfg, full, out_dir):
    from serving_workers import agents_worker

    return agents_worker(rank, world_size, cfg, full, CASES, 3.0, out_dir)


def test_agent_episodes_train_on_the_endpoints_ids_and_each_failure_is_one_line(tiny_hf, tmp_path):
    _, cfg, full = tiny_hf
    outs, returns, stats, errors = run_local(_agents, 1, cfg, full, str(tmp_path))[0]
    tok = ByteTokenizer()
    # The well-behaved episodes: the output is the first response's prompt, then each reply's sampled ids and the
    # tool message's ids (plain turns: the message on a line of its own), with the sampled log-probs.
    retokenized = 0
    for i, turns in ((0, 2), (7, 3)):  # the second asks for 5 turns; the job ends it at env.max_turns=3
        finish, prompt, ids, logprobs, mask, n_turns = outs[i]
        seen = json.loads((tmp_path / f"seen{i}.json").read_text())
        assert len(seen) == turns and n_turns == turns and errors[i] is None, errors
        assert prompt == seen[0][0] == [tok.bos_id] + list(b"count:")
        expect, lps, policy = [], [], []
        for t, (p, gen_ids, gen_lps) in enumerate(seen):
            assert p == prompt + expect  # each request's prompt ids are everything the model has read and written
            expect += gen_ids
            lps += gen_lps
            policy += [True] * len(gen_ids)
            retokenized += tok.encode(tok.decode(gen_ids)) != gen_ids
            if t < turns - 1 or i == 0:
                obs = list(f"\nturn {t}".encode())
                expect, lps, policy = expect + obs, lps + [0.0] * len(obs), policy + [False] * len(obs)
        if i == 0:  # the agent ended the episode: its last message is never read
            expect, lps, policy = expect[:-len(b"\nturn 1")], lps[:-7], policy[:-7]
        assert ids == expect and logprobs == lps and mask == policy
        assert finish == ("done" if i == 0 else "turns")
    assert retokenized >= 1  # decode-then-encode is not the identity for these replies: re-tokenizing would show
    assert returns[0] == 0.5 and returns[7] == 0.75  # the agent's per-turn rewards, summed
    assert "RuntimeError: the agent broke" in errors[1] and returns[1] == 0.0
    assert "returned 'a lot', expected a finite number" in errors[2] and returns[2] == 0.0
    assert "did not return within env.timeout_s=3 s" in errors[3] and returns[3] == 0.0
    assert "worker died (exit code 3)" in errors[4] and returns[4] == 0.0
    assert errors[5] is None and returns[5] == 0.5 and outs[5][2] == []  # returned before any request
    assert "does not extend the episode's conversation" in errors[6] and returns[6] == 0.0
    assert stats["rewritten"] == 1 and stats["failures"] == 5 and stats["episodes"] == len(CASES)
    log = (tmp_path / "workers.log").read_text()
    assert "RuntimeError: the agent broke" in log and "Traceback" in log  # the tracebacks go to the run's log


@pytest.mark.parametrize("spec", ["megatron_rl.agents.calculator:solve", "examples/agents_sdk_calculator.py:solve"],
                         ids=["openai-client", "openai-agents-sdk"])
def test_a_calculator_agents_requests_extend_the_conversation_as_the_endpoint_returned_it(spec):
    """The built-in calculator agent and the same agent on the OpenAI Agents SDK, against an endpoint whose replies
    are scripted (a tool call, then an answer): each one's second request repeats the first and the reply exactly as
    returned (content None, the call's id, name and arguments) and adds the tool's result, so an episode goes on
    instead of being refused as rewritten; the tool is described as the warm start's demonstrations describe it."""
    from concurrent.futures import Future
    from pathlib import Path

    from megatron_rl.agents.calculator import TOOL
    from megatron_rl.agents.play import _after
    from megatron_rl.agents.workers import _run_agent
    from megatron_rl.rewards.workers import resolve_function
    from megatron_rl.serving.protocol import ChatRequest, chat_body, normalize_message
    from megatron_rl.serving.server import Endpoint
    from megatron_rl.tokenizers.turns import tools_message

    if "sdk" in spec:
        pytest.importorskip("agents")
    seen, state = [], {}
    call = {"id": "call_3_0_0", "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}

    def handler(kind, body):
        req = ChatRequest.parse(body)
        seen.append(req)
        if len(seen) == 1:
            reply = chat_body("policy", [1, 2], [3], [-0.5], "stop", None, [call])
            state["known"] = req.messages + [normalize_message(reply["choices"][0]["message"], "reply")]
        else:
            state["new"] = _after(state["known"], req.messages)
            reply = chat_body("policy", [1, 2, 3, 4], [5], [-0.5], "stop", "The answer is 5.", [])
        fut = Future()
        fut.set_result(reply)
        return fut

    endpoint = Endpoint("policy", "k").start()
    endpoint.open_session("s", handler)
    try:
        module, _, name = spec.rpartition(":")
        fn = resolve_function(f"{Path(__file__).resolve().parents[1] / module}:{name}" if module.endswith(".py")
                              else spec)
        reward = _run_agent(fn, {"prompt": "What is 2 + 3?", "reference": "5"}, 0, endpoint.session_url("s"), "k")
    finally:
        endpoint.close()
    assert reward == 1.0 and len(seen) == 2
    assert state["new"] == [{"role": "tool", "content": "5", "tool_call_id": "call_3_0_0"}]
    assert tools_message(seen[0].tools) == tools_message([TOOL])

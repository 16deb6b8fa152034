"""Agent episodes (`env.agent`, `agents/`) on a generator replica, through the job's own `Agents` and the real `openai`
client: the ids an episode trains on are exactly the ids each response returned and the ids of the messages between
them, though decoding the replies and encoding them again gives other ids; an agent that raises, returns something
that is not a reward, hangs, kills its process or makes no request ends its episode with one line (or its reward),
and the other episodes are unaffected; one that rewrites its conversation splits its episode into two samples."""

import json

import torch

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
    outs, returns, stats, errors, parts = run_local(_agents, 1, cfg, full, str(tmp_path))[0]
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
    # The agent that rewrote its first message after one reply: the episode is split there. Its first part is the
    # prompt and that reply; its second part starts from the rewritten conversation rendered whole (the earlier
    # reply's text among it, re-tokenized as any rewritten history must be) and holds the reply to it.
    assert errors[6] is None and returns[6] == 9.0 and len(parts[6]) == 1
    seen = json.loads((tmp_path / "seen6.json").read_text())
    (p0, t0, lp0, m0), (p1, t1, lp1, m1, n_turns) = parts[6][0], outs[6][1:]
    assert p0 == seen[0][0] and t0 == seen[0][1] and lp0 == seen[0][2] and all(m0)
    reply0 = tok.decode([t for t in seen[0][1] if t != tok.eos_id])
    assert p1 == seen[1][0] == [tok.bos_id] + list(f"something else\n{reply0}\nturn 0".encode())
    assert t1 == seen[1][1] and lp1 == seen[1][2] and all(m1) and n_turns == 2
    assert stats["rewritten"] == 1 and stats["failures"] == 4 and stats["episodes"] == len(CASES)
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
    from megatron_rl.sandbox import resolve
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
        fn = resolve(f"{Path(__file__).resolve().parents[1] / module}:{name}" if module.endswith(".py")
                              else spec)
        reward = _run_agent(fn, {"prompt": "What is 2 + 3?", "reference": "5"}, 0, endpoint.session_url("s"), "k")
    finally:
        endpoint.close()
    assert reward == 1.0 and len(seen) == 2
    assert state["new"] == [{"role": "tool", "content": "5", "tool_call_id": "call_3_0_0"}]
    assert tools_message(seen[0].tools) == tools_message([TOOL])


def test_an_episode_split_into_parts_counts_once_in_its_group_and_each_part_takes_its_advantage():
    from megatron_rl.algorithms.advantages import compute_advantages
    from megatron_rl.controller.collector import batch_with_advantages
    from megatron_rl.controller.scoring import split_parts
    from megatron_rl.controller.scoring import ScoredRollouts
    from megatron_rl.inference import SampledResponse

    def out(ids, parts=None):
        return SampledResponse(None, 0, [1], ids, [-0.1] * len(ids), "done", policy_mask=[True] * len(ids),
                               parts=parts)

    # Prompt 0: an episode of two parts (return 1) and one of one part (return 0); prompt 1: two episodes.
    outs = [out([5, 6], [out([7]) for _ in range(1)]), out([8]), out([9]), out([10, 11])]
    flat, groups, returns, episode_of = split_parts(outs, [0, 0, 1, 1], [1.0, 0.0, 0.5, 0.25])
    assert [o.token_ids for o in flat] == [[7], [5, 6], [8], [9], [10, 11]]
    assert groups == [0, 0, 0, 1, 1] and returns == [1.0, 1.0, 0.0, 0.5, 0.25] and episode_of == [1, 1, 2, 3, 4]
    part = ScoredRollouts(0, 0, [o.prompt_ids for o in flat], [o.token_ids for o in flat],
                          [o.logprobs for o in flat], returns, groups, [], 0.0, 0.0, 0.0,
                          policy_masks=[o.policy_mask for o in flat], episode_of=episode_of)
    for estimator in ("group_mean", "rloo", "grpo"):
        got = batch_with_advantages([part], pad_id=0, advantage=estimator).advantages
        want = compute_advantages(torch.tensor([1.0, 0.0, 0.5, 0.25]), torch.tensor([0, 0, 1, 1]), estimator)
        assert torch.allclose(got, want[[0, 0, 1, 2, 3]]), estimator  # the episodes' own, each part its episode's
    assert split_parts(outs[1:], [0, 1, 1], [0.0, 0.5, 0.25])[3] is None  # nothing split: nothing changes


def test_agents_on_a_pipelined_generator_are_one_line():
    """A split episode restarts in its slot through the one-stage engine only: env.agent with generator.pp > 1 is
    refused before any process starts, and eval --agent with --pp > 1 too."""
    from megatron_rl.config import load_config, problems
    from megatron_rl.evaluation.eval import EvalError, EvalSettings, _env_settings

    agent = ["data.dataset=guess-number", "env.agent=megatron_rl.agents.guess:play", "generator.pp=2"]
    assert "env.agent plays on a generator of one pipeline stage: set generator.pp=1" in problems(
        load_config(overrides=agent))[1]
    with pytest.raises(EvalError, match="--agent plays on one pipeline stage"):
        _env_settings(EvalSettings(agent="megatron_rl.agents.guess:play", pp=2), None)

"""The calculator task on the OpenAI Agents SDK (`pip install openai-agents`): an agent written for that framework,
trained by megatron-rl without changing it. The SDK runs the loop (the model's tool calls, the tool, the answer);
megatron-rl gives it the episode's client and trains on what the endpoint sampled.

    megatron-rl train -c configs/smollm2-calculator-agent.yaml env.agent=examples/agents_sdk_calculator.py:solve

The tool is declared with the schema of `megatron_rl/agents/calculator.py`'s, so the prompts, and the warm start's
demonstrations, are the same as the plain client's agent.
"""

from __future__ import annotations

from agents import Agent, FunctionTool, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded

from megatron_rl.agents.calculator import TOOL, question, result
from megatron_rl.environments.calculator import MAX_CALLS
from megatron_rl.environments.guess import first_integer

set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers


async def _calculator(context, arguments: str) -> str:
    return result(arguments)


CALCULATOR = FunctionTool(name=TOOL["function"]["name"], description=TOOL["function"]["description"],
                          params_json_schema=TOOL["function"]["parameters"], on_invoke_tool=_calculator,
                          strict_json_schema=False)


async def solve(record: dict, seed: int, client) -> float:
    agent = Agent(name="solver", tools=[CALCULATOR], model=OpenAIChatCompletionsModel("policy", openai_client=client))
    try:
        out = await Runner.run(agent, question(record)["content"], max_turns=MAX_CALLS + 1)
    except MaxTurnsExceeded:  # calls until the turns ran out: unanswered
        return 0.0
    return float(first_integer(str(out.final_output or "")) == int(record["reference"]))

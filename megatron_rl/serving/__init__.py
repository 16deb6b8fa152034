"""The OpenAI-compatible endpoint on a generator: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, with the
sampled ids and log-probs in every response.

- `protocol.py`: the API's request and response bodies (plain dicts), what is refused, and the reply of a sampled
  sequence (`reply_body`).
- `tool_calls.py`: tool calls read out of generated text (Hermes / Qwen blocks, Llama JSON calls).
- `server.py`: `Endpoint`, aiohttp on a thread of its own, the run's key, handlers per path (an agent episode's
  session, or the whole `/v1`).
- `engine_server.py`: `EngineServer`, requests decoded continuously by a live engine (`megatron-rl serve`, whose
  command is `evaluation/serve.py`).

Nothing is imported here: `engine_server.py` imports torch; the endpoint needs aiohttp only when it starts.
"""

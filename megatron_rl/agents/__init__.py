"""Agents as the rollout (`env.agent=module:function`): the user's agent code, written against the OpenAI API, plays
each episode through an OpenAI client bound to it, and the job trains on exactly the tokens the generator's endpoint
sampled and read.

- `workers.py`: `AgentWorkers`, the agent functions run in worker processes (many episodes at once in each), and
  what an agent must return (`as_reward`); what it must be is checked with the environments' specs
  (`environments/pool.py: agent_problem`), before any process starts.
- `play.py`: `Agents` and `AgentTurns`, agent episodes on a generator replica: its endpoint's sessions
  (`serving/server.py`), the conversation each request must extend, its first and later requests rendered into ids.
- `guess.py`: the built-in guessing game (`environments/guess.py`) played by an agent through the client.

Nothing is imported here: `play.py` imports torch and the environments' machinery.
"""

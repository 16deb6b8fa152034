"""The guessing game (`environments/guess.py: GuessNumber`) played by an agent through the OpenAI client: what a user's
agent looks like, and the check that an agent episode trains on exactly what the environment episode does (the same
records, seeds and replies give the same ids).

    megatron-rl train data.dataset=guess-number env.agent=megatron_rl.agents.guess:play
"""

from __future__ import annotations

from megatron_rl.environments.guess import GuessNumber


def play(record: dict, seed: int, client) -> float:
    """One game: the prompt, then after each reply the game's answer, until it is guessed or the job ends the
    episode (a reply with `episode_done`); returns the game's reward."""
    game = GuessNumber(record, seed)
    messages = [{"role": "user", "content": game.reset()}]
    total = 0.0
    while True:
        r = client.chat.completions.create(model="policy", messages=messages)
        if (r.model_extra or {}).get("episode_done"):
            return total
        reply = r.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": reply})
        answer, reward, done = game.step(reply)
        total += reward
        if done:
            return total
        messages.append({"role": "user", "content": answer})

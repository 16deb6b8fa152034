"""Environment classes for the environment tests (imported by environment worker processes as `env_cases:NAME`)."""

import os
import time


class Counter:
    """Well behaved: counts the model's turns. Each message repeats the replies so far, so a replay that lost or
    reordered one shows; the reward of a turn is the reply's length plus the seed, and the episode ends after
    `record["turns"]` replies."""

    def __init__(self, record, seed):
        self.prompt, self.turns, self.seed = record["prompt"], record.get("turns", 3), seed
        self.replies = []

    def reset(self):
        return self.prompt

    def step(self, response):
        self.replies.append(response)
        done = len(self.replies) >= self.turns
        message = None if done else {"role": "tool", "content": f"turn {len(self.replies)}: {'|'.join(self.replies)}"}
        return message, float(len(response) + self.seed), done


class Misbehaves(Counter):
    """A Counter that misbehaves when told to: in its constructor and `reset` by `record["init"]` /
    `record["reset"]`, in `step` by the reply; anything else behaves."""

    def __init__(self, record, seed):
        super().__init__(record, seed)
        self.reset_does = record.get("reset")
        if record.get("init") == "raise":
            raise KeyError("no such level")

    def reset(self):
        if self.reset_does is not None:
            return misbehave(self.reset_does)
        return super().reset()

    def step(self, response):
        if response in ILL_TYPED:
            return ILL_TYPED[response]
        if response in ("hang", "exit", "raise"):
            return misbehave(response)
        return super().step(response)


def misbehave(how):
    if how == "hang":
        while True:
            time.sleep(60)
    if how == "exit":
        os._exit(3)
    if how == "raise":
        raise RuntimeError("boom\nsecond line")
    return how  # ill-typed results are returned as they are


ILL_TYPED = {  # what `step` returns for a reply; each is an error
    "list": ["hi", 0.0, False],
    "pair": ("hi", 0.0),
    "nothing": None,
    "text reward": ("hi", "1", False),
    "nan reward": ("hi", float("nan"), False),
    "bool reward": ("hi", True, False),
    "int done": ("hi", 0.0, 1),
    "int message": (3, 0.0, False),
    "half dict": ({"role": "tool"}, 0.0, False),
    "silent": (None, 0.0, False),
}


class QuarterAtOnce:
    """Ends every episode after the first reply, with reward 0.25: an episode that is one response. Its first message
    is the record's prompt with its words reversed: not the prompt a single-turn job would show."""

    def __init__(self, record, seed):
        self.prompt = " ".join(reversed(record["prompt"].split()))

    def reset(self):
        return self.prompt

    def step(self, response):
        return None, 0.25, True


class NoStep:
    def __init__(self, record, seed):
        pass

    def reset(self):
        return "hi"


def not_a_class(record, seed):
    return Counter(record, seed)


class BreaksEveryStep:
    """Starts its episodes, then breaks in every `step` as `how` says (raise, return something ill-typed, or kill
    its worker), after printing NOISE lines to its standard output and error and raising a warning: a run must stop
    on it with one line, its noise and tracebacks in the run's workers.log."""

    how = "raise"

    def __init__(self, record, seed):
        self.record = record

    def reset(self):
        return "Guess my number."

    def step(self, response):
        import sys
        import warnings

        for k in range(NOISE):
            print(f"noise {k} on stdout")
            print(f"noise {k} on stderr", file=sys.stderr)
        warnings.warn("a warning from the environment")
        return misbehave({"raise": "raise", "ill-typed": ["hi", 0.0, False], "die": "exit"}[self.how])


NOISE = 200  # lines an environment or reward function writes to each stream per call


class StepIllTyped(BreaksEveryStep):
    how = "ill-typed"


class StepDies(BreaksEveryStep):
    how = "die"


class StepTakesNoReply(Counter):
    """`step` without the reply: the interface's call cannot bind."""

    def step(self):
        return None, 0.0, True

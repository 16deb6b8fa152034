"""What the job learns: prompts for training and evaluation, how a prompt is shown to the model, and its reward.

Two kinds of task, one interface (`Task`):

* `AdditionTask`, the built-in default: two-number addition ("a+b=" -> "a+b" then EOS, a and b drawn from
  [0, max_operand)), no files, byte tokenizer, exact-match reward. It also provides demonstrations, which the job's
  supervised warm start imitates. Its held-out problems are a fixed set of pairs that training never samples.
* `DatasetTask`: prompt records from a dataset (GSM8K, MATH-500, any JSONL with a field mapping), an instruction
  and the tokenizer's chat template around each problem, and a verifier from `megatron_rl.rewards`.
* `GuessTask`, the built-in multi-turn task: hidden numbers found in episodes, against the environment
  `environments/guess.py: GuessNumber` (`env.cls`), which scores them; demonstrations are careless players' games.
* `CalculatorTask`, the built-in tool-use task: word problems solved in episodes with a calculator the model calls
  (`environments/calculator.py: Calculator`); demonstrations use the calculator some of the time.

Every training batch is a pure function of its index, so a resumed run continues on exactly the prompts it would
have seen; nothing about the data position needs saving beyond the step.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from megatron_rl.controller.rundir import worker_log
from megatron_rl.data import (ChatPromptBuilder, DataError, JsonlPromptDataset, PromptRecord, ResumableSampler,
                              load_gsm8k, load_math500)
from megatron_rl.data.datasets import dataset_files
from megatron_rl.data.registry import CALCULATOR, DATASETS, GUESS, dataset_key
from megatron_rl.data.word_problems import WordProblems
from megatron_rl.rewards import get_reward_fn


class Task(ABC):
    """Prompts, their presentation and their reward; `close()` releases reward worker processes, if any."""

    @abstractmethod
    def train_batch(self, index: int, size: int) -> list[PromptRecord]:
        """Training batch `index`: a pure function of (task, index, size)."""

    @abstractmethod
    def eval_records(self) -> list[PromptRecord]:
        """The held-out problems (never in a training batch)."""

    @abstractmethod
    def prompt_text(self, record: PromptRecord) -> str:
        """The text the model is given (instruction and chat template applied)."""

    @abstractmethod
    def score(self, records: Sequence[PromptRecord], responses: Sequence[str]) -> list[float]:
        """One reward per (record, response)."""

    @property
    def score_failures(self) -> int:
        """Responses of the last `score` call that could not be scored (scored 0.0): a user's reward function that
        raised or timed out. The built-in exact-match reward cannot fail."""
        return 0

    def demonstrations(self, index: int, size: int) -> Optional[list[tuple[str, str]]]:
        """(prompt text, target response) pairs for a supervised warm start, or None when the task has none."""
        return None

    def close(self) -> None:
        pass


# ---- the built-in synthetic task ---------------------------------------------------------------------------------
class AdditionTask(Task):
    """demo_accuracy: the share of demonstrations that are right; the others are off by one (a careless
    demonstrator). The warm start learns the skill and the carelessness alike; RL with the exact reward can
    then go beyond its demonstrations, which is what the default job shows."""

    def __init__(self, max_operand: int = 20, eval_size: int = 64, seed: int = 0, demo_accuracy: float = 1.0):
        if not 0.0 < demo_accuracy <= 1.0:
            raise ValueError(f"demo_accuracy={demo_accuracy} must be in (0, 1]")
        self.demo_accuracy = demo_accuracy
        pairs = [(a, b) for a in range(max_operand) for b in range(max_operand)]
        random.Random(seed).shuffle(pairs)
        if eval_size >= len(pairs):
            raise ValueError(f"eval_size={eval_size} leaves no training problems out of {len(pairs)}")
        self.eval_pairs = pairs[:eval_size]
        self.train_pairs = pairs[eval_size:]
        self.seed = seed

    @staticmethod
    def _record(a: int, b: int) -> PromptRecord:
        return PromptRecord(id=f"{a}+{b}", prompt=f"{a}+{b}=", reference=str(a + b))

    def train_batch(self, index: int, size: int) -> list[PromptRecord]:
        rnd = random.Random(self.seed * 1_000_003 + index)
        return [self._record(*rnd.choice(self.train_pairs)) for _ in range(size)]

    def eval_records(self) -> list[PromptRecord]:
        return [self._record(a, b) for a, b in self.eval_pairs]

    def prompt_text(self, record: PromptRecord) -> str:
        return record.prompt

    def score(self, records: Sequence[PromptRecord], responses: Sequence[str]) -> list[float]:
        return [1.0 if r.strip() == rec.reference else 0.0 for rec, r in zip(records, responses)]

    def demonstrations(self, index: int, size: int) -> list[tuple[str, str]]:
        rnd = random.Random(f"demo:{self.seed}:{index}")
        out = []
        for rec in self.train_batch(10_000_000 + index, size):
            answer = int(rec.reference)
            if rnd.random() >= self.demo_accuracy:
                answer += 1 if answer == 0 or rnd.random() < 0.5 else -1
            out.append((rec.prompt, str(answer)))
        return out


# ---- the built-in multi-turn tasks ---------------------------------------------------------------------------------
class EpisodeTask(Task):
    """A built-in task played in episodes: its environment scores it (`env.cls`), the first message is the
    environment's `reset` (the record's prompt, shown as it is), and the held-out records are `heldout`."""

    heldout: list[PromptRecord]

    def eval_records(self) -> list[PromptRecord]:
        return self.heldout

    def prompt_text(self, record: PromptRecord) -> str:
        return record.prompt

    def score(self, records: Sequence[PromptRecord], responses: Sequence[str]) -> list[float]:
        raise RuntimeError(f"{type(self).__name__} is scored by its environment, in episodes")


class GuessTask(EpisodeTask):
    """Find a hidden number in 1..16 from "higher" / "lower" replies, in episodes (`env.cls` GuessNumber,
    `environments/guess.py`): one turn finds it 1 time in 16, an optimal player always within 5. The warm start
    imitates a careless player: each of its guesses uses the answers so far (a number they still allow) with
    probability `demo_accuracy`, and is any number in 1..16 otherwise. Demonstrations are its games cut at a random
    turn, as token ids (the transcript holds the replies' stop tokens and the observations as the episode renders
    them), with its next guess as the answer. RL then has to learn to use the answers every time."""

    LOW, HIGH = 1, 16

    def __init__(self, eval_size: int = 64, seed: int = 0, template=None, stop_id: Optional[int] = None,
                 max_turns: int = 4, demo_accuracy: float = 0.3):
        from megatron_rl.environments.guess import guess_records

        self.seed, self.template, self.stop_id, self.max_turns = seed, template, stop_id, max_turns
        self.demo_accuracy = demo_accuracy
        self.heldout = [self._record(r) for r in guess_records(eval_size, seed=10_000 + seed)]

    @staticmethod
    def _record(r: dict) -> PromptRecord:
        return PromptRecord(id=r["id"], prompt=r["prompt"], reference=r["reference"])

    def train_batch(self, index: int, size: int) -> list[PromptRecord]:
        from megatron_rl.environments.guess import guess_records

        return [self._record(r) for r in guess_records(size, seed=self.seed * 7_919_000 + index)]

    def demonstrations(self, index: int, size: int) -> list[tuple[list[int], str]]:
        from megatron_rl.environments.guess import GuessNumber, narrowed

        rnd = random.Random(f"guess-demo:{self.seed}:{index}")
        out = []
        for rec in self.train_batch(10_000_000 + index, size):
            env = GuessNumber({"prompt": rec.prompt, "reference": rec.reference}, 0)
            ids = self.template.prompt({"role": "user", "content": env.reset()})
            low, high = self.LOW, self.HIGH  # what the answers so far allow
            for _ in range(rnd.randrange(self.max_turns)):
                guess = self._guess(rnd, low, high)
                message, _, done = env.step(f" {guess}")
                if done:
                    break
                low, high = narrowed(low, high, guess, message)
                ids = ids + self.template.tok.encode(f" {guess}") + [self.stop_id] + \
                    self.template.observation({"role": "user", "content": message})
            out.append((ids, f" {self._guess(rnd, low, high)}"))
        return out

    def _guess(self, rnd: random.Random, low: int, high: int) -> int:
        if rnd.random() < self.demo_accuracy and low <= high:
            return rnd.randint(low, high)
        return rnd.randint(self.LOW, self.HIGH)


class CalculatorTask(EpisodeTask):
    """Word problems of two or three changes with numbers up to 50 (`data/word_problems.py`), played in episodes
    against the calculator environment (`env.cls` Calculator, `environments/calculator.py`), which scores them.
    Mental arithmetic at this size is beyond a small model; the calculator is not. The warm start imitates a
    demonstrator who uses the calculator with probability `demo_accuracy` (the call writes the problem's arithmetic,
    then the answer is the result) and otherwise answers at once, off by 1 to 9. Demonstrations are its episodes cut
    at a turn (the call, or the answer after the result), as token ids rendered as the episode renders them. RL has
    to learn to call the calculator every time. With `tool_calls` (a job whose episodes are agents, `env.agent`),
    the demonstrations are what `agents/calculator.py` asks and a model using it answers: the function tool in the
    prompt, each call a `<tool_call>` block, its result a tool message."""

    def __init__(self, eval_size: int = 64, seed: int = 0, template=None, stop_id: Optional[int] = None,
                 demo_accuracy: float = 0.3, tool_calls: bool = False):
        from megatron_rl.data.word_problems import CALCULATOR_PROBLEMS, WordProblems

        self.tool_calls = tool_calls

        self.problems = WordProblems(**CALCULATOR_PROBLEMS)  # one fixed problem set, whatever the run seed
        self.train = self.problems.records("train", 20_000)
        self.heldout = self.problems.records("eval", eval_size)
        self.seed, self.template, self.stop_id, self.demo_accuracy = seed, template, stop_id, demo_accuracy

    def train_batch(self, index: int, size: int) -> list[PromptRecord]:
        rnd = random.Random(self.seed * 1_000_003 + index)
        return [rnd.choice(self.train) for _ in range(size)]

    def demonstrations(self, index: int, size: int) -> list[tuple[list[int], str]]:
        from megatron_rl.agents import calculator as agent
        from megatron_rl.environments.calculator import Calculator, call_text, result_value

        rnd = random.Random(f"calculator-demo:{self.seed}:{index}")
        out = []
        for rec in self.train_batch(10_000_000 + index, size):
            env = Calculator(rec.as_dict(), 0)
            if self.tool_calls:  # as the agent asks (`agents/calculator.py`): the tool's description, its calls
                ids = self.template.prompt([agent.question(rec.as_dict())], [agent.TOOL])
                call = agent.call_text(rec.metadata["expression"])
            else:
                ids = self.template.prompt({"role": "user", "content": env.reset()})
                call = call_text(rec.metadata["expression"])
            if rnd.random() >= self.demo_accuracy:  # an answer from its own arithmetic, a little off
                out.append((ids, str(max(0, env.answer + rnd.choice([-1, 1]) * rnd.randint(1, 9)))))
                continue
            if rnd.random() < 0.5:
                out.append((ids, call))
                continue
            message, _, _ = env.step(call_text(rec.metadata["expression"]))
            value = result_value(message["content"])
            if self.tool_calls:
                message = {"role": "tool", "tool_call_id": "call_0", "content": value}
            ids = ids + self.template.tok.encode(call) + [self.stop_id] + self.template.observation(message)
            out.append((ids, value))
        return out


# ---- dataset tasks -----------------------------------------------------------------------------------------------
def _load(path: Path, data, key: str) -> list[PromptRecord]:
    """GSM8K and MATH-500 files through their loaders (their field mapping and reference answers), any other JSONL
    with `data.prompt_field` / `data.answer_field`."""
    if not path.is_file():
        raise DataError(f"{path}: no such file (set data.path, or data.eval_path for the held-out problems)")
    if key == "gsm8k":
        return list(load_gsm8k(path=path))
    if key == "math500":
        return list(load_math500(path=path))
    return list(JsonlPromptDataset(path, prompt_field=data.prompt_field, answer_field=data.answer_field))


class DatasetTask(Task):
    """Prompt records from files, shown through an instruction and the tokenizer's chat template, scored by a verifier.
    Prompts longer than `max_prompt_tokens` are left out (counted in `skipped`), not cut.

    Training prompts are measured as the batches draw them, not all at the start: a job on a million prompts would
    otherwise tokenize every one of them on every rank before its first step, and again at every resume
    (`benchmarks/task_start.py`, docs/benchmarks.md). Epoch e is every training record in the seeded order of (seed,
    e), the ones too long left out, so a batch is still a pure function of its index; a record is measured once. The
    held-out prompts, few, are measured at the start."""

    MEASURE_CHUNK = 256  # training prompts tokenized together (a fast tokenizer's batch call), ahead of the batches

    def __init__(self, train: list[PromptRecord], heldout: list[PromptRecord], instruction: str, tokenizer,
                 reward, *, chat: bool, max_prompt_tokens: int, seed: int = 0, system: Optional[str] = None):
        self.builder = ChatPromptBuilder.for_task(instruction, system)
        self.tok, self.reward, self.chat, self.seed = tokenizer, reward, chat, seed
        self.limit = max_prompt_tokens
        self.skipped = {"train": 0, "eval": 0}  # training prompts: those found too long so far
        if not train:
            raise ValueError("the training set has no prompt")
        self.train = list(train)
        encoded = self._encode(heldout)
        self.heldout = [r for r, ids in zip(heldout, encoded) if len(ids) <= self.limit]
        self.skipped["eval"] = len(heldout) - len(self.heldout)
        if not self.heldout:
            raise ValueError(f"no held-out prompt fits rollout.max_prompt_length={self.limit} tokens")
        self._order = ResumableSampler(len(self.train), shuffle=True, seed=seed)
        self._fits: list[Optional[bool]] = [None] * len(self.train)  # by record, once measured
        self._first = list(self._order.epoch_order(0))  # epoch 0's order: measured from its start
        self._first_fit: list[int] = []  # the fitting records of the measured part of epoch 0, in its order
        self._measured = 0  # positions of epoch 0 measured so far
        self._later: tuple[int, list[int]] = (-1, [])  # the last later epoch drawn: its fitting records, in order

    def _encode(self, records: Sequence[PromptRecord]) -> list[list[int]]:
        return self.tok.encode_batch([self.prompt_text(r) for r in records], add_bos=self.tok.bos_id is not None)

    def _record_index(self, pos: int) -> int:
        """The training record at position `pos` of the concatenated epochs (too-long prompts left out)."""
        while pos >= len(self._first_fit) and self._measured < len(self._first):
            chunk = self._first[self._measured:self._measured + self.MEASURE_CHUNK]
            new = [i for i in chunk if self._fits[i] is None]
            for i, ids in zip(new, self._encode([self.train[i] for i in new])):
                self._fits[i] = len(ids) <= self.limit
                self.skipped["train"] += not self._fits[i]
            self._first_fit += [i for i in chunk if self._fits[i]]
            self._measured += len(chunk)
        if pos < len(self._first_fit):
            return self._first_fit[pos]
        n = len(self._first_fit)  # epoch 0 is measured whole: every epoch has n records
        if n == 0:
            raise ValueError(f"no training prompt fits rollout.max_prompt_length={self.limit} tokens")
        epoch, i = divmod(pos, n)
        if self._later[0] != epoch:
            self._later = (epoch, [j for j in self._order.epoch_order(epoch) if self._fits[j]])
        return self._later[1][i]

    def prompt_text(self, record: PromptRecord) -> str:
        return self.builder.build(record, self.tok if self.chat else None)

    def train_batch(self, index: int, size: int) -> list[PromptRecord]:
        """Epochs over the training records that fit, each in its own seeded order: items `index * size` to
        `(index + 1) * size - 1` of the concatenated epochs."""
        return [self.train[self._record_index(pos)] for pos in range(index * size, (index + 1) * size)]

    def eval_records(self) -> list[PromptRecord]:
        return self.heldout

    def score(self, records: Sequence[PromptRecord], responses: Sequence[str]) -> list[float]:
        return self.reward.score([(self.prompt_text(rec), resp, rec.reference, rec.as_dict())
                                  for rec, resp in zip(records, responses)])

    @property
    def score_failures(self) -> int:
        return self.reward.failures

    def close(self) -> None:
        self.reward.close()


def build_task(cfg, tokenizer, *, with_reward: bool = True) -> Task:
    """The task a job configuration names. `with_reward=False` builds it without starting reward workers (ranks
    that never score). The dataset's files, instruction and verifier come from `megatron_rl.data.registry`."""
    data = cfg.data
    key = dataset_key(data.dataset)
    if key is None:
        return AdditionTask(max_operand=20, eval_size=data.eval_size, seed=cfg.run.seed,
                            demo_accuracy=data.demo_accuracy)
    if key == GUESS:
        from megatron_rl.environments.play import TurnTemplate

        return GuessTask(data.eval_size, cfg.run.seed, TurnTemplate(tokenizer, chat=False), tokenizer.eos_id,
                         cfg.env.max_turns, data.demo_accuracy)
    if key == CALCULATOR:
        from megatron_rl.environments.play import TurnTemplate

        chat = tokenizer.has_chat_template if data.chat is None else data.chat
        return CalculatorTask(data.eval_size, cfg.run.seed, TurnTemplate(tokenizer, chat=chat), tokenizer.eos_id,
                              data.demo_accuracy, tool_calls=cfg.env.agent is not None)
    instruction = DATASETS[key].instruction
    if key == "word-problems":
        problems = WordProblems()  # one fixed problem set, whatever the run seed
        train, heldout = problems.records("train", 5000), problems.records("eval", data.eval_size)
        return _dataset_task(cfg, tokenizer, key, instruction, train, heldout, with_reward)
    train_path, eval_path = dataset_files(key, data.path, data.eval_path)
    if train_path is None:
        raise ValueError("data.dataset='jsonl' needs data.path")
    records = _load(train_path, data, key)
    if eval_path is not None:
        train, heldout = records, _load(eval_path, data, key)[: data.eval_size]
    else:  # one file: hold out its first eval_size records
        if len(records) <= data.eval_size:
            raise ValueError(f"{train_path} has {len(records)} records; holding out data.eval_size={data.eval_size} "
                             f"leaves none to train on (set data.eval_path or a smaller data.eval_size)")
        train, heldout = records[data.eval_size:], records[: data.eval_size]
    return _dataset_task(cfg, tokenizer, key, instruction, train, heldout, with_reward)


def _dataset_task(cfg, tokenizer, key: str, instruction: str, train: list[PromptRecord],
                  heldout: list[PromptRecord], with_reward: bool) -> "DatasetTask":
    data = cfg.data
    reward = _NoReward()
    r = cfg.reward
    if with_reward and r.kind == "reward-model" and r.model_executor:
        reward = _ModelOnly()  # the reward model's ranks score the responses; the controller adds their scores
    elif with_reward and not cfg.env.episodic:  # episodes: their environment (or agent) scores them
        reward = get_reward_fn(r.kind, r.function, timeout_s=r.timeout_s, num_workers=r.num_workers, dataset=key,
                               model=r.model, log_path=str(worker_log(cfg)))
    chat = tokenizer.has_chat_template if data.chat is None else data.chat
    return DatasetTask(train, heldout, instruction, tokenizer, reward, chat=chat,
                       max_prompt_tokens=cfg.rollout.max_prompt_length, seed=cfg.run.seed, system=data.system)


@dataclass
class _ModelOnly:
    """reward.kind='reward-model' with the model on ranks of its own: no verifier, so the part the replica's leader
    scores is 0 and the reward is the model's score alone."""

    failures: int = 0

    def score(self, items):
        return [0.0] * len(items)

    def close(self) -> None:
        pass


@dataclass
class _NoReward:
    """Stands in for the verifier on ranks that never score."""

    failures: int = 0

    def score(self, items):
        raise RuntimeError("this rank does not score responses")

    def close(self) -> None:
        pass

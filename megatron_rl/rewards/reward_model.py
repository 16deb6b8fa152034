"""A learned reward: a Hugging Face sequence-classification model (one output) scores prompt + response.

`reward.kind=reward-model` with `reward.model=DIR` (a `*ForSequenceClassification` checkpoint with
`num_labels=1` and its tokenizer, e.g. a Llama reward model). The scorer runs in the process of each generator
replica's leader, on that rank's device, in batches: the reward is the model's scalar output for the prompt
followed by the response, read at the last real token (right padding, the model's `pad_token_id`; a text longer than
the model's max_position_embeddings keeps its end).

This is the in-process form of the reward executor (`reward.executor.dp=0`): the reward model shares the generator
leader's device and time, which suits small models. A reward model that needs tensor-parallel ranks of its own runs
on our Megatron-Core model instead (`rewards/sequence_classifier.py`, `RewardModelExecutor`), with the same scores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch

from megatron_rl.rewards.base import RewardFunction, RewardItem


class RewardModelReward(RewardFunction):
    name = "reward-model"

    def __init__(self, path: str, batch_size: int = 16, max_length: Optional[int] = None,
                 device: Optional[torch.device] = None):
        try:
            import transformers
        except ImportError:
            raise ValueError("reward.kind='reward-model' needs transformers (pip install 'megatron-rl[hf]')") from None
        p = Path(path)
        if not (p / "config.json").is_file():
            raise ValueError(f"reward.model={path!r} is not a Hugging Face model directory (no config.json)")
        from megatron_rl.rewards.sequence_classifier import load_reward_tokenizer

        self.tok = load_reward_tokenizer(p)  # batches are right-padded; the model reads the last real token
        self.model = transformers.AutoModelForSequenceClassification.from_pretrained(p, dtype=torch.float32).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward.model={path!r} has {self.model.config.num_labels} outputs; a reward model has "
                             f"one (num_labels=1)")
        self.model.config.pad_token_id = self.tok.pad_token_id
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                                 else torch.device("cpu"))
        self.model.to(self.device)
        # A longer text keeps its last max_length tokens (`load_reward_tokenizer`): the score is read at its end.
        self.batch_size = batch_size
        self.max_length = max_length or self.model.config.max_position_embeddings

    @torch.no_grad()
    def score(self, items: Sequence[RewardItem]) -> list[float]:
        out: list[float] = []
        for i in range(0, len(items), self.batch_size):
            texts = [prompt + response for prompt, response, *_ in items[i:i + self.batch_size]]
            enc = self.tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length)
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits
            out.extend(float(x) for x in logits[:, 0].float().cpu())
        return out

"""A Llama reward model (a Hugging Face `LlamaForSequenceClassification`, one output) on our Megatron-Core GPTModel,
split over tensor-parallel ranks.

`RewardModelReward` (rewards/reward_model.py) runs the reward model with transformers in the generator leader's
process, on that rank's device. A reward model as large as the policy does not fit there: it needs tensor-parallel
ranks of its own, a reward executor. This module is the model half of that executor: every TP rank builds its
shard of the GPTModel (`build_gpt_model`, without the vocabulary output layer: a reward model has no LM head),
fills it straight from the rows and columns of the safetensors tensors it is made of (the converter's
`fill_param`, with the shard descriptors of `models/sharding.py`), and keeps the scalar head `score.weight`
[1, hidden] replicated. TP rank 0 tokenizes (prompt + response, the model's own tokenizer, right padding,
texts longer than `max_length`, by default the model's max_position_embeddings, cut from the left) and broadcasts
the token ids within the TP group; each batch runs embedding -> decoder (causal attention; its final norm
included) and the head reads the hidden state of the last token that is not the pad token, as transformers does,
so the scores are `RewardModelReward`'s. The executor that receives rollouts and calls `ParallelRewardModel.score`
lives in controller/executors.py; it scores with `SCORING_BATCH_SIZE` and `SCORING_MAX_LENGTH`, which
`megatron-rl plan` reads too.

`reward_model_config` checks a reward-model directory from config.json and the safetensors headers only (no
weights), so the run configuration can validate `reward.model` against the executor's TP
(`parallel.layout.layout_problems`) before anything starts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.models.presets import ModelConfig
from megatron_rl.parallel.layout import ParallelLayout, layout_problems

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")

# How the reward executor scores: sequences per forward, and tokens kept of each text (None: the model's
# max_position_embeddings). Read by the executor that builds `ParallelRewardModel` and by `megatron-rl plan`,
# which sizes the scoring workspace from them.
SCORING_BATCH_SIZE = 16
SCORING_MAX_LENGTH: Optional[int] = None


def scoring_max_length(cfg: ModelConfig, max_length: Optional[int] = SCORING_MAX_LENGTH) -> int:
    """Tokens kept of each scored text: `max_length`, or the model's whole window when it is None."""
    return max_length or cfg.max_position_embeddings


# The attention the reward model's body is built with (here and by `megatron-rl plan`).
BODY_ATTENTION = "sdpa"


def body_config(cfg: ModelConfig) -> ModelConfig:
    """The GPTModel the reward model's body is built as: tied embeddings, so that GPTModel allocates no
    output-layer weight (it would reuse the embedding) and no vocab x hidden matrix is ever made; the (weightless)
    output layer is then dropped."""
    return dataclasses.replace(cfg, tie_word_embeddings=True)


def _where(path) -> str:
    return f"reward.model={str(path)!r}"


def _num_labels(raw: dict) -> int:
    """Outputs of a HF sequence classifier's config: id2label's length, else num_labels, else transformers'
    default (2)."""
    if isinstance(raw.get("id2label"), dict):
        return len(raw["id2label"])
    return int(raw.get("num_labels", 2))


def _check_hf_config(src: Path) -> ModelConfig:
    """The Llama shape of a sequence-classifier directory, refusing anything else in one line."""
    from megatron_rl.checkpointing.hf_sources import hf_model_config

    if not (src / "config.json").is_file():
        raise ValueError(f"{_where(src)} is not a Hugging Face model directory (no config.json); point it at a "
                         f"saved LlamaForSequenceClassification")
    try:
        cfg = hf_model_config(src)
    except ValueError as e:  # ConversionError: one line starting with the path
        text = str(e).splitlines()[0]
        raise ValueError(f"{_where(src)}: {text.removeprefix(f'{src}: ')}") from None
    if cfg.is_moe:  # not built or tested as a reward model
        raise ValueError(f"{_where(src)}: a mixture-of-experts reward model ({cfg.family}) is not supported; use a "
                         f"dense family")
    raw = json.loads((src / "config.json").read_text())
    archs = raw.get("architectures") or []
    if archs and not any(str(a).endswith("ForSequenceClassification") for a in archs):
        raise ValueError(f"{_where(src)} is a {archs[0]} checkpoint, not a sequence classifier; a reward model is a "
                         f"LlamaForSequenceClassification with num_labels=1")
    if _num_labels(raw) != 1:
        raise ValueError(f"{_where(src)} has {_num_labels(raw)} outputs (num_labels); a reward model has one: "
                         f"save it with num_labels=1")
    if not any((src / f).is_file() for f in _TOKENIZER_FILES):
        raise ValueError(f"{_where(src)} has no tokenizer ({', '.join(_TOKENIZER_FILES)}); save the model's "
                         f"tokenizer into the directory")
    return cfg


# How `_check_tp` names the model dimensions TP splits (`parallel.layout.SPLIT_DIMS`), in Hugging Face's words.
_HF_WORDS = {"num_attention_heads": "attention heads", "num_query_groups": "key-value heads",
             "ffn_hidden_size": "MLP channels (intermediate_size)"}


def _check_tp(src: Path, cfg: ModelConfig, tp: int) -> None:
    """The first reason `tp` cannot split the reward model (`parallel.layout.layout_problems` at pp=1)."""
    problems = layout_problems(cfg, ParallelLayout(tp=tp))
    if any(p.field is None for p in problems):
        raise ValueError(f"reward.executor.tp must be >= 1, got {tp}")
    if problems:
        p = problems[0]
        raise ValueError(f"{_where(src)} has {p.count} {_HF_WORDS[p.field]}, which reward.executor.tp={tp} does "
                         f"not divide")


def reward_tensor_files(src: Path, cfg: ModelConfig) -> dict[str, str]:
    """HF tensor name -> safetensors file for the Llama body (no lm_head) and `score.weight` [1, hidden], after
    checking names, shapes and dtypes from the file headers only."""
    from megatron_rl.checkpointing.hf_sources import hf_tensor_files
    from megatron_rl.checkpointing.safetensors_io import read_header

    try:
        names = {n for f in sorted(src.glob("*.safetensors")) for n in read_header(f)}
    except (ValueError, OSError):
        names = set()  # hf_tensor_files names the unreadable file
    if names and "score.weight" not in names:
        raise ValueError(f"{_where(src)} has no score.weight tensor: it is not a sequence classifier (a reward "
                         f"model is a LlamaForSequenceClassification with num_labels=1)")
    try:
        return hf_tensor_files(src, cfg, extra={"score.weight": (1, cfg.hidden_size)}, lm_head=False)
    except ValueError as e:
        raise ValueError(f"{_where(src)}: {e}") from None


def _checked(path, tp: int) -> tuple[ModelConfig, dict[str, str]]:
    src = Path(path)
    cfg = _check_hf_config(src)
    _check_tp(src, cfg, tp)
    return cfg, reward_tensor_files(src, cfg)


def reward_model_config(path, tp: int = 1) -> ModelConfig:
    """The Llama shape of the reward model at `path` (a HF LlamaForSequenceClassification directory with
    num_labels=1), checked to split over `tp` ranks. Reads config.json and the safetensors headers only; every
    problem is a ValueError of one line naming the directory and the fix."""
    return _checked(path, tp)[0]


def load_reward_tokenizer(path):
    """A reward model's HF tokenizer, set up for scoring: a pad token (eos, else unk), right padding (batches are
    read at the last real token) and left truncation: a text longer than the model's window loses its start, not
    the response's end, where the score is read. Shared by the in-process path and the executor, so both score the
    same tokens."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(Path(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    tok.padding_side = "right"
    tok.truncation_side = "left"
    return tok


def _build_body(cfg: ModelConfig, layout: ParallelLayout, pgs, params_dtype: torch.dtype,
                files: dict[str, str]) -> torch.nn.Module:
    """This TP rank's GPTModel without an output layer, filled from the safetensors files."""
    from megatron_rl.checkpointing.hf_to_megatron import fill_param
    from megatron_rl.models import build_gpt_model
    from megatron_rl.models.sharding import describe_params

    body = body_config(cfg)
    # No initialization (as the converter): every parameter is overwritten, allocated on the device it runs on.
    model = build_gpt_model(body, layout, pgs, attention=BODY_ATTENTION, params_dtype=params_dtype,
                            initialize=False)
    del model.output_layer
    params = dict(model.named_parameters())
    with torch.no_grad():
        for d in describe_params(model, body, pgs.tp.rank(), pgs.tp.size()):
            fill_param(params[d.local_name], d, body, files)
    return model.eval().requires_grad_(False)


class ParallelRewardModel:
    """One TP rank of a reward model: a GPTModel shard plus the replicated fp32 head `score.weight` [1, hidden].
    `score` is collective over `pgs.tp`; TP rank 0 alone needs the items (and holds the tokenizer)."""

    def __init__(self, path, layout: ParallelLayout, pgs, *, params_dtype: torch.dtype = torch.float32,
                 batch_size: int = SCORING_BATCH_SIZE, max_length: Optional[int] = SCORING_MAX_LENGTH):
        from safetensors import safe_open

        if layout.pp != 1:
            raise ValueError(f"the reward executor runs without pipeline parallelism (pp=1), got {layout}")
        if batch_size < 1 or (max_length is not None and max_length < 1):
            raise ValueError(f"batch_size and max_length must be >= 1, got {batch_size} and {max_length}")
        self.path, self.pgs = Path(path), pgs
        self.cfg, files = _checked(path, layout.tp)
        self.batch_size, self.max_length = batch_size, scoring_max_length(self.cfg, max_length)
        self.model = _build_body(self.cfg, layout, pgs, params_dtype, files)
        self.device = next(self.model.parameters()).device
        with safe_open(files["score.weight"], framework="pt") as f:
            self.head = f.get_tensor("score.weight").to(self.device, torch.float32)
        self.tokenizer = load_reward_tokenizer(path) if pgs.tp.rank() == 0 else None

    def _encode(self, items: Sequence) -> tuple[list[list[int]], list[int]]:
        """Token ids of each prompt + response (its last max_length) and the position transformers reads:
        the last token that is not the pad token (0 when there is none)."""
        texts = [prompt + response for prompt, response, *_ in items]
        ids = self.tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"] if texts else []
        pad = self.tokenizer.pad_token_id
        read = [max((i for i, t in enumerate(seq) if t != pad), default=0) for seq in ids]
        return ids, read

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        if self.pgs.tp.size() > 1:
            dist.broadcast(t, src=dist.get_global_rank(self.pgs.tp, 0), group=self.pgs.tp)
        return t

    def _share(self, items: Optional[Sequence]) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pad id, lengths [n], read positions [n], token ids of all sequences back to back), from TP rank 0."""
        dev = self.device
        if self.pgs.tp.rank() == 0:
            if items is None:
                raise ValueError("ParallelRewardModel.score needs the items on TP rank 0")
            ids, read = self._encode(items)
            lengths = [len(s) for s in ids]
            body = torch.tensor(lengths + read + [t for s in ids for t in s], dtype=torch.int64, device=dev)
            head = torch.tensor([len(ids), sum(lengths), self.tokenizer.pad_token_id], dtype=torch.int64,
                                device=dev)
        else:
            head = torch.empty(3, dtype=torch.int64, device=dev)
        n, total, pad = self._broadcast(head).tolist()
        if self.pgs.tp.rank() != 0:
            body = torch.empty(2 * n + total, dtype=torch.int64, device=dev)
        lengths, read, flat = self._broadcast(body).split([n, n, total])
        return pad, lengths, read, flat

    def _forward(self, tokens: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
        """Scores [b] of right-padded tokens [b, s]: embedding -> decoder (causal; padding comes after every
        position read, so no mask is needed) -> hidden state at `read` -> head."""
        b, s = tokens.shape
        positions = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
        hidden = self.model.embedding(input_ids=tokens, position_ids=positions)  # [s, b, h]
        hidden = self.model.decoder(hidden_states=hidden, attention_mask=None,
                                    rotary_pos_emb=self.model.rotary_pos_emb(s))
        last = hidden[read, torch.arange(b, device=tokens.device)]  # [b, h], after the final norm
        return (last.float() @ self.head.T)[:, 0]

    @torch.no_grad()
    def score(self, items: Optional[Sequence]) -> list[float]:
        """The reward of each (prompt, response, _) item, in order (collective over the TP group; `items` is
        read on TP rank 0 only, the others pass None). Every rank returns the same list."""
        pad, lengths, read, flat = self._share(items)
        n = lengths.numel()
        starts = torch.cumsum(lengths, 0) - lengths
        out = torch.empty(n, dtype=torch.float32, device=self.device)
        for i in range(0, n, self.batch_size):
            j = min(n, i + self.batch_size)
            width = max(1, int(lengths[i:j].max()))
            # Right padding with the pad token (read only for an empty text, as transformers reads it).
            tokens = torch.full((j - i, width), pad, dtype=torch.int64, device=self.device)
            for row, k in enumerate(range(i, j)):
                length, start = int(lengths[k]), int(starts[k])
                tokens[row, :length] = flat[start:start + length]
            out[i:j] = self._forward(tokens, read[i:j])
        return self._broadcast(out).tolist()  # rank 0's scores, bit for bit, on every rank

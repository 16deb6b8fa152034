"""Job configuration: plain dataclasses, YAML files, dotted command-line overrides, validation with clear errors.

    cfg = load_config("configs/tiny.yaml", ["trainer.tp=2", "rollout.staleness=2"])
    validate(cfg, world_size=6)

Every error is one line naming the field and the rule, e.g.
`generator.tp=3 does not divide model.num_query_groups=2`, and is raised before any process group exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from megatron_rl.models.presets import PRESETS, ModelConfig, get_preset
from megatron_rl.parallel.layout import ParallelLayout


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line naming the field and the rule."""


@dataclass
class ModelSection:
    """A preset by name, plus any ModelConfig field as an override (`model.num_layers=2`); or the initial weights
    of a checkpoint (`model.checkpoint=PATH`), whose recorded shape is then the model's.

    checkpoint: a megatron-rl checkpoint (`megatron-rl convert --to megatron` output, or a training run's step or
        root); with the local launcher also a Hugging Face Llama directory, a .gguf file or the name of a packaged
        model (`smollm2-135m-instruct`), converted once into the run directory before the job starts.
    tokenizer: "byte", a HF directory, a .gguf or a sentencepiece .model; default: the checkpoint's own tokenizer,
        or the byte tokenizer without a checkpoint.
    """

    preset: Optional[str] = None
    overrides: dict[str, Any] = field(default_factory=dict)
    checkpoint: Optional[str] = None
    tokenizer: Optional[str] = None

    @property
    def name(self) -> str:
        if self.preset:
            return self.preset
        return Path(self.checkpoint).name if self.checkpoint else "tiny"

    def resolve(self) -> ModelConfig:
        if self.checkpoint is None:
            return get_preset(self.preset or "tiny", **self.overrides)
        from megatron_rl.checkpointing.initial import checkpoint_model_config

        model = checkpoint_model_config(self.checkpoint)
        if self.overrides:
            raise ValueError(f"model.{next(iter(self.overrides))} cannot be set with model.checkpoint (the "
                             f"checkpoint's shape is the model's)")
        if self.preset:
            want = dataclasses.asdict(get_preset(self.preset))
            have = dataclasses.asdict(model)
            diff = [k for k in want if k != "name" and want[k] != have.get(k)]
            if diff:
                raise ValueError(f"model.checkpoint={self.checkpoint!r} is not a {self.preset!r} model (differs in "
                                 f"{', '.join(diff)}); drop model.preset or use a matching checkpoint")
        return model


@dataclass
class TrainerSection:
    tp: int = 2
    pp: int = 1
    dp: int = 1
    micro_batch_size: int = 64
    lr: float = 2e-4  # the RL learning rate (constant after `lr_warmup_steps` of linear warm-up)
    lr_warmup_steps: int = 0
    # Supervised warm start inside the job, before RL (0 to skip): steps and peak learning rate.
    sft_warmup_steps: int = 1500
    sft_lr: float = 3e-3
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    use_distributed_optimizer: bool = True
    attention: Literal["auto", "sdpa", "local", "te"] = "auto"
    # "auto": bf16 where the hardware multiplies bf16 natively, else fp32 (megatron_rl.models.precision).
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    max_nonfinite_steps: int = 3

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(self.tp, self.pp, self.dp)


@dataclass
class GeneratorSection:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    colocated: bool = False
    quantization: Literal["none", "int8", "fp8"] = "none"
    # every N-th weight push is checked end to end (ddma/fingerprint.py); 0: never; "auto": push 0, then as often
    # as keeps the checks under 1% of the pushes' time, measured
    push_check_interval: Union[int, Literal["auto"]] = "auto"
    max_batch_size: int = 64
    attention: Literal["auto", "sdpa", "local", "te"] = "auto"
    dtype: Literal["auto", "fp32", "bf16"] = "auto"

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(self.tp, self.pp, self.dp)


@dataclass
class AlgorithmSection:
    name: Literal["aipo"] = "aipo"
    rho: float = 4.0
    advantage: Literal["group_mean", "rloo", "grpo"] = "group_mean"
    normalization: Literal["token", "sequence"] = "token"
    ppo_clip: Optional[float] = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    # false: ignore the behaviour policy (weights of 1, as if every sample were on-policy): the uncorrected
    # baseline of the staleness study, not a setting to train with.
    importance_weights: bool = True


@dataclass
class RolloutSection:
    mode: Literal["async", "sync"] = "async"
    staleness: int = 1
    prompts_per_step: int = 16
    samples_per_prompt: int = 4
    max_prompt_length: int = 48
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def lag(self) -> int:
        """How many weight versions the generator may run ahead: `staleness` when async, 0 when sync."""
        return self.staleness if self.mode == "async" else 0


@dataclass
class DataSection:
    """dataset: "synthetic-arithmetic" (built in), "gsm8k", "math500" or "jsonl". GSM8K trains on `path` (default:
    the shared train split) and evaluates on `eval_path` (default: the shared test split); a single file (MATH-500,
    JSONL without eval_path) holds out its first `eval_size` records. `prompt_field`/`answer_field` map JSONL
    fields. `chat`: apply the tokenizer's chat template (default: when it has one). `system`: a system message.
    Held-out reward: `eval_samples` samples per held-out problem at the rollout temperature."""

    dataset: str = "synthetic-arithmetic"
    path: Optional[str] = None
    eval_path: Optional[str] = None
    prompt_field: str = "question"
    answer_field: Optional[str] = "answer"
    eval_size: int = 64
    eval_samples: int = 4
    chat: Optional[bool] = None
    system: Optional[str] = None
    # Synthetic task only: the share of the warm start's demonstrations that are right (the rest are off by one).
    # The default imitates a careless demonstrator, which leaves RL something to learn beyond the demonstrations
    # (with perfect ones, RL only re-learns the supervised signal; see docs/benchmarks.md).
    demo_accuracy: float = 0.3


@dataclass
class RewardExecutorSection:
    """Where the reward model runs. `dp` = 0: in each generator replica's leader process, on its device (small
    models). `dp` >= 1: on ranks of its own, after the trainer's and the generator's: `dp` replicas of `tp` ranks,
    each scoring the batches of every dp-th generator replica as they arrive."""

    tp: int = 1
    dp: int = 0

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(self.tp, 1, self.dp)


@dataclass
class RewardSection:
    """kind: the verifier (or "function", or "reward-model": the reward model's score alone). `model`: a Hugging Face
    sequence-classification directory (num_labels=1). With a verifier kind and `model` both set (the reward model on
    its own ranks), the reward is the verifier's plus `model_coef` times the model's score."""

    kind: Literal["auto", "gsm8k", "math", "synthetic", "function", "reward-model"] = "auto"
    function: Optional[str] = None
    model: Optional[str] = None
    model_coef: float = 1.0
    timeout_s: float = 5.0
    num_workers: int = 1
    executor: RewardExecutorSection = field(default_factory=RewardExecutorSection)

    @property
    def model_executor(self) -> bool:
        """Does the reward model run on ranks of its own?"""
        return self.model is not None and self.executor.dp >= 1


@dataclass
class CheckpointSection:
    dir: str = "checkpoints"
    save_interval: int = 50  # steps between checkpoints; always one after the last step (0: only that one)
    keep_last: int = 2
    resume: bool = True
    fallback: bool = False  # resume from an older checkpoint when the latest is corrupt
    # Training waits only while each rank copies its state out; the files are written and the checkpoint completed
    # in the background (the next save, a stop and the end wait for it). false: every save completes before
    # training goes on.
    async_save: bool = True


@dataclass
class WandbSection:
    """Weights & Biases logging of the run (`pip install 'megatron-rl[wandb]'`): the scalars of metrics.jsonl, the
    plot and sample rollouts. `mode`: "auto" logs when `project` is set, online with a W&B login (WANDB_API_KEY or
    `wandb login`), else offline into the run directory (`wandb sync` uploads it); "online" and "offline" always
    log (project "megatron-rl" unless set); "disabled" never does."""

    mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    project: Optional[str] = None
    entity: Optional[str] = None
    name: Optional[str] = None  # the run's display name in W&B; run.name when unset

    @property
    def enabled(self) -> bool:
        return self.mode in ("online", "offline") or (self.mode == "auto" and self.project is not None)


@dataclass
class RunSection:
    name: str = "default"
    seed: int = 1234
    steps: int = 800
    world_size: Optional[int] = None
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    eval_interval: int = 20
    # After SIGTERM or SIGINT the job saves a checkpoint at its next weight push and ends; the local launcher
    # kills its ranks this many seconds after the signal if they have not ended by then.
    stop_grace_s: float = 120.0
    wandb: WandbSection = field(default_factory=WandbSection)


@dataclass
class JobConfig:
    model: ModelSection = field(default_factory=ModelSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    generator: GeneratorSection = field(default_factory=GeneratorSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    data: DataSection = field(default_factory=DataSection)
    reward: RewardSection = field(default_factory=RewardSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    run: RunSection = field(default_factory=RunSection)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        model = d.pop("model")
        d["model"] = {k: model[k] for k in ("preset", "checkpoint", "tokenizer") if model[k] is not None}
        if model["checkpoint"] is None:
            d["model"]["preset"] = self.model.name
        d["model"].update(model["overrides"])
        return d

    @property
    def world_size_needed(self) -> int:
        return self.reward_first_rank + (self.reward.executor.layout.size if self.reward.model_executor else 0)

    @property
    def reward_first_rank(self) -> int:
        """The first rank after the trainer's and the generator's: where a reward-model executor starts."""
        t, g = self.trainer.layout.size, self.generator.layout.size
        return max(t, g) if self.generator.colocated else t + g


_MODEL_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig) if f.name != "name"}


def _suggest(key: str, options, prefix: str = "") -> str:
    close = difflib.get_close_matches(key, list(options), n=1, cutoff=0.6)
    return f" (did you mean {prefix + close[0]!r}?)" if close else ""


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(path: str, value: Any, tp, text: Optional[str] = None) -> Any:
    """Check (and gently convert) a value against a field type; raise ConfigError naming the field.

    `text`: the value as written on the command line, before YAML read it. A text field takes it as it is, so
    `run.name=yes` is the name "yes" (YAML would read a bool) and `run.name=123` the name "123"."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(path, value, a, text)
            except ConfigError:
                pass
        raise ConfigError(f"{path}={value!r} has the wrong type: expected {_type_name(tp)}")
    if text is not None and (tp is str or (origin is Literal and all(isinstance(a, str) for a in typing.get_args(tp)))):
        value = text
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{path}={value!r} is not allowed: expected {_type_name(tp)}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):  # `name: 123` in a YAML file
            return str(value)
    elif tp is type(None):
        if value is None:
            return None
    else:
        return value
    raise ConfigError(f"{path}={value!r} has the wrong type: expected {_type_name(tp)}")


# Options that were renamed or removed: the error says what to use instead.
_RETIRED = {
    "trainer.warmup_steps_sft": "was renamed trainer.sft_warmup_steps",
    "trainer.warmup_lr": "was renamed trainer.sft_lr",
    "trainer.warmup_steps": "was renamed trainer.lr_warmup_steps (the RL learning rate's linear warm-up)",
    "trainer.min_lr": "was removed: the RL learning rate is constant after its warm-up",
    "run.log_interval": "was removed: every step is logged",
}


def _apply(cfg: JobConfig, path: str, value: Any, text: Optional[str] = None) -> None:
    """Set one field; `text` is the value as written on the command line (None from a file)."""
    if path in _RETIRED:
        raise ConfigError(f"{path} {_RETIRED[path]}")
    parts = path.split(".")
    sections = {f.name: f for f in dataclasses.fields(JobConfig)}
    if parts[0] not in sections:
        raise ConfigError(f"unknown section {parts[0]!r} in {path!r}{_suggest(parts[0], sections)}")
    if len(parts) < 2 or (len(parts) > 2 and parts[0] == "model"):
        raise ConfigError(f"{path!r} must be SECTION.KEY (e.g. trainer.tp=2)")
    section_name, key = parts[0], parts[-1]
    section = getattr(cfg, section_name)
    for i, name in enumerate(parts[1:-1], 1):  # a section inside a section: run.wandb.mode
        names = [f.name for f in dataclasses.fields(section)]
        if name not in names:
            where = ".".join(parts[:i])
            raise ConfigError(f"unknown key {where + '.' + name!r}{_suggest(name, names, where + '.')}")
        if not dataclasses.is_dataclass(getattr(section, name)):
            raise ConfigError(f"{path!r} must be SECTION.KEY (e.g. trainer.tp=2)")
        section = getattr(section, name)
    if section_name == "model":
        if key == "preset":
            value = None if value is None else text if text is not None else value
            if value is not None and value not in PRESETS:
                raise ConfigError(f"model.preset={value!r} is not a preset{_suggest(str(value), PRESETS)}; "
                                  f"known: {', '.join(PRESETS)}")
            section.preset = value
            return
        if key in ("checkpoint", "tokenizer"):
            setattr(section, key, _coerce(path, value, Optional[str], text))
            return
        if key not in _MODEL_FIELDS:
            raise ConfigError(f"unknown key 'model.{key}'"
                              f"{_suggest(key, ['preset', 'checkpoint', 'tokenizer', *_MODEL_FIELDS], 'model.')}")
        hints = typing.get_type_hints(ModelConfig)
        section.overrides[key] = _coerce(path, value, hints[key])
        return
    fields_ = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields_:
        raise ConfigError(f"unknown key {path!r}{_suggest(key, fields_, path.rpartition('.')[0] + '.')}")
    if dataclasses.is_dataclass(getattr(section, key)):  # a nested section takes a mapping (YAML) of its keys
        if not isinstance(value, dict):
            raise ConfigError(f"{path}={value!r} must be a mapping of its keys (e.g. {path}.KEY=VALUE)")
        for k, v in value.items():
            _apply(cfg, f"{path}.{k}", v)
        return
    hints = typing.get_type_hints(type(section))
    setattr(section, key, _coerce(path, value, hints[key], text))


def _flatten(data: dict, source: str) -> list[tuple[str, Any]]:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    items = []
    for section, body in data.items():
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: section {section!r} must be a mapping, got {type(body).__name__}")
        for key, value in body.items():
            items.append((f"{section}.{key}", value))
    return items


def parse_override(text: str) -> tuple[str, Any]:
    """"trainer.tp=2" -> ("trainer.tp", 2); values are parsed as YAML scalars."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load_config(path: Optional[Union[str, Path]] = None, overrides: Optional[list[str]] = None) -> JobConfig:
    """Defaults, then the YAML file (if any), then the dotted overrides, in that order."""
    cfg = JobConfig()
    items: list[tuple[str, Any, Optional[str]]] = []
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML ({str(e).splitlines()[0]})") from None
        # The preset first, so that later model overrides apply on top of it.
        items += [(k, v, None) for k, v in sorted(_flatten(data, str(p)), key=lambda kv: kv[0] != "model.preset")]
    items += [(*parse_override(o), o.partition("=")[2]) for o in overrides or []]
    for key, value, text in items:
        _apply(cfg, key, value, text)
    return cfg


def _divides(errors: list[str], a_name: str, a: int, b_name: str, b: int) -> None:
    if a <= 0:
        errors.append(f"{a_name}={a} must be >= 1")
    elif b % a:
        errors.append(f"{a_name}={a} does not divide {b_name}={b}")


# The range of every number in the job's sections (the executors' tp / pp / dp are checked with the model, and
# algorithm.entropy_coef may take any sign); every float must also be finite. path: (rule, why or what instead).
_RANGES: dict[str, tuple[str, str]] = {
    "trainer.micro_batch_size": (">= 1", ""),
    "trainer.lr": ("> 0", ""),
    "trainer.lr_warmup_steps": (">= 0", ""),
    "trainer.sft_warmup_steps": (">= 0", "(0 skips the warm start)"),
    "trainer.sft_lr": ("> 0", ""),
    "trainer.weight_decay": (">= 0", ""),
    "trainer.clip_grad": (">= 0", "(0 disables clipping)"),
    "trainer.adam_beta1": ("in [0, 1)", ""),
    "trainer.adam_beta2": ("in [0, 1)", ""),
    "trainer.adam_eps": ("> 0", ""),
    "trainer.max_nonfinite_steps": (">= 1", ""),
    "generator.max_batch_size": (">= 1", "(sequences decoded together)"),
    "generator.push_check_interval": (">= 0", "(0 never checks a weight push)"),
    "algorithm.rho": (">= 1", "(importance weights are truncated at rho)"),
    "algorithm.ppo_clip": ("> 0", ""),
    "algorithm.kl_coef": (">= 0", ""),
    "rollout.staleness": (">= 0", ""),
    "rollout.prompts_per_step": (">= 1", ""),
    "rollout.samples_per_prompt": (">= 1", ""),
    "rollout.max_prompt_length": (">= 1", ""),
    "rollout.max_new_tokens": (">= 1", ""),
    "rollout.temperature": ("> 0", "(use top_k=1 for greedy)"),
    "rollout.top_p": ("in (0, 1]", ""),
    "rollout.top_k": (">= 0", "(0 disables it)"),
    "data.eval_size": (">= 1", ""),
    "data.eval_samples": (">= 1", ""),
    "data.demo_accuracy": ("in [0, 1]", ""),
    "reward.timeout_s": ("> 0", ""),
    "reward.num_workers": (">= 1", ""),
    "reward.executor.tp": (">= 1", ""),
    "reward.executor.dp": (">= 0", "(0: the reward model runs in the generator replicas' leaders)"),
    "checkpoint.save_interval": (">= 0", "(0: only the final checkpoint)"),
    "checkpoint.keep_last": (">= 1", ""),
    "run.seed": ("in [0, 2**32)", ""),
    "run.steps": (">= 1", ""),
    "run.world_size": (">= 1", ""),
    "run.eval_interval": (">= 1", ""),
    "run.stop_grace_s": (">= 0", "(seconds from a stop signal to killing the ranks)"),
}
_RULES = {">= 0": lambda v: v >= 0, ">= 1": lambda v: v >= 1, "> 0": lambda v: v > 0,
          "in (0, 1]": lambda v: 0 < v <= 1, "in [0, 1]": lambda v: 0 <= v <= 1, "in [0, 1)": lambda v: 0 <= v < 1,
          "in [0, 2**32)": lambda v: 0 <= v < 2**32}


def _numbers(section, prefix: str):
    """(path, value, optional) of every int and float field of a section and the sections inside it."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value, path = getattr(section, f.name), f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _numbers(value, path)
            continue
        args = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) in (Union, types.UnionType) else ()
        base = next((a for a in args if a is not type(None)), hints[f.name])
        if base in (int, float):
            yield path, value, type(None) in args


def _check_fields(errors: list[str], cfg: JobConfig) -> None:
    """Every number of every section: finite, and in its range (`_RANGES`)."""
    for f in dataclasses.fields(JobConfig):
        if f.name == "model":
            continue
        for path, value, optional in _numbers(getattr(cfg, f.name), f.name):
            if value is None or isinstance(value, str):  # a word a number field also takes ("auto")
                continue
            if isinstance(value, float) and not math.isfinite(value):
                errors.append(f"{path}={value} must be a finite number")
            elif path in _RANGES and not _RULES[_RANGES[path][0]](value):
                rule, why = _RANGES[path]
                rule += " or null" if optional else ""
                errors.append(f"{path}={value} must be {rule}{' ' + why if why else ''}")


def _check_model(errors: list[str], model: ModelConfig) -> None:
    """The model's shape: positive sizes, heads that divide the hidden size, finite positive constants."""
    for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "vocab_size", "max_position_embeddings", "make_vocab_size_divisible_by"):
        if getattr(model, f) < 1:
            errors.append(f"model.{f}={getattr(model, f)} must be >= 1")
    for f in ("rotary_base", "rope_scaling_factor", "norm_epsilon", "init_method_std"):
        if not (math.isfinite(getattr(model, f)) and getattr(model, f) > 0):
            errors.append(f"model.{f}={getattr(model, f)} must be a finite number > 0")
    if not errors:
        _divides(errors, "model.num_attention_heads", model.num_attention_heads, "model.hidden_size",
                 model.hidden_size)
        _divides(errors, "model.num_query_groups", model.num_query_groups, "model.num_attention_heads",
                 model.num_attention_heads)


def _check_layouts(errors: list[str], cfg: JobConfig, model: ModelConfig) -> None:
    """Each executor's TP / PP / DP against the model's shape."""
    for name, sec in (("trainer", cfg.trainer), ("generator", cfg.generator)):
        bad = [dim for dim in ("tp", "pp", "dp") if getattr(sec, dim) < 1]
        errors += [f"{name}.{dim}={getattr(sec, dim)} must be >= 1" for dim in bad]
        if bad or min(model.num_attention_heads, model.num_query_groups, model.num_layers) < 1:
            continue
        _divides(errors, f"{name}.tp", sec.tp, "model.num_attention_heads", model.num_attention_heads)
        _divides(errors, f"{name}.tp", sec.tp, "model.num_query_groups", model.num_query_groups)
        _divides(errors, f"{name}.tp", sec.tp, "model.ffn_hidden_size", model.ffn_hidden_size)
        _divides(errors, f"{name}.pp", sec.pp, "model.num_layers", model.num_layers)


def _check_rollout(errors: list[str], cfg: JobConfig, model: Optional[ModelConfig]) -> None:
    """Sampling and batch shape against the algorithm and the model (`_check_fields` has checked the ranges)."""
    r, a = cfg.rollout, cfg.algorithm
    if r.samples_per_prompt == 1 and a.advantage in ("rloo", "grpo", "group_mean"):
        errors.append(f"rollout.samples_per_prompt={r.samples_per_prompt} must be >= 2 for "
                      f"algorithm.advantage={a.advantage!r} (it compares responses to the same prompt)")
    if model is not None and r.max_prompt_length + r.max_new_tokens > model.max_position_embeddings:
        errors.append(f"rollout.max_prompt_length + rollout.max_new_tokens = "
                      f"{r.max_prompt_length + r.max_new_tokens} exceeds model.max_position_embeddings="
                      f"{model.max_position_embeddings}")
    if a.ppo_clip is not None and not a.importance_weights:
        errors.append("algorithm.ppo_clip needs algorithm.importance_weights=true (its ratio is pi / mu)")


def _check_dataset_files(errors: list[str], cfg: JobConfig, dataset: str) -> None:
    """The files a dataset job reads exist and their first record loads (the job reads them the same way)."""
    from megatron_rl.data.datasets import DATA_DIR_ENV, dataset_files, default_data_dir, load_prompt_dataset
    from megatron_rl.data.records import DataError

    d = cfg.data
    train, heldout = dataset_files(dataset, d.path, d.eval_path)
    for key, given, file in (("data.path", d.path, train), ("data.eval_path", d.eval_path, heldout)):
        if file is None:
            continue
        where = f"{key}={given!r}" if given else (f"data.dataset={d.dataset!r} (its default file {file}; set {key}, "
                                                  f"or {DATA_DIR_ENV} to the folder holding "
                                                  f"{file.relative_to(default_data_dir())})")
        if not file.exists():
            errors.append(f"{where} does not exist")
        elif not file.is_file():
            errors.append(f"{where} is not a file")
        else:
            try:
                load_prompt_dataset(dataset, path=file, prompt_field=d.prompt_field, answer_field=d.answer_field,
                                    limit=1)
            except DataError as e:
                errors.append(f"{key}: {e}")
            except OSError as e:
                errors.append(f"{where} cannot be read ({e.strerror or e})")


def _check_reward_function(errors: list[str], spec: str) -> None:
    """Import the user's reward function here, as each reward worker will: a bad spec is one line now."""
    from megatron_rl.rewards.workers import RewardFunctionError, resolve_function

    try:
        resolve_function(spec)
    except RewardFunctionError as e:
        errors.append(str(e))
    except (Exception, SystemExit) as e:  # what importing a user's module may raise besides ImportError
        errors.append(f"reward function {spec!r}: importing it raised {type(e).__name__}: {e}")


def _check_reward_model(errors: list[str], cfg: JobConfig) -> None:
    """A reward model on ranks of its own (`reward.executor`): the model directory, and its shape against its TP."""
    r = cfg.reward
    e = r.executor
    if e.dp >= 1 and not r.model:
        errors.append(f"reward.executor.dp={e.dp} places a reward model on ranks of its own, but reward.model is not "
                      f"set")
    if r.model and r.kind != "reward-model" and e.dp == 0:
        errors.append(f"reward.model is set with reward.kind={r.kind!r}: a verifier's reward plus a reward model's "
                      f"score needs the reward model on ranks of its own (reward.executor.dp >= 1), or set "
                      f"reward.kind='reward-model' for the model's score alone")
    if e.dp > cfg.generator.dp:
        errors.append(f"reward.executor.dp={e.dp} is more than generator.dp={cfg.generator.dp}: each reward replica "
                      f"scores whole generator replicas, so {e.dp - cfg.generator.dp} would never score; use at most "
                      f"{cfg.generator.dp}")
    if r.model_coef != 1.0 and not r.model_executor:
        errors.append(f"reward.model_coef={r.model_coef} weighs a reward model on ranks of its own; set "
                      f"reward.model and reward.executor.dp >= 1")
    if r.model_executor and e.tp >= 1 and (Path(r.model) / "config.json").is_file():
        from megatron_rl.rewards.sequence_classifier import reward_model_config

        try:
            reward_model_config(r.model, e.tp)
        except ValueError as err:
            errors.append(str(err))


def _check_data_and_reward(errors: list[str], cfg: JobConfig, cluster_files: bool = True) -> None:
    """The dataset (its files readable, a first record usable), and a reward that can score it."""
    d, r = cfg.data, cfg.reward
    from megatron_rl.data.registry import dataset_key

    try:
        dataset = dataset_key(d.dataset)
    except ValueError as e:
        errors.append(str(e))
        dataset = None
    if dataset is not None and cfg.trainer.sft_warmup_steps > 0:
        errors.append(f"trainer.sft_warmup_steps={cfg.trainer.sft_warmup_steps}: the supervised warm start needs "
                      f"demonstrations, which only the synthetic task has; set it to 0 for data.dataset="
                      f"{d.dataset!r} (start from trained weights with model.checkpoint)")
    if dataset == "jsonl" and not d.path:
        errors.append("data.dataset='jsonl' needs data.path (a JSONL file of prompts)")
    elif dataset is not None and cluster_files:
        _check_dataset_files(errors, cfg, dataset)
    if not d.prompt_field:
        errors.append("data.prompt_field must not be empty")
    if d.answer_field == "":
        errors.append("data.answer_field must not be empty (null: the records have no reference answer)")
    if (cluster_files and cfg.model.tokenizer is not None and cfg.model.tokenizer != "byte"
            and not Path(cfg.model.tokenizer).exists()):
        errors.append(f"model.tokenizer={cfg.model.tokenizer!r} does not exist (expected 'byte', a sentencepiece "
                      f".model file, a .gguf file or a Hugging Face tokenizer directory)")
    if r.model and r.kind != "reward-model" and not (Path(r.model) / "config.json").is_file():
        errors.append(f"reward.model={r.model!r} is not a Hugging Face model directory (no config.json)")
    if r.kind == "reward-model":
        if not r.model:
            errors.append("reward.model must be set (a Hugging Face sequence-classification directory) when "
                          "reward.kind='reward-model'")
        elif not (Path(r.model) / "config.json").is_file():
            errors.append(f"reward.model={r.model!r} is not a Hugging Face model directory (no config.json)")
        if dataset is None:
            errors.append("reward.kind='reward-model': the built-in synthetic task has its own exact-match reward; "
                          "use data.dataset='jsonl' with your prompts to train on a reward model")
    elif dataset is not None and r.kind == "auto":
        from megatron_rl.rewards import kind_for_dataset

        try:
            kind_for_dataset(d.dataset)
        except ValueError as e:
            errors.append(str(e))
    elif dataset is None and r.kind not in ("auto", "synthetic") and not (r.kind == "function" and not r.function):
        errors.append(f"reward.kind={r.kind!r}: the built-in synthetic task has its own exact-match "
                      f"reward; use data.dataset='jsonl' with your prompts to train on another reward")
    _check_reward_model(errors, cfg)
    if r.kind == "function" and not r.function:
        errors.append("reward.function must be set (module:function) when reward.kind='function'")
    if r.function and r.kind != "function":
        errors.append(f"reward.function={r.function!r} is set but reward.kind={r.kind!r}: set reward.kind=function "
                      f"to use it")
    elif r.function and ":" not in r.function:
        errors.append(f"reward.function={r.function!r} must look like 'module:function'")
    elif r.function and dataset is not None and cluster_files:
        _check_reward_function(errors, r.function)
    if cfg.generator.quantization != "none" and cfg.generator.attention == "te":
        errors.append(f"generator.quantization={cfg.generator.quantization!r} needs Megatron-Core's own linear "
                      f"layers: set generator.attention to 'sdpa' or 'local' (not 'te')")


def _directory_problem(path: Path) -> Optional[str]:
    """Why files cannot be written in directory `path` (None when they can): it is not a directory, it cannot be
    written, or it does not exist and its nearest existing parent cannot be written. Creates nothing."""
    if path.exists():
        if not path.is_dir():
            return "is not a directory"
        return None if os.access(path, os.W_OK | os.X_OK) else "is not writable"
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                return f"cannot be created ({parent} is not a directory)"
            return None if os.access(parent, os.W_OK | os.X_OK) else f"cannot be created ({parent} is not writable)"
    return None


def _check_run(errors: list[str], cfg: JobConfig, world_size: Optional[int], cluster_files: bool = True) -> None:
    """The run's directory, logging, and the world the executors need."""
    name = cfg.run.name
    if not name.strip() or name in (".", "..") or any(c in name for c in "/\\\0"):
        errors.append(f"run.name={name!r} must be a plain directory name (not empty, no '/', not '.' or '..'): "
                      f"the run writes into checkpoint.dir/run.name")
    elif cluster_files:
        for key, path in (("checkpoint.dir", Path(cfg.checkpoint.dir)), ("run.name", Path(cfg.checkpoint.dir) / name)):
            problem = _directory_problem(path)
            if problem:
                errors.append(f"{key}: {path} {problem}")
                break
    if cfg.run.wandb.enabled and importlib.util.find_spec("wandb") is None:
        w = cfg.run.wandb
        setting = f"run.wandb.project={w.project!r}" if w.mode == "auto" else f"run.wandb.mode={w.mode!r}"
        errors.append(f"{setting} needs the wandb package: pip install 'megatron-rl[wandb]'")
    if cfg.generator.colocated:
        if cfg.generator.layout.size != cfg.trainer.layout.size:
            errors.append("generator.colocated=true needs generator.tp*pp*dp equal to trainer.tp*pp*dp "
                          "(both executors span the same ranks)")
    world = world_size if world_size is not None else cfg.run.world_size
    if world is not None and not errors and cfg.world_size_needed > world:
        rm = cfg.reward.executor
        errors.append(f"the executors need {cfg.world_size_needed} ranks (trainer "
                      f"{cfg.trainer.tp}x{cfg.trainer.pp}x{cfg.trainer.dp}, generator "
                      f"{cfg.generator.tp}x{cfg.generator.pp}x{cfg.generator.dp}"
                      f"{', colocated' if cfg.generator.colocated else ''}"
                      f"{f', reward model {rm.tp}x{rm.dp}' if cfg.reward.model_executor else ''}) but the world has "
                      f"{world}")


# What `validate(cluster_files=False)` leaves unchecked: the files a job reads on its cluster, which the machine
# that plans it need not have.
CLUSTER_FILES = ("the data files", "model.tokenizer", "reward.function's module", "checkpoint.dir")


def validate(cfg: JobConfig, world_size: Optional[int] = None, cluster_files: bool = True) -> ModelConfig:
    """Check that the job can run; raise ConfigError naming every problem found. Returns the resolved model.

    Besides the fields' types and ranges, it checks what the ranks would otherwise find minutes later: the files
    the job reads exist (data, tokenizer, reward model) and the first record of each data file loads, the reward
    function imports, and the checkpoint directory can be written. Called once per process before any process
    group exists (the CLI, or each rank of a torchrun/srun world); ranks receive the resolved model.

    `cluster_files=False` (`megatron-rl plan`, run on a laptop for a cluster's job) skips the checks of
    `CLUSTER_FILES`. The model's and the reward model's config files are still read: the plan needs their shapes."""
    errors: list[str] = []
    try:
        model: Optional[ModelConfig] = cfg.model.resolve()
    except ValueError as e:
        errors.append(str(e))
        model = None
    if model is not None:
        _check_model(errors, model)
        _check_layouts(errors, cfg, model)
    _check_fields(errors, cfg)
    _check_rollout(errors, cfg, model)
    _check_data_and_reward(errors, cfg, cluster_files)
    _check_run(errors, cfg, world_size, cluster_files)
    errors = [" ".join(e.splitlines()) for e in errors]
    if len(errors) == 1:
        raise ConfigError(errors[0])
    if errors:
        raise ConfigError(f"{len(errors)} problems: " + "; ".join(errors))
    return model

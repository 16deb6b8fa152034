"""The job's configuration: its sections composed (`JobConfig`), YAML files and dotted command-line overrides, and
the rules between sections.

    cfg = load_config("configs/default.yaml", ["trainer.tp=2", "rollout.staleness=2"]); validate(cfg, world_size=6)

Each section is the settings class of the component it configures, declared there with its ranges and its own
rules (`megatron_rl.settings.Section`): `trainer` is `training.settings.TrainerSettings`, `algorithm` is
`algorithms.settings.AIPOSettings`, and so on. Here live only what spans sections: the layouts against the model,
the batch against the algorithm, the dataset against the reward, the executors against the world.

Every error is one line naming the field and the rule, e.g.
`generator.tp=3 does not divide model.num_query_groups=2`, and is raised before any process group exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from megatron_rl.algorithms.settings import AIPOSettings
from megatron_rl.checkpointing.settings import CheckpointSettings
from megatron_rl.data.registry import DATASETS
from megatron_rl.data.settings import DataSettings
from megatron_rl.inference.settings import GeneratorSettings, RolloutSettings
from megatron_rl.models.presets import PRESETS, ModelConfig
from megatron_rl.checkpointing.model_section import ModelSection, model_problems
from megatron_rl.parallel.layout import layout_problems
from megatron_rl.environments.settings import EnvSettings
from megatron_rl.rewards.settings import RewardSettings
from megatron_rl.run_settings import RunSettings
from megatron_rl.settings import Section
from megatron_rl.training.settings import TrainerSettings


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line naming the field and the rule."""


@dataclass
class JobConfig:
    model: ModelSection = field(default_factory=ModelSection)
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    generator: GeneratorSettings = field(default_factory=GeneratorSettings)
    algorithm: AIPOSettings = field(default_factory=AIPOSettings)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    data: DataSettings = field(default_factory=DataSettings)
    reward: RewardSettings = field(default_factory=RewardSettings)
    env: EnvSettings = field(default_factory=EnvSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    run: RunSettings = field(default_factory=RunSettings)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        model = d.pop("model")
        d["model"] = {k: model[k] for k in ("preset", "checkpoint", "tokenizer") if model[k] is not None}
        if model["checkpoint"] is None:
            d["model"]["preset"] = self.model.name
        d["model"].update(model["overrides"])
        return d

    @property
    def response_budget(self) -> int:
        """The longest response a sample can have: rollout.max_new_tokens, or an episode's budget (env.max_tokens)."""
        return self.env.max_tokens if self.env.episodic else self.rollout.max_new_tokens

    @property
    def episode_length(self) -> int:
        """The generator's context: a prompt and the longest response (`response_budget`)."""
        return self.rollout.max_prompt_length + self.response_budget

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


def _items(path: Optional[Union[str, Path]], overrides: Optional[list[str]],
           errors: list[str]) -> list[tuple[str, Any, Optional[str]]]:
    """(key, value, text as typed) of the YAML file, then of the overrides, in the order they apply; a malformed
    override is added to `errors` and left out. A file that cannot be read raises (nothing else can be checked)."""
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
    for o in overrides or []:
        try:
            items.append((*parse_override(o), o.partition("=")[2]))
        except ConfigError as e:
            errors.append(str(e))
    return items


def load_config(path: Optional[Union[str, Path]] = None, overrides: Optional[list[str]] = None) -> JobConfig:
    """Defaults, then the YAML file (if any), then the dotted overrides, in that order. Every setting that cannot be
    applied (a wrong type, an unknown key) is named at once, with the range and rule problems of the rest."""
    cfg, errors = JobConfig(), []
    for key, value, text in _items(path, overrides, errors):
        try:
            _apply(cfg, key, value, text)
        except ConfigError as e:
            errors.append(str(e))
    if errors:
        _raise(errors + problems(cfg, cluster_files=False)[1])
    return cfg


def given_keys(path: Optional[Union[str, Path]] = None, overrides: Optional[list[str]] = None) -> set[str]:
    """The dotted keys the YAML file and the overrides set (`fit_to_devices` leaves a layout the user chose)."""
    return {key for key, _, _ in _items(path, overrides, [])}


def _layout_problems(cfg: JobConfig, model: ModelConfig) -> list[str]:
    """Each executor's TP / PP / DP against the model's shape (`parallel.layout.layout_problems`)."""
    out = []
    shape_ok = min(model.num_attention_heads, model.num_query_groups, model.num_layers) >= 1  # else model_problems
    for name, sec in (("trainer", cfg.trainer), ("generator", cfg.generator)):
        for p in layout_problems(model, sec.layout):
            if p.field is None:
                if p.dim != "ep":  # the section's own range says it
                    out.append(f"{name}.{p.dim}={p.size} must be >= 1")
            elif p.field == "dense":
                out.append(f"{name}.{p}")
            elif p.field == "tp x dp":  # the expert grid: only a trainer's EP (over DP) can miss it
                out.append(f"{name}.ep={sec.ep} does not divide {name}.dp={sec.dp} (a trainer splits its experts "
                           f"over DP ranks, each expert over TP: set {name}.dp to a multiple of {sec.ep}, or "
                           f"{name}.ep=1; README, Models, says why experts are not split over TP ranks)")
            elif shape_ok:
                out.append(f"{name}.{p.dim}={p.size} does not divide model.{p.field}={p.count}")
    return out


def _trainer_is_bf16(dtype: str) -> bool:
    """Is the trainer bf16 ("auto": where this machine multiplies bf16 natively, as the ranks here resolve it)?"""
    if dtype != "auto":
        return dtype == "bf16"
    from megatron_rl.models.precision import resolve_dtype_name  # imports torch: only for "auto"

    return resolve_dtype_name(dtype) == "bf16"


def _between_sections(cfg: JobConfig, model: Optional[ModelConfig], cluster_files: bool) -> list[str]:
    """The rules that tie one section to another (each section's own rules are its class's)."""
    out, r, a = [], cfg.rollout, cfg.algorithm
    if r.samples_per_prompt == 1 and a.advantage in ("rloo", "grpo", "group_mean"):
        out.append(f"rollout.samples_per_prompt={r.samples_per_prompt} must be >= 2 for algorithm.advantage="
                   f"{a.advantage!r} (it compares responses to the same prompt)")
    if model is not None and r.context_length > model.max_position_embeddings:
        out.append(f"rollout.max_prompt_length + rollout.max_new_tokens = {r.context_length} "
                   f"exceeds model.max_position_embeddings={model.max_position_embeddings}")
    try:
        dataset = cfg.data.key
    except ValueError:
        dataset = None  # the data section names the problem
    spec = DATASETS.get(dataset) if dataset is not None else None
    if spec is not None and not spec.demonstrations and cfg.trainer.sft_warmup_steps > 0:
        out.append(f"trainer.sft_warmup_steps={cfg.trainer.sft_warmup_steps}: the supervised warm start needs "
                   f"demonstrations, which only the built-in tasks have; set it to 0 for data.dataset="
                   f"{cfg.data.dataset!r} (start from trained weights with model.checkpoint)")
    if cluster_files:
        out += cfg.data.file_problems() + cfg.model.tokenizer_problems()
    if not cfg.env.episodic and spec is not None and spec.env is not None:
        out.append(f"data.dataset={cfg.data.dataset!r} is played in episodes: set env.cls={spec.env}")
    elif not cfg.env.episodic:
        out += cfg.reward.job_problems(dataset, cfg.generator.dp, import_function=cluster_files)
    else:
        out += _episode_problems(cfg, model, dataset, cluster_files)
    if cluster_files and cfg.run.name_is_plain:
        out += cfg.checkpoint.dir_problems(cfg.run.name)
    if not cfg.trainer.use_distributed_optimizer and _trainer_is_bf16(cfg.trainer.dtype):
        out.append(f"trainer.use_distributed_optimizer=false with a bf16 trainer (trainer.dtype={cfg.trainer.dtype!r}"
                   f"{' here' if cfg.trainer.dtype == 'auto' else ''}) cannot save its optimizer: Megatron-Core "
                   f"0.16's non-distributed mixed-precision optimizer writes its state as if every parameter were "
                   f"bf16, and the trainer keeps its norms in fp32; keep the distributed optimizer, or set "
                   f"trainer.dtype=fp32")
    if (kv := cfg.generator.kv_cache_tokens) and kv < cfg.episode_length:
        out.append(f"generator.kv_cache_tokens={kv} holds less than one sequence at its longest ({cfg.episode_length} "
                   f"tokens)")
    if cfg.trainer.packing and (budget := cfg.trainer.max_tokens_per_micro_batch) and budget < cfg.episode_length:
        longest = "env.max_tokens" if cfg.env.episodic else "rollout.max_new_tokens"
        out.append(f"trainer.max_tokens_per_micro_batch={budget} is less than the longest sequence a step can hold "
                   f"({cfg.episode_length} tokens: rollout.max_prompt_length + {longest}), whole in a micro-batch")
    if cfg.rollout.in_flight and (cfg.env.agent is not None or cfg.generator.pp > 1):
        why = "agents (env.agent) generate" if cfg.env.agent is not None else "a generator of pp > 1 generates"
        out.append(f"rollout.in_flight=true: {why} batch by batch (set rollout.in_flight=false)")
    out += cfg.algorithm.job_problems("algorithm", cfg.reward.model_executor, cfg.env.agent is not None,
                                      cfg.response_budget)
    if cfg.generator.colocated and cfg.generator.layout.size != cfg.trainer.layout.size:
        out.append("generator.colocated=true needs generator.tp*pp*dp equal to trainer.tp*pp*dp (same ranks)")
    return out


def _episode_problems(cfg: JobConfig, model: Optional[ModelConfig], dataset: Optional[str],
                      cluster_files: bool) -> list[str]:
    """A job of episodes (`env.cls`): what it cannot be combined with yet, and its class imported, as workers will."""
    out = []
    if dataset is None:
        out.append(f"{cfg.env.field} needs prompt records for its episodes: set data.dataset (jsonl, gsm8k, ... or "
                   "guess-number, the built-in multi-turn task)")
    if cfg.reward.kind != "auto" or cfg.reward.function:
        out.append(f"{cfg.env.field}: an episode's reward is the sum of its environment's rewards (an agent's "
                   f"return); reward.kind={cfg.reward.kind!r} and reward.function do nothing with it (leave them "
                   f"unset; a reward model on ranks of its own, reward.model with reward.executor.dp >= 1, adds its "
                   f"score of the episode)")
    elif cfg.reward.model and not cfg.reward.model_executor:
        out.append(f"{cfg.env.field}: a reward model scores episodes on ranks of its own: set reward.executor.dp >= 1 "
                   "(its score of the whole episode, times reward.model_coef, is added to the return)")
    if cfg.env.agent is not None and cfg.generator.pp > 1:  # (its restart of a split episode is not built)
        out.append("env.agent plays on a generator of one pipeline stage: set generator.pp=1")
    if cfg.env.answer_steps > 1 and cfg.generator.pp > 1:  # (the lanes' rounds answer at the next round)
        out.append(f"env.answer_steps={cfg.env.answer_steps} needs generator.pp=1: a pipelined generator takes each "
                   f"observation at the lane's next round (set env.answer_steps=1)")
    if model is not None and cfg.episode_length > model.max_position_embeddings:
        out.append(f"rollout.max_prompt_length + env.max_tokens = {cfg.episode_length} exceeds "
                   f"model.max_position_embeddings={model.max_position_embeddings}")
    if cluster_files:
        out += cfg.env.problems_importing()
    return out


def _world_problems(cfg: JobConfig, world: int) -> list[str]:
    if cfg.world_size_needed <= world:
        return []
    t, g, rm = cfg.trainer, cfg.generator, cfg.reward.executor
    return [f"the executors need {cfg.world_size_needed} ranks (trainer {t.tp}x{t.pp}x{t.dp}, generator "
            f"{g.tp}x{g.pp}x{g.dp}{', colocated' if g.colocated else ''}"
            f"{f', reward model {rm.tp}x{rm.dp}' if cfg.reward.model_executor else ''}) but the world has {world}"]


# What `validate(cluster_files=False)` leaves unchecked: the files a job reads on its cluster, which the machine
# that plans it need not have.
CLUSTER_FILES = ("the data files", "model.tokenizer", "reward.function's module", "checkpoint.dir")


def problems(cfg: JobConfig, world_size: Optional[int] = None,
             cluster_files: bool = True) -> tuple[Optional[ModelConfig], list[str]]:
    """(the resolved model or None, every problem `validate` would name)."""
    errors: list[str] = []
    try:
        model: Optional[ModelConfig] = cfg.model.resolve()
    except ValueError as e:
        errors.append(str(e))
        model = None
    if model is not None:
        errors += model_problems(model) + _layout_problems(cfg, model)
        if model.num_moe_experts is not None and cfg.trainer.routing_replay and cfg.generator.pp > 1:
            errors.append(f"trainer.routing_replay=true needs generator.pp=1: a pipelined generator does not record "
                          f"the experts it routes each token to (set trainer.routing_replay=false, or "
                          f"generator.pp=1; was {cfg.generator.pp})")
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if isinstance(section, Section):
            errors += section.problems()
    errors += _between_sections(cfg, model, cluster_files)
    world = world_size if world_size is not None else cfg.run.world_size
    if world is not None and not errors:
        errors += _world_problems(cfg, world)
    return model, errors


def _raise(errors: list[str]) -> None:
    errors = [" ".join(e.splitlines()) for e in errors]
    if len(errors) == 1:
        raise ConfigError(errors[0])
    if errors:
        raise ConfigError(f"{len(errors)} problems: " + "; ".join(errors))


def validate(cfg: JobConfig, world_size: Optional[int] = None, cluster_files: bool = True) -> ModelConfig:
    """Check that the job can run; raise ConfigError naming every problem found. Returns the resolved model.

    Besides the fields' types and ranges, it checks what the ranks would otherwise find minutes later: the files
    the job reads exist (data, tokenizer, reward model) and the first record of each data file loads, the reward
    function imports, and the checkpoint directory can be written. Called once per job, before any process group
    exists (by the launch, on each rank of a torchrun/srun world); ranks receive the resolved model.

    `cluster_files=False` (`megatron-rl plan`, run on a laptop for a cluster's job) skips the checks of
    `CLUSTER_FILES`. The model's and the reward model's config files are still read: the plan needs their shapes."""
    model, errors = problems(cfg, world_size, cluster_files)
    _raise(errors)
    return model

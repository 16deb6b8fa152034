"""`megatron-rl eval CKPT`: accuracy of a checkpoint on GSM8K (test), MATH-500 or in episodes, greedy decoding.

CKPT is a megatron-rl checkpoint directory (`megatron_rl.json` with the model shape, `model/` with the Megatron-Core
dist_checkpointing of the GPTModel: what `convert --to megatron` and training write), or a run's checkpoint root
whose `latest` file names the newest `step_*` directory (held against the run's retention while it is read:
`checkpointing/leases.py`). The files it reads are checked against the checksums the checkpoint records. The model
is loaded at `tp` x `pp` local processes and decoded with our generator (continuous batching, greedy); every
response is scored with the dataset's verifier.

Prompts: the dataset's instruction (GSM8K: answer after `####`; MATH: answer in `\\boxed{}`) around the problem,
through the tokenizer's chat template when `chat` is on (the default when the tokenizer has one), tokenized with
BOS first (not repeated when the template already starts with it). Generation stops at the tokenizer's stop ids
or after `max_new_tokens`.

Precision: the checkpoint's own (a converted model is fp32, a bf16 run's checkpoint bf16) unless `dtype` names one
(`fp32`, `bf16`, or `auto`: bf16 where this machine multiplies it natively). Comparing two checkpoints, give both the
same `dtype`: greedy decoding follows every rounding difference.

Episodes (`--env module:Class`, or a built-in multi-turn task: `--dataset calculator` / `guess-number`, whose
held-out problems are the job's): each problem is one greedy episode played as the job's generators play them
(`environments/play.py`), correct when its return is at least 1; the result adds "env", "mean_return",
"turns_per_episode" and "env_failures", and the samples hold each episode's tokens after its prompt (observations too).

The result: `{"dataset", "checkpoint", "dtype", "n", "correct", "accuracy", "time_s", "tokens_per_s"}`; a problem is
correct when its verifier scores it 1; `time_s` is the whole evaluation (process start, loading, decoding, scoring),
`tokens_per_s` the generated tokens over the decoding time alone.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from megatron_rl.checkpointing import safe_load
from megatron_rl.checkpointing.inspect import reading, resolve_checkpoint as resolve
from megatron_rl.checkpointing.layout import (MODEL_DIR, CheckpointError, InspectError, read_meta,
                                              removed_line, verify_weights)
from megatron_rl.checkpointing.tokenizer import load_checkpoint_tokenizer
from megatron_rl.data import ChatPromptBuilder, DataError, default_data_dir, load_prompt_dataset, registry
from megatron_rl.data.datasets import DATA_DIR_ENV
from megatron_rl.parallel.layout import ParallelLayout, layout_problems
from megatron_rl.rewards import get_reward_fn
from megatron_rl.tokenizers import load_tokenizer

# The datasets `eval` scores: those of the registry with a test file, and the built-in multi-turn tasks (their
# held-out problems generated as the job's are), by canonical name.
DATASETS = {name: spec for name, spec in registry.DATASETS.items() if spec.test_file or spec.env}
GENERATED_PROBLEMS = 100  # the held-out problems of a built-in multi-turn task without --limit


class EvalError(ValueError):
    """An evaluation that cannot run; the message is one line."""


@dataclass
class EvalSettings:
    dataset: str = "gsm8k"
    data_dir: Optional[str] = None
    limit: Optional[int] = None
    max_new_tokens: int = 512
    batch_size: int = 64
    tp: int = 1
    pp: int = 1  # pipeline stages (tp * pp local processes)
    chat: Optional[bool] = None  # None: on when the tokenizer has a chat template
    samples_out: Optional[str] = None
    tokenizer: Optional[str] = None
    dtype: Optional[str] = None  # None: the checkpoint's own; else fp32, bf16 or auto
    env: Optional[str] = None  # play each problem as an episode against env.cls (default: the dataset's own, if any)
    agent: Optional[str] = None  # or have an agent (module:function, as env.agent) play each problem's episode
    max_turns: int = 4  # an episode's model turns (env.max_turns)
    max_tokens: int = 512  # an episode's tokens after its first prompt (env.max_tokens)


# ---- inputs --------------------------------------------------------------------------------------------------------
def resolve_checkpoint(path: Union[str, Path]) -> Path:
    """The checkpoint directory CKPT names: itself, or what a run root's `latest` names (as `inspect` resolves)."""
    try:
        return resolve(Path(path))
    except InspectError as e:
        raise EvalError(str(e)) from None


def read_checkpoint_meta(ckpt: Path):
    """(ModelConfig, CheckpointMeta) of a checkpoint directory."""
    try:
        meta = read_meta(ckpt, formats=None)
        cfg = meta.model_config()
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    if not (ckpt / MODEL_DIR).is_dir():
        raise EvalError(f"{ckpt} has no model/ directory (the Megatron-Core weights)")
    return cfg, meta


def dataset_key(name: str) -> str:
    """The canonical name of an evaluable dataset (`megatron_rl.data.registry`)."""
    try:
        return registry.resolve_dataset(name, among=DATASETS).name
    except registry.UnknownDatasetError as e:
        raise EvalError(str(e)) from None


def data_dir_of(data_dir: Optional[str]) -> Path:
    return Path(data_dir) if data_dir else default_data_dir()


def load_problems(dataset: str, data_dir: Optional[str] = None, limit: Optional[int] = None) -> list:
    """The dataset's PromptRecords (prompt = problem, reference = final answer), the first `limit` of them. A
    built-in multi-turn task's are the held-out problems its job evaluates on (with run.seed 0)."""
    spec = DATASETS[dataset_key(dataset)]
    if limit is not None and limit < 1:
        raise EvalError(f"--limit={limit} must be >= 1")
    if spec.generated:
        return _generated_heldout(spec.name, limit or GENERATED_PROBLEMS)
    rel = spec.test_file
    what = f"{spec.title} test split" if spec.eval_file else spec.title
    file = data_dir_of(data_dir) / rel
    if not file.is_file():
        raise EvalError(f"{what} not found at {file}; pass --data-dir (the folder holding {rel}) or set "
                        f"{DATA_DIR_ENV}")
    try:
        ds = load_prompt_dataset(spec.name, path=file, limit=limit)
    except (DataError, ValueError) as e:
        raise EvalError(str(e)) from None
    return list(ds)


def _generated_heldout(name: str, count: int) -> list:
    from megatron_rl.data import PromptRecord
    from megatron_rl.data.word_problems import CALCULATOR_PROBLEMS, WordProblems
    from megatron_rl.environments.guess import guess_records

    if name == registry.CALCULATOR:
        return WordProblems(**CALCULATOR_PROBLEMS).records("eval", count)
    if name == registry.GUESS:
        return [PromptRecord(id=r["id"], prompt=r["prompt"], reference=r["reference"])
                for r in guess_records(count, seed=10_000)]
    raise EvalError(f"no held-out problems for the generated dataset {name!r}")


def checkpoint_tokenizer(ckpt: Path, override: Optional[str] = None):
    """`override` when given (a HF directory, .gguf, sentencepiece .model or "byte"), else the checkpoint's own."""
    try:
        if override:
            return load_tokenizer(override)
        return load_checkpoint_tokenizer(ckpt)
    except Exception as e:  # noqa: BLE001 - any loader failure is reported in one line
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        where = f"--tokenizer {override}" if override else "the checkpoint's tokenizer (or pass --tokenizer: a Hugging " \
            "Face directory, a .gguf file, a sentencepiece .model, or 'byte')"
        raise EvalError(f"cannot load {where}: {text}") from None


def build_prompts(records: list, tok, task: str, chat: bool) -> list[str]:
    builder = ChatPromptBuilder.for_task(task)
    return [builder.build(r, tok if chat else None) for r in records]


def encode_prompt(tok, text: str) -> list[int]:
    return tok.encode(text, add_bos=tok.bos_id is not None)


# ---- generation on local ranks -------------------------------------------------------------------------------------
def load_model(cfg, model_dir: str, dtype: str, layout: ParallelLayout):
    """On each rank of a world of `layout`'s size: (its executor groups, the GPTModel with this rank's part of the
    checkpoint's weights), built as a job's generator builds it in `dtype` (a bf16 model keeps its norm weights in
    fp32; the stored tensors are rounded to it as they load, whatever dtype they were saved in). `eval`'s and
    `serve`'s ranks load so."""
    # torch and Megatron-Core load in the worker processes only: the commands' argument errors stay fast.
    import torch
    from megatron.core import dist_checkpointing

    from megatron_rl.checkpointing.loader import resume_strategy
    from megatron_rl.models import build_gpt_model
    from megatron_rl.models.sharding import model_sharded_state_dict
    from megatron_rl.parallel import ExecutorPlacement, build_topology

    g = build_topology([ExecutorPlacement("eval", layout)])["eval"]
    model = build_gpt_model(cfg, g.layout, g.pgs, attention="sdpa", params_dtype=getattr(torch, dtype),
                            initialize=False)  # every weight is loaded next
    state = dist_checkpointing.load(model_sharded_state_dict(model, g.pgs.dp_cp), model_dir,
                                    sharded_strategy=resume_strategy(g.pgs.dp_cp))  # reads only this TP rank's part
    model.load_state_dict(state)
    return g, model


def _generate_worker(rank, world_size, cfg, model_dir: str, dtype: str, prompts: list, max_new_tokens: int,
                     stop_ids: tuple, batch_size: int, max_len: int, pp: int = 1, episodes: Optional[dict] = None):
    from megatron_rl.inference import GenerationRequest, Generator, SamplingParams

    g, model = load_model(cfg, model_dir, dtype, ParallelLayout(tp=world_size // pp, pp=pp))
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=tuple(stop_ids))
    if episodes is not None:
        return _play_episodes(rank, model, cfg, g, params, batch_size, **episodes)
    gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=batch_size, max_len=max_len, pp_group=g.pgs.pp)
    outs = gen.generate([GenerationRequest(p, params, request_id=str(i)) for i, p in enumerate(prompts)])
    if rank != 0:  # tp rank 0 of the first stage: every rank of the replica has the outputs
        return None
    return [(o.token_ids, o.finish_reason, o.error) for o in outs], dict(gen.stats)


def _play_episodes(rank, model, cfg, g, params, batch_size: int, *, env, records: list, checkpoint: str,
                   tokenizer: Optional[str], chat: bool):
    """One greedy episode per record against `env` (EnvSettings), played as the job's generators play them
    (`environments/play.py`: environment workers on rank 0, each turn rendered once, the cache slot kept); on rank
    0: per episode (prompt ids, token ids after it, finish reason, error, turns, return), the generator's statistics
    and the episodes'."""
    from megatron_rl.inference import Generator

    if env.agent is not None:  # the agents, through this replica's endpoint (agents/play.py)
        from megatron_rl.agents.play import Agents as Play
    else:
        from megatron_rl.environments.play import Episodes as Play

    tok = checkpoint_tokenizer(Path(checkpoint), tokenizer)
    play = Play(env, tok, chat, g.pgs.mp, rank == 0, params)
    try:
        reqs, turns = play.requests(records, list(range(len(records))), 1)
        max_len = min(cfg.max_position_embeddings, max(len(r.prompt_ids) for r in reqs) + env.max_tokens)
        gen = Generator(model, cfg.vocab_size, g.pgs.tp, max_batch_size=batch_size, max_len=max_len,
                        pp_group=g.pgs.pp)
        outs = gen.generate(reqs, turns=turns)
        if rank != 0:
            return None
        episodes = [(r.prompt_ids, o.token_ids, o.finish_reason, o.error, o.turns, ret)
                    for r, o, ret in zip(reqs, outs, turns.returns())]
        return episodes, dict(gen.stats), turns.statistics(outs)
    finally:
        play.close()


def _dtype_of(meta) -> str:
    dtype = meta.torch_dtype_name
    if dtype not in ("float32", "bfloat16", "float16"):
        raise EvalError(f"checkpoint dtype {dtype!r} is not one of float32, bfloat16, float16")
    return dtype


def _compute_dtype(requested: Optional[str], stored: str) -> str:
    """The torch dtype name the model runs in: `requested` (fp32, bf16, auto) or, when None, the stored one."""
    if requested is None:
        return stored
    from megatron_rl.models.precision import resolve_dtype  # imports torch: only when asked

    try:
        return str(resolve_dtype(requested)).removeprefix("torch.")
    except ValueError:
        raise EvalError(f"--dtype {requested!r} is not one of fp32, bf16, auto") from None


def evaluate(checkpoint: Union[str, Path], settings: Optional[EvalSettings] = None) -> dict:
    """Accuracy of `checkpoint` on the dataset; returns the summary (the line `megatron-rl eval` prints)."""
    t0 = time.perf_counter()
    try:
        held = reading(Path(checkpoint))  # a run's step is kept by its retention until the evaluation ends
    except InspectError as e:
        raise EvalError(str(e)) from None
    with held as ckpt:
        try:
            return _evaluate(ckpt, settings or EvalSettings(), t0)
        except Exception:
            removed = removed_line(ckpt)  # gone anyway: read without a lease (a run directory it cannot write)
            if removed is None:
                raise
            raise EvalError(removed) from None


def _evaluate(ckpt: Path, s: EvalSettings, t0: float) -> dict:
    cfg, meta = read_checkpoint_meta(ckpt)
    spec = DATASETS[dataset_key(s.dataset)]
    env = _env_settings(s, spec)
    for name, value in (("--max-new-tokens", s.max_new_tokens), ("--batch-size", s.batch_size), ("--tp", s.tp),
                        ("--pp", s.pp)):
        if value < 1:
            raise EvalError(f"{name}={value} must be >= 1")
    problems = layout_problems(cfg, ParallelLayout(s.tp, s.pp))  # the sizes are >= 1 here: only divisibility
    if problems:
        p = problems[0]
        raise EvalError(f"--{p.dim}={p.size} does not divide the model's {p.field}={p.count}")
    dtype = _dtype_of(meta)
    compute = _compute_dtype(s.dtype, dtype)
    try:
        verify_weights(ckpt, meta)  # the files read match their checksums
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    records = load_problems(spec.name, s.data_dir, s.limit)  # after the checkpoint's checks: they need no data
    tok = checkpoint_tokenizer(ckpt, s.tokenizer)
    if tok.vocab_size > cfg.vocab_size:
        raise EvalError(f"the tokenizer has {tok.vocab_size} tokens but the model's vocabulary has {cfg.vocab_size}; "
                        f"pass the model's tokenizer with --tokenizer")
    chat = tok.has_chat_template if s.chat is None else s.chat
    if env is not None:
        return _evaluate_episodes(ckpt, s, t0, cfg, compute, tok, chat, env, spec, records)
    texts = build_prompts(records, tok, spec.instruction, chat)
    prompts = [encode_prompt(tok, t) for t in texts]
    max_len = min(cfg.max_position_embeddings, max(len(p) for p in prompts) + s.max_new_tokens)

    outs, stats = _run_ranks(ckpt, s, cfg, compute, tok, prompts, max_len)
    responses = [tok.decode(ids) for ids, _, _ in outs]
    with get_reward_fn(spec.verifier) as verifier:
        scores = verifier.score([(t, r, rec.reference) for t, r, rec in zip(texts, responses, records)])
    correct = sum(1 for x in scores if x >= 1.0)
    if s.samples_out:
        out = Path(s.samples_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w", encoding="utf-8") as f:
            for rec, text, resp, score, (ids, finish, error) in zip(records, texts, responses, scores, outs):
                f.write(json.dumps({"id": rec.id, "prompt": text, "output": resp, "reference": rec.reference,
                                    "score": score, "finish_reason": finish, "new_tokens": len(ids),
                                    **({"error": error} if error else {})}) + "\n")
    return {"dataset": spec.name, "checkpoint": str(ckpt), "dtype": compute, "n": len(records), "correct": correct,
            "accuracy": correct / len(records), "time_s": round(time.perf_counter() - t0, 2),
            "tokens_per_s": round(stats.get("tokens_per_s", 0.0), 1)}


def _run_ranks(ckpt: Path, s: EvalSettings, cfg, compute: str, tok, prompts: list, max_len: int,
               episodes: Optional[dict] = None):
    """`_generate_worker` on s.tp x s.pp local processes, once the checkpoint's pickles are checked; rank 0's
    result."""
    from megatron_rl.launch.spawn import run_local  # imports torch: after the argument checks
    from megatron_rl.launch.world import LaunchError

    try:
        safe_load.check_checkpoint(ckpt)  # its pickles hold only data, before the ranks load them
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    try:
        results = run_local(_generate_worker, s.tp * s.pp, cfg, str(ckpt / MODEL_DIR), compute, prompts,
                            s.max_new_tokens, tuple(sorted(tok.stop_ids)), s.batch_size, max_len, s.pp, episodes,
                            backend="auto", timeout=None, dist_timeout_s=1800.0)
    except LaunchError as e:
        raise EvalError(f"--tp={s.tp} --pp={s.pp}: {e}") from None
    return results[0]


# ---- episodes ------------------------------------------------------------------------------------------------------
def _env_settings(s: EvalSettings, spec):
    """The environment the problems are played against (`--env`, else the dataset's own), or None: one response per
    problem, scored by the dataset's verifier. One line for a class that cannot be one."""
    from megatron_rl.environments.pool import environment_problem, spec_problem
    from megatron_rl.environments.settings import EnvSettings

    if s.agent is not None:
        if s.env is not None:
            raise EvalError("--env and --agent are two ways to play an episode: give one")
        if s.pp > 1:
            raise EvalError("--agent plays on one pipeline stage: leave --pp at 1")
        settings = EnvSettings(agent=s.agent, max_turns=s.max_turns, max_tokens=s.max_tokens)
        problems = settings.rules("--agent") or settings.problems_importing("--agent")
        if problems:
            raise EvalError(problems[0].replace("--agent.agent=", "--agent "))
        return settings
    cls = s.env or spec.env
    if cls is None:
        return None

    problem = spec_problem(cls) or environment_problem(cls)
    if problem:
        raise EvalError(f"--env {cls}: {problem}")
    for name, value in (("--max-turns", s.max_turns), ("--max-tokens", s.max_tokens)):
        if value < 1:
            raise EvalError(f"{name}={value} must be >= 1")
    return EnvSettings(cls=cls, max_turns=s.max_turns, max_tokens=s.max_tokens)


def _evaluate_episodes(ckpt: Path, s: EvalSettings, t0: float, cfg, compute: str, tok, chat: bool, env, spec,
                       records: list) -> dict:
    """Each problem played as one greedy episode against `env`; an episode is correct when its return (the sum of
    its environment's rewards) is at least 1. The summary adds the mean return, turns per episode and the
    environment's failed calls."""
    episodes = dict(env=env, records=records, checkpoint=str(ckpt), tokenizer=s.tokenizer, chat=chat)
    played, stats, totals = _run_ranks(ckpt, s, cfg, compute, tok, [], 0, episodes)
    returns = [ret for *_, ret in played]
    correct = sum(1 for r in returns if r >= 1.0)
    if s.samples_out:
        out = Path(s.samples_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w", encoding="utf-8") as f:
            for rec, (prompt, ids, finish, error, turns, ret) in zip(records, played):
                f.write(json.dumps({"id": rec.id, "prompt": tok.decode(prompt), "output": tok.decode(ids),
                                    "reference": rec.reference, "return": ret, "turns": turns,
                                    "finish_reason": finish, "new_tokens": len(ids),
                                    **({"error": error} if error else {})}) + "\n")
    n = len(records)
    return {"dataset": spec.name, "checkpoint": str(ckpt), "dtype": compute,
            **({"agent": env.agent} if env.agent is not None else {"env": env.cls}), "n": n,
            "correct": correct, "accuracy": correct / n, "mean_return": sum(returns) / n,
            "turns_per_episode": totals["turns"] / n, "env_failures": totals["failures"],
            "time_s": round(time.perf_counter() - t0, 2), "tokens_per_s": round(stats.get("tokens_per_s", 0.0), 1)}

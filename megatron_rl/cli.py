"""The `megatron-rl` command."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import NoReturn, Optional

from megatron_rl.config import CLUSTER_FILES, ConfigError, given_keys, load_config, validate
from megatron_rl.config_fit import fit_episode_budget, fit_to_devices



def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", help="YAML config file (defaults are built in)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="dotted overrides applied after the file, e.g. trainer.tp=2 rollout.staleness=2")


def local_gpus() -> int:
    """The GPUs this machine shows; torch is imported only where NVIDIA devices are present at all."""
    from megatron_rl import quiet

    if not quiet.cuda_devices_present():
        return 0
    from megatron_rl.launch.spawn import local_gpus as count

    return count()


def _fitted(args, devices: int):
    """The configuration of `args`, its layout fitted to `devices` GPUs where the user set none
    (`config_fit.fit_to_devices`), and the reason ("" when nothing was fitted); an episode's token budget fitted to the
    model where the user set none (`config_fit.fit_episode_budget`)."""
    cfg = load_config(args.config, args.overrides)
    given = given_keys(args.config, args.overrides)
    return fit_to_devices(fit_episode_budget(cfg, given), devices, given)


def _load(args, cluster_files: bool = True, devices: int = 0) -> tuple:
    cfg, _ = _fitted(args, devices)
    model = validate(cfg, world_size=cfg.run.world_size, cluster_files=cluster_files)
    return cfg, model


def cmd_train(args) -> int:
    """The job, on ranks started here or as one rank of a torchrun/srun world (`controller/train.py:train`, the
    one path for both). This process prints the summary where it speaks for the job; every rank exits with the
    job's code: 0, 128 + a stop signal, 1 for a failure, 2 for a configuration that cannot run."""
    from megatron_rl.controller.summary import exit_code, stopped_line
    from megatron_rl.controller.train import report_config_error, train, world_from
    from megatron_rl.launch import console
    from megatron_rl.launch.console import below_bar
    from megatron_rl.launch.failures import JobFailed
    from megatron_rl.launch.runlock import RunDirLocked
    from megatron_rl.launch.world import LocalWorld

    # A launched world's rank and size first: then only its rank 0 reports a bad configuration.
    world = world_from(args.launcher)
    console.survive_hangup()  # a closed terminal stops the job (SIGHUP) and must not fail its last lines
    args.rank_in_process = not isinstance(world, LocalWorld)  # see `run`
    # A SIGTERM or SIGHUP before or after the ranks run ends this process through its `finally` clauses (the run
    # lock); while they run, the local launcher forwards it to them, and a launched rank notes it (launch/signals).
    # A SIGHUP this process ignores (`nohup`) stays ignored.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    try:
        if isinstance(world, LocalWorld):
            cfg, fit = _fitted(args, local_gpus())
            world = LocalWorld(cfg.world_size_needed)
        else:  # a launched world's GPUs are its ranks
            from megatron_rl import quiet

            cfg, fit = _fitted(args, world.world_size if quiet.cuda_devices_present() else 0)
        summary = train(cfg, world, fit)
    except ConfigError as e:
        return report_config_error(world, f"megatron-rl: config error: {e}")
    except RunDirLocked as e:
        return report_config_error(world, f"megatron-rl: {e}")
    except JobFailed as e:
        if str(e):  # the local launcher's progress bar may stand unfinished on the console
            print(below_bar(str(e)) if isinstance(world, LocalWorld) else e, file=sys.stderr, flush=True)
        return e.exit_code
    if world.rank == 0:
        print(json.dumps(summary))
        if exit_code(summary):
            print(stopped_line(summary), file=sys.stderr)
    return exit_code(summary)


def cmd_plan(args) -> int:
    """What `train` with the same arguments would need (memory per rank, weight sync, step times), without starting
    it. Exit 0 when every executor fits, 1 when one does not, 2 (one line) for an input plan cannot use."""
    from megatron_rl.planning.calibration import CalibrationError, load_calibration
    from megatron_rl.planning.plan import PlanError, make_plan
    from megatron_rl.planning.report import format_text

    cfg, model = _load(args, cluster_files=False)  # planned where the job's data and run directory need not be
    try:
        gib = None
        if args.gpu_memory is not None:
            try:
                gib = float(args.gpu_memory.removesuffix("GiB").removesuffix("G"))
            except ValueError:
                raise PlanError(f"--gpu-memory {args.gpu_memory!r} is not a device memory size: give GiB per GPU, "
                                f"e.g. 80") from None
        cal = load_calibration(args.calibration)
        if args.filesystem_gbps is not None:
            cal = _with_filesystem_rates(cal, args.filesystem_gbps)
        plan = make_plan(cfg, model, cal, gpu_memory_gib=gib, checkpoint=args.checkpoint)
    except (PlanError, CalibrationError) as e:
        print(f"megatron-rl: plan: {e}", file=sys.stderr)
        return 2
    plan.notes.append(f"not checked here ({', '.join(CLUSTER_FILES)}): `train` checks them where it runs")
    print(json.dumps(plan.to_dict()) if args.json else format_text(plan))
    return 0 if plan.fits else 1


def _with_filesystem_rates(cal, text: str):
    """The calibration with `--filesystem-gbps WRITE[,READ]` (GB/s per node; READ defaults to twice WRITE)."""
    import dataclasses

    from megatron_rl.planning.plan import PlanError

    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        rates = []
    if len(rates) not in (1, 2) or not all(r > 0 for r in rates):
        raise PlanError(f"--filesystem-gbps {text!r}: give the write rate per node in GB/s, and optionally the "
                        f"read rate, e.g. 5 or 5,10")
    write, read = rates[0], rates[1] if len(rates) == 2 else 2 * rates[0]
    sources = {**cal.sources, "filesystem_write_gbps": "--filesystem-gbps",
               "filesystem_read_gbps": "--filesystem-gbps" + ("" if len(rates) == 2 else " (twice the write rate)")}
    return dataclasses.replace(cal, filesystem_write_gbps=write, filesystem_read_gbps=read, sources=sources)


def cmd_world_size(args) -> int:
    """launch/local.sh: the number of ranks the executors of a config need, fitted to this machine's GPUs."""
    cfg, _ = _load(args, devices=local_gpus())
    print(cfg.world_size_needed)
    return 0


def cmd_check_world(args) -> int:
    """The SLURM recipes, before srun: the config against the world it will get, once; prints the run directory."""
    from megatron_rl.controller.rundir import check_run_dir, run_dir_of
    from megatron_rl.controller.train import check_world, timeouts

    cfg = load_config(args.config, args.overrides)
    check_world(cfg, args.world_size)
    timeouts()
    check_run_dir(cfg, run_dir_of(cfg))
    print(run_dir_of(cfg))
    return 0


def cmd_failure_line(args) -> int:
    """The SLURM recipes, after srun ended with an error or a stop: the one line (on stderr); exit status
    `requeue.REQUEUE_EXIT` when the recipe should requeue the job (`controller/requeue.py`)."""
    from pathlib import Path

    from megatron_rl.controller.requeue import REQUEUE_EXIT, allocation_end

    line, requeue = allocation_end(Path(args.run_dir), Path(args.torchrun_log), args.rc, args.stopped_for,
                                   args.requeue, args.job_id)
    print(line, file=sys.stderr)
    return REQUEUE_EXIT if requeue else 0


def _add_launch_script_parsers(sub) -> None:
    """The subcommands the launch scripts call (launch/local.sh, launch/slurm/*.sbatch)."""
    p = sub.add_parser("world-size", help="launch scripts: print the number of ranks the executors of a config need")
    _add_config_args(p)
    p.set_defaults(func=cmd_world_size)
    p = sub.add_parser("check-world", help="launch scripts: check a config against a world of --world-size ranks; "
                                           "print the run directory")
    _add_config_args(p)
    p.add_argument("--world-size", type=int, required=True)
    p.set_defaults(func=cmd_check_world)
    p = sub.add_parser("failure-line", help="launch scripts: the one line for a failed srun")
    p.add_argument("run_dir")
    p.add_argument("torchrun_log")
    p.add_argument("rc", type=int)
    p.add_argument("--stopped-for", help="the stop the batch shell forwarded: timelimit or cancel")
    p.add_argument("--requeue", action="store_true", help="requeue the job after a stop for the time limit")
    p.add_argument("--job-id", default="", help="the SLURM job, for the line")
    p.set_defaults(func=cmd_failure_line)


def cmd_config(args) -> int:
    """The resolved configuration, its layout fitted to this machine's GPUs as `train` would fit it."""
    cfg, _ = _load(args, devices=local_gpus())
    import yaml

    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0


def cmd_presets(args) -> int:
    from megatron_rl.models.presets import PRESETS

    for name, m in PRESETS.items():
        experts = ({"experts": m.num_moe_experts, "experts_per_token": m.moe_router_topk,
                    "active_parameters": m.num_active_parameters()} if m.is_moe else {})
        print(json.dumps({"preset": name, "family": m.family, "parameters": m.num_parameters(),
                          "layers": m.num_layers, "hidden": m.hidden_size, "heads": m.num_attention_heads,
                          "kv_heads": m.num_query_groups, "head_dim": m.kv_channels, "vocab": m.vocab_size,
                          "tied": m.tie_word_embeddings, **experts}))
    return 0


def _model_override(text: str) -> tuple[str, object]:
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"bad override {text!r}: expected KEY=VALUE, e.g. num_query_groups=4")
    return key.strip(), yaml.safe_load(value)


def cmd_reshard_check(args) -> int:
    from megatron_rl.ddma.verify import reshard_check_command

    try:
        summary = reshard_check_command(args.model, dict(args.set or []), args.src, args.dst, colocated=args.colocated,
                                        force=args.force, bucket_bytes=int(args.bucket_mb * (1 << 20)),
                                        seed=args.seed, dtype=args.dtype, wire_dtype=args.wire_dtype,
                                        quantize=args.quantize)
    except ValueError as e:
        print(f"megatron-rl reshard-check: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


def cmd_convert(args) -> int:
    from pathlib import Path

    from megatron_rl.checkpointing.convert import convert
    from megatron_rl.checkpointing.layout import ConversionError

    return _json_or_one_line_error("convert", ConversionError, lambda: convert(
        Path(args.src), Path(args.dst), args.to, dtype=args.dtype, overwrite=args.overwrite, tp=args.tp, pp=args.pp,
        ep=args.ep))


def cmd_eval(args) -> int:
    from megatron_rl.evaluation import EvalError, EvalSettings, evaluate

    settings = EvalSettings(dataset=args.dataset, data_dir=args.data_dir, limit=args.limit,
                            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, tp=args.tp, pp=args.pp,
                            chat=args.chat, samples_out=args.samples_out, tokenizer=args.tokenizer,
                            dtype=args.dtype, env=args.env, agent=args.agent, max_turns=args.max_turns,
                            max_tokens=args.max_tokens)
    return _json_or_one_line_error("eval", EvalError, lambda: evaluate(args.checkpoint, settings))


def cmd_serve(args) -> int:
    from megatron_rl.evaluation import EvalError
    from megatron_rl.evaluation.serve import ServeSettings, serve

    settings = ServeSettings(host=args.host, port=args.port, key=args.key, batch_size=args.batch_size,
                             max_len=args.max_len, max_tokens=args.max_tokens, temperature=args.temperature,
                             top_p=args.top_p, tokenizer=args.tokenizer, chat=args.chat, dtype=args.dtype)
    return _json_or_one_line_error("serve", EvalError, lambda: serve(args.checkpoint, settings))


def _json_or_one_line_error(command: str, errors, fn) -> int:
    """Run fn; print its summary as one JSON line (exit 0) or the expected error as one line (exit 2)."""
    try:
        summary = fn()
    except errors as e:
        print(f"megatron-rl: {command}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


def cmd_inspect(args) -> int:
    from megatron_rl.checkpointing.inspect import run

    return run(args.path, as_json=args.json)


def cmd_resume_check(args) -> int:
    """Whether every rank of a trainer layout would load a checkpoint (or the one a config's job would write)
    exactly, and what each reads: 0, 1 with one line when a rank cannot, 2 for a SOURCE it cannot use."""
    from megatron_rl.planning.resume_check import run

    return run(args.source, config=args.config, overrides=args.overrides, as_json=args.json,
               index_only=args.index_only, checksums=args.checksums)


def _add_resume_check_parser(sub) -> None:
    p = sub.add_parser("resume-check", help="prove from metadata that a resume at a trainer layout finds every "
                                            "element it loads exactly once, and what each rank reads")
    p.add_argument("source", metavar="SOURCE",
                   help="a checkpoint directory (or run root; with --index-only, .metadata files and "
                        "megatron_rl.json suffice), or a job's config YAML (the checkpoint its job would write)")
    p.add_argument("--config", "-c", help="the target job, for a checkpoint SOURCE (default: the checkpoint's own "
                                          "trainer, with the trainer.* overrides)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="the target's settings, e.g. trainer.tp=4 trainer.pp=7 trainer.dp=8")
    p.add_argument("--json", action="store_true", help="one JSON object (every rank's bytes) instead of the report")
    p.add_argument("--checksums", action="store_true",
                   help="also read every file the load reads and compare it with its checksum (default: its size)")
    p.add_argument("--index-only", action="store_true",
                   help="check the index alone (a copy of just the .metadata files and megatron_rl.json), not the "
                        "files it names")
    p.set_defaults(func=cmd_resume_check)


def _add_plan_parser(sub) -> None:
    """`megatron-rl plan` and its arguments."""
    p = sub.add_parser("plan", help="memory per rank, weight-sync and step time of the job `train` would start, "
                                    "without starting it")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="one JSON object instead of the report")
    p.add_argument("--gpu-memory", default=None, metavar="GiB",
                   help="device memory per GPU in GiB (default: the calibration's, 80 for H100)")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="also check that this checkpoint (or run root) loads into the trainer layout")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="device rates, each with its source (default: megatron_rl/planning/h100.yaml)")
    p.add_argument("--filesystem-gbps", default=None, metavar="WRITE[,READ]",
                   help="the checkpoint filesystem's rates per node in GB/s (default: the calibration's, 5,10)")
    p.set_defaults(func=cmd_plan)


def _add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="accuracy of a checkpoint on GSM8K (test), MATH-500 or a built-in multi-turn task, "
                                    "greedy decoding; with --env, in episodes")
    p.add_argument("checkpoint", help="a megatron-rl checkpoint directory, or a run's checkpoint root (uses latest)")
    p.add_argument("--dataset", default="gsm8k",
                   help="gsm8k (test split), math500, or a built-in multi-turn task: calculator, guess-number (played "
                        "in episodes against its environment; default: gsm8k)")
    p.add_argument("--data-dir", default=None,
                   help="folder holding gsm8k/test.jsonl and math500/test.jsonl (default: $MEGATRON_RL_DATA_DIR, "
                        "else ../shared/data next to the repository)")
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N problems only")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=64, help="sequences decoded together (KV cache slots)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size: local processes running the model")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (tp x pp local processes)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the tokenizer's chat template (default: when the tokenizer has one)")
    p.add_argument("--samples-out", default=None, help="write prompt, output and score per problem to this JSONL")
    p.add_argument("--tokenizer", default=None,
                   help="override the checkpoint's tokenizer: a Hugging Face directory, a .gguf file, a "
                        "sentencepiece .model, or 'byte'")
    p.add_argument("--dtype", default=None,
                   help="fp32, bf16 or auto (the machine's fast one); default: the checkpoint's own. Give two "
                        "checkpoints you compare the same --dtype")
    p.add_argument("--env", default=None,
                   help="play each problem as an episode against this environment class (module:Class or "
                        "path/file.py:Class, as env.cls); correct when the episode's return is at least 1")
    p.add_argument("--agent", default=None,
                   help="have this agent (module:function or path/file.py:function, as env.agent) play each problem "
                        "through an OpenAI client against the checkpoint's endpoint; correct when it returns >= 1")
    p.add_argument("--max-turns", type=int, default=4, help="an episode's model turns (as env.max_turns)")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="an episode's tokens after its first prompt (as env.max_tokens)")
    p.set_defaults(func=cmd_eval)

def _add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible endpoint (/v1/chat/completions, /v1/completions) over a "
                                     "checkpoint, without training")
    p.add_argument("checkpoint", help="a megatron-rl checkpoint directory, or a run's checkpoint root (uses latest)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="default: 8000 (0: a free one)")
    p.add_argument("--key", default=None, help="the API key requests must carry (default: a new one, printed)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences decoded together (KV cache slots)")
    p.add_argument("--max-len", type=int, default=None, help="a sequence's most tokens (default: the model's)")
    p.add_argument("--max-tokens", type=int, default=256, help="a reply's most tokens where a request sets none")
    p.add_argument("--temperature", type=float, default=1.0, help="where a request sets none")
    p.add_argument("--top-p", type=float, default=1.0, help="where a request sets none")
    p.add_argument("--tokenizer", default=None, help="override the checkpoint's tokenizer (as eval's)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="render chat requests with the tokenizer's template (default: when it has one)")
    p.add_argument("--dtype", default=None, help="fp32, bf16 or auto; default: the checkpoint's own")
    p.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show the libraries' warnings too (as MEGATRON_RL_LIBRARY_WARNINGS=1 does)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="run the RL job (built-in default when given no arguments)")
    _add_config_args(p)
    p.add_argument("--launcher", choices=["auto", "local", "env"], default="auto",
                   help="local: start the ranks on this machine; env: this process is one rank started by torchrun "
                        "or srun; auto (default): env when WORLD_SIZE is set, else local")
    p.set_defaults(func=cmd_train)
    _add_plan_parser(sub)
    p = sub.add_parser("config", help="print the resolved, validated configuration as YAML")
    _add_config_args(p)
    p.set_defaults(func=cmd_config)
    p = sub.add_parser("convert", help="convert a HF model (a directory of a family in README's Models; Llama also "
                                       "GGUF) <-> Megatron distributed checkpoint")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", required=True, choices=["megatron", "hf"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--overwrite", action="store_true",
                   help="replace dst when it is an empty directory, a converted checkpoint or a Hugging Face model "
                        "directory (anything else is refused)")
    p.add_argument("--tp", type=int, default=1, help="write with N tensor-parallel processes (--to megatron)")
    p.add_argument("--pp", type=int, default=1, help="write with N pipeline stages (--to megatron)")
    p.add_argument("--ep", type=int, default=1,
                   help="write a mixture-of-experts model with N times the processes, each holding 1/N of the "
                        "experts (--to megatron; the checkpoint loads at any EP)")
    p.set_defaults(func=cmd_convert)
    p = sub.add_parser("inspect", help="what a checkpoint (or a run's checkpoint root) holds, without loading it")
    p.add_argument("path", help="a checkpoint directory or a run's checkpoint root")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.set_defaults(func=cmd_inspect)
    _add_resume_check_parser(sub)
    _add_eval_parser(sub)
    _add_serve_parser(sub)
    p = sub.add_parser("presets", help="list the model presets")
    p.set_defaults(func=cmd_presets)
    p = sub.add_parser("reshard-check", help="run DDMA between two layouts on local processes and check every bit")
    p.add_argument("--model", default="tiny", help="model preset (default: tiny)")
    p.add_argument("--src", required=True,
                   help="trainer layout, e.g. tp=2,pp=2,dp=1 (experts: also ep=N[,etp=N], e.g. tp=2,dp=2,ep=2)")
    p.add_argument("--dst", required=True, help="generator layout, e.g. tp=1,dp=2 (or tp=2,ep=2,etp=1)")
    p.add_argument("--colocated", action="store_true", help="generator on the trainer's ranks (from rank 0)")
    p.add_argument("--set", action="append", type=_model_override, metavar="FIELD=VALUE",
                   help="override a model field, e.g. --set num_query_groups=4 (repeatable)")
    p.add_argument("--bucket-mb", type=float, default=64.0, help="staging bound per rank and round (MiB)")
    p.add_argument("--dtype", default="float32", help="parameter dtype of both models (float32, bfloat16)")
    p.add_argument("--wire-dtype", default=None,
                   help="cast every slice to this dtype on the wire (default: each parameter's own dtype)")
    p.add_argument("--quantize", choices=["int8", "fp8"], default=None,
                   help="generator holds 2-D weights as int8 or fp8 (e4m3) with per-row scales, quantized on receive")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true",
                   help="start the processes even when there are more than 4 per CPU core")
    p.set_defaults(func=cmd_reshard_check)
    _add_launch_script_parsers(sub)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The parser's arguments, with dotted overrides allowed on both sides of the options: `train run.steps=3 -c F
    trainer.tp=1` (argparse alone takes positionals only before the first option). Overrides keep their order."""
    args, extra = parser.parse_known_args(argv)
    if extra and (not hasattr(args, "overrides") or any(a.startswith("-") for a in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: Optional[list[str]] = None) -> int:
    return _run(parse_args(build_parser(), argv))


def run() -> NoReturn:
    """The `megatron-rl` command: `main`, then, where this process ran no rank of the job itself, an exit that
    skips the interpreter's teardown (1.2-1.8 s with torch loaded; `launch/exit.py`)."""
    args = parse_args(build_parser(), None)
    code = _run(args)
    if getattr(args, "rank_in_process", False):
        sys.exit(code)
    from megatron_rl.launch.exit import exit_without_teardown

    exit_without_teardown(code)


def _run(args) -> int:
    from megatron_rl import quiet

    if args.verbose:
        os.environ[quiet.SHOW_ENV] = "1"  # the ranks and workers this process starts inherit it
    quiet.install()
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"megatron-rl: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a running job (a job's ranks stop on their own: launch/signals)
        print("megatron-rl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    run()

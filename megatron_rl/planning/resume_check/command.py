"""`megatron-rl resume-check SOURCE`: the trainer of a checkpoint or of a job config, the files the load reads
checked, the rehearsal and its report as text or JSON, with progress on long checks."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Optional


from megatron_rl.checkpointing.layout import CheckpointError, first_line
from megatron_rl.parallel.layout import ParallelLayout, layout_problems
from megatron_rl.planning.resume_check.progress import Progress
from megatron_rl.planning.resume_check.stages import ResumeCheckError, TrainerSpec
from megatron_rl.planning.resume_check.index import (Index, check_files, loading, read_index, rehearsed_index,
                                                     saved_trainer)
from megatron_rl.planning.resume_check.rehearsal import RankBytes, rehearse, report


TRAINER_KEYS = ("trainer.tp", "trainer.pp", "trainer.dp", "trainer.ep", "trainer.dtype", "trainer.attention",
                "trainer.use_distributed_optimizer")


def _trainer_of_checkpoint(index: Index, overrides: list[str], cal) -> TrainerSpec:
    """The checkpoint's own trainer, with the trainer.* settings the overrides give."""
    from megatron_rl.config import ConfigError, given_keys, load_config
    from megatron_rl.planning.plan import executor_dtype

    spec = saved_trainer(index)
    given = given_keys(None, overrides)
    other = sorted(k for k in given if k not in TRAINER_KEYS)
    if other:
        raise ConfigError(f"{other[0]}: with a checkpoint SOURCE and no --config, only {', '.join(TRAINER_KEYS)} "
                          f"apply (the rest is the checkpoint's); give the job with --config")
    cfg = load_config(None, overrides)
    t = cfg.trainer
    # A trainer's experts are split over its DP ranks, each over its TP group (expert TP = TP).
    layout = ParallelLayout(*(getattr(t, k) if f"trainer.{k}" in given else getattr(spec.layout, k)
                              for k in ("tp", "pp", "dp", "ep")))
    problems = layout_problems(spec.model, layout)
    if problems:
        p = problems[0]
        raise ConfigError(f"trainer.ep={layout.ep} does not divide trainer.dp={layout.dp}" if p.dim == "etp x ep"
                          else f"trainer.{p}")
    return dataclasses.replace(
        spec, layout=layout,
        params_dtype=executor_dtype(t.dtype, cal) if "trainer.dtype" in given else spec.params_dtype,
        attention=t.attention if "trainer.attention" in given else spec.attention,
        distributed_optimizer=(t.use_distributed_optimizer if "trainer.use_distributed_optimizer" in given
                               else spec.distributed_optimizer))


def _job_trainer(config: str, overrides: list[str], cal) -> TrainerSpec:
    from megatron_rl.config import load_config, validate
    from megatron_rl.planning.plan import executor_dtype

    cfg = load_config(config, overrides)
    model = validate(cfg, world_size=cfg.run.world_size, cluster_files=False)
    return TrainerSpec.of_job(cfg, model, executor_dtype(cfg.trainer.dtype, cal))


def format_text(r: dict) -> str:
    from megatron_rl.checkpointing.storage import human_bytes as h

    b = r["busiest_rank"]
    lines = [
        f"{r['source']} ({'written' if r['source_kind'] == 'checkpoint' else 'its save'} at {r['written_at']}) into "
        f"the trainer at {r['target']}: every element and object each of its {r['ranks']} ranks loads is in the "
        f"checkpoint exactly once",
        f"  checkpoint    {r['tensors']} tensors in {r['chunks']:,} chunks ({h(r['written_bytes'])}), "
        f"{r['objects']} objects",
        f"  all ranks     read {h(r['read_bytes'])} (x{r['read_bytes'] / max(r['written_bytes'], 1):.3f} the "
        f"checkpoint), need {h(r['needed_bytes'])}",
        f"  busiest rank  tp {b['tp']}, pp {b['pp']}, dp {b['dp']} reads {h(b['read_bytes'])}; the most a rank needs "
        f"is {h(r['max_rank_needed_bytes'])}",
        f"  load          {r['load_s']:.1f} s: checksums {r['checksum_s']:.1f} s, then the busiest of {r['nodes']} "
        f"nodes reads {h(r['busiest_node_read_bytes'])} in {r['read_s']:.1f} s "
        f"({r['rates']['filesystem_read_gbps']:g} GB/s a node)",
    ]
    if r["source_kind"] == "checkpoint":
        f = r.get("files")
        lines.insert(2, f"  files         {f['checked']} files the load reads ({h(f['bytes'])}), each present with "
                        f"its recorded size{', content matching its checksum' if f['checksums'] else ''}"
                     if f else "  files         not checked (--index-only): the index alone")
    if r["ranks"] <= 64:
        lines.append(f"  {'rank':<22}{'reads':>12}{'needs':>12}")
        lines += [f"  {'tp %d, pp %d, dp %d' % (x['tp'], x['pp'], x['dp']):<22}{h(x['read_bytes']):>12}"
                  f"{h(x['needed_bytes']):>12}" for x in r["per_rank"]]
    else:
        lines.append(f"  {'stage':<22}{'reads (max)':>12}{'needs (max)':>12}   (--json: every rank)")
        by_pp: dict[int, list] = {}
        for x in r["per_rank"]:
            by_pp.setdefault(x["pp"], []).append(x)
        lines += [f"  {'pp %d' % pp:<22}{h(max(x['read_bytes'] for x in xs)):>12}"
                  f"{h(max(x['needed_bytes'] for x in xs)):>12}" for pp, xs in sorted(by_pp.items())]
    return "\n".join(lines)


def run(source: str, config: Optional[str] = None, overrides: Optional[list[str]] = None, as_json: bool = False,
        prog: str = "megatron-rl resume-check", index_only: bool = False, checksums: bool = False) -> int:
    """`megatron-rl resume-check SOURCE [--config FILE] [overrides]`: 0 and the report when every rank of the target
    loads the checkpoint exactly; 1 and one line when one cannot; 2 and one line for a SOURCE or overrides it cannot
    use.

    A checkpoint SOURCE is checked as the load will read it: its index, and every file the index names present with
    its recorded size (`check_files`; `checksums`: and its content). `index_only` checks the index alone, for a copy
    of just its `.metadata` files and META (the report says the files were not checked)."""
    from megatron_rl.checkpointing.inspect import InspectError, reading
    from megatron_rl.config import ConfigError
    from megatron_rl.planning.calibration import CalibrationError, load_calibration

    overrides = list(overrides or [])
    progress = Progress(prog)
    t0 = time.perf_counter()
    src = Path(source)
    files = None
    try:
        if index_only and checksums:
            raise ConfigError("--checksums reads the files that --index-only leaves alone: give one of them")
        cal = load_calibration(None)
        if src.is_file() or src.suffix in (".yaml", ".yml"):
            if config is not None:
                raise ConfigError(f"SOURCE {source} is a config: give the target's settings as overrides, not "
                                  f"--config")
            written = _job_trainer(source, [], cal)
            target = _job_trainer(source, overrides, cal)
            progress.begin(f"the checkpoint {source} writes at {written.layout}, built on the meta device",
                           written.layout.tp * written.layout.pp)
            built = {}  # the stages of `written`: the target's too where the overrides change nothing
            index = rehearsed_index(written, src, progress, built)
            ranks = _target(index, target, progress, built if target == written else None)
        else:
            with reading(src) as ckpt:
                index = read_index(ckpt)
                target = loading(_job_trainer(config, overrides, cal) if config is not None else
                                 _trainer_of_checkpoint(index, overrides, cal), index)
                if not index_only:
                    files = check_files(index, checksums, progress)
                ranks = _target(index, target, progress)
        out = report(index, target, ranks, cal)
        out["files"] = files
    except ResumeCheckError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        if as_json:
            print(json.dumps({"ok": False, "source": source, "error": str(e)}))
        return 1
    except (CheckpointError, InspectError, ConfigError, CalibrationError) as e:
        print(f"{prog}: {first_line(e)}", file=sys.stderr)
        return 2
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out) if as_json else format_text(out))
    return 0


def _target(index: Index, target: TrainerSpec, progress: Progress,
            built: Optional[dict] = None) -> list[RankBytes]:
    progress.begin(f"every rank of the trainer at {target.layout} loading it", target.layout.tp * target.layout.pp)
    try:
        return rehearse(index, target, progress, built)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - the builders' assertions for a layout the model cannot take
        raise CheckpointError(f"cannot build the trainer at {target.layout}: {first_line(e)}") from None

"""The readable `megatron-rl plan` report (the JSON object is `Plan.to_dict()`)."""

from __future__ import annotations

from megatron_rl.planning.plan import ExecutorMemory, Plan

GIB = 1 << 30


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _size(n: float) -> str:
    return _gib(n) if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def _executor(e: ExecutorMemory) -> list[str]:
    w = e.worst
    verdict = "fits" if e.fits else "DOES NOT FIT"
    lines = [f"{e.name} ({e.layout}): {verdict}, peak {_gib(w.total)} on {w.rank}, margin "
             f"{_gib(w.margin(e.device_bytes))} of {_gib(e.device_bytes)}"]
    for r in e.ranks:
        parts = ", ".join(f"{k.replace('_', ' ')} {_gib(v)}" for k, v in r.parts.items() if v)
        lines.append(f"  {r.rank:<16} {_gib(r.total):>10}  ({parts})")
    return lines


def format_text(plan: Plan) -> str:
    s, t, a = plan.sync, plan.steps, plan.assumptions
    w = a["workload"]
    lines = [f"model        {plan.model}, {plan.parameters / 1e9:.2f}B parameters; {a['gpus']} GPUs "
             f"({plan.calibration.device}){', colocated executors' if plan.colocated else ''}"
             f"{f', {rm} of them the reward model' if (rm := a.get('reward_model', {}).get('gpus')) else ''}", ""]
    lines += ["memory per rank (exact: parameters, gradients, main weights, optimizer state, 8-bit weights, KV cache; "
              f"modelled: activations ({a['activation_model']}), workspace, reserve)"]
    lines += _executor(plan.trainer) + _executor(plan.generator)
    if plan.reward_model is not None:
        r = a["reward_model"]
        ws = r["scoring_workspace"]
        lines += _executor(plan.reward_model)
        lines.append(f"  (weights: {r['parameters'] / 1e9:.2f}B parameters of {r['path']}, its fp32 head included; "
                     f"scoring workspace: {ws['model']}, batch_size {ws['batch_size']} x {ws['context_tokens']} "
                     f"tokens)")
    lines.append("")
    lines.append(f"weight sync  DDMA: {s.senders} senders, {s.copies:,} copies; busiest rank sends "
                 f"{_gib(s.max_sent_bytes)}, receives {_gib(s.max_received_bytes)}: "
                 f"{s.seconds['nvlink']:.2f} s over NVLink, {s.seconds['infiniband']:.2f} s over InfiniBand")
    lines.append("")
    lines.append(f"step time    workload {w['sequences']} sequences x ({w['prompt_tokens']} + {w['response_tokens']}) "
                 f"tokens; {w['responses']}")
    lines.append(f"  sync  (colocated, {a['sync_baseline']['layout']}): {t.sync_s:.1f} s = generation "
                 f"{t.sync_generation.seconds:.1f} s + training {t.sync_training.seconds:.1f} s")
    lines.append(f"  async (dedicated executors): {t.async_s:.1f} s = max(generation {t.async_generation.seconds:.1f} s, "
                 f"training {t.async_training.seconds:.1f} s) + weight sync {t.async_weight_sync_s:.2f} s "
                 f"({a['weight_sync_link']})")
    d = t.async_training.detail
    lines.append(f"  async training {t.async_training.seconds:.1f} s = compute {d['compute_s']:.1f} s + TP "
                 f"{d['tp_comm_s']:.1f} s + pipeline transfers {d['pp_p2p_s']:.1f} s (each with the 1F1B bubble, "
                 f"{d['pipeline_bubble']:.3f}x) + DP {d['dp_comm_s']:.2f} s")
    lines.append(f"  speed-up {t.speedup:.2f}x")
    for note in plan.notes:
        lines.append(f"  note: {note}")
    if plan.checkpointing:
        c, r = plan.checkpointing, plan.checkpointing["rates"]
        lines += ["", f"checkpoints  {_size(c['busiest_rank_bytes'])} written by the busiest trainer rank "
                      f"({c['busiest_rank']}), {_size(c['total_bytes'])} in all; host memory per rank during a save "
                      f"{_size(c['host_bytes_per_rank'])} (kept between saves)",
                  f"  training waits {c['save_blocking_s']:.2f} s (the copy out at {r['host_copy_gbps']:g} GB/s); "
                  f"the save completes after {c['save_total_s']:.1f} s ({_size(c['node_bytes'])} a node at "
                  f"{r['filesystem_write_gbps']:g} GB/s); a load takes {c['load_s']:.1f} s (checksums "
                  f"{c['load_checksum_s']:.1f} s, then each byte read once: the busiest node's "
                  f"{_size(c['load_node_bytes'])} at {r['filesystem_read_gbps']:g} GB/s a node; set yours: "
                  f"--filesystem-gbps WRITE,READ)"]
    if plan.checkpoint:
        c = plan.checkpoint
        reads = ", ".join(f"{k} {_gib(v)}" for k, v in c["read_bytes_per_rank"].items())
        lines += ["", f"checkpoint   {c['path']}: loads into trainer {plan.trainer.layout} ({c['tensors']} tensors); "
                      f"bytes read per rank: {reads}"]
    lines += ["", "rates: " + "; ".join(f"{k} {getattr(plan.calibration, k)}" for k in plan.calibration.sources)
              + " (sources: --json, or the calibration file)"]
    return "\n".join(lines)

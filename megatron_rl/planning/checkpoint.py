"""Whether a checkpoint loads into a trainer layout, from its metadata alone.

Megatron-Core's dist_checkpointing stores every tensor with its global shape (transformer layers stacked on a first
dimension) and loads any slice of it, so a checkpoint reshards into a layout exactly when every tensor the layout's
stages ask for exists with the same global shape. The one exception is the vocabulary: Megatron marks the embedding
and output layer `allow_shape_mismatch`, so their padded row count may differ (it grows with TP) as long as every
real token's row is there. The keys a stage asks for come from its real modules (`RankModules.checkpoint_keys`,
Megatron's layer-spec key map applied); the shapes from the logical model (`ddma.descriptors`).

Bytes read per rank: its shard of every model tensor in the checkpoint's dtype, and, for a training checkpoint, its
DP share of the optimizer state (stored per parameter, so each rank reads the part its distributed optimizer owns).
"""

from __future__ import annotations

from pathlib import Path

from megatron_rl.checkpointing.reads import read_owners
from megatron_rl.models.presets import ModelConfig
from megatron_rl.parallel.layout import ParallelLayout


class ReshardError(ValueError):
    """A checkpoint that does not load into the planned layout; the message is one line naming the tensor."""


def _expected(model: ModelConfig, stages) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Stacked checkpoint key -> (logical global shape, is vocabulary) for every tensor the stages load."""
    from megatron_rl.ddma.descriptors import logical_params

    logical = {p.name: p for p in logical_params(model)}
    out = {}
    for mods in stages:
        for key, (local, stacked) in mods.checkpoint_keys.items():
            if stacked:
                suffix = ".".join(local.split(".")[3:])
                p = logical[f"decoder.layers.0.{suffix}"]
                out[key] = ((model.num_layers, *p.shape), False)
            else:
                name = "embedding.word_embeddings.weight" if (
                    local == "output_layer.weight" and model.tie_word_embeddings) else local
                p = logical[name]
                out[key] = (tuple(p.shape), p.is_vocab)
    return out


def checkpoint_report(path: Path, model: ModelConfig, layout: ParallelLayout, stages) -> dict:
    """{"path", "loads", "tensors", "read_bytes_per_rank": {"pp N": bytes}}; raises ReshardError (one line) for a
    path that is not a checkpoint or holds another model."""
    from megatron_rl.checkpointing import safe_load
    from megatron_rl.checkpointing.inspect import InspectError, dist_tensors, reading
    from megatron_rl.checkpointing.layout import CheckpointError, read_meta

    try:
        with reading(path) as ckpt:  # a run's step is kept by its retention while it is read
            meta = read_meta(ckpt)
            tensors = {t["name"]: t for t in dist_tensors(ckpt / "model", "model")}
            optimizer = dist_tensors(ckpt / "optimizer", "optimizer") if (ckpt / "optimizer").is_dir() else []
            safe_load.check_checkpoint(ckpt)  # a checkpoint that would run code is named here, not at the resume
    except (InspectError, CheckpointError) as e:
        raise ReshardError(f"--checkpoint: {e}") from None
    expected = _expected(model, stages)
    for key, (shape, is_vocab) in expected.items():
        t = tensors.get(key)
        if t is None:
            raise ReshardError(f"--checkpoint {ckpt}: holds another model: no tensor {key!r} (this model's "
                            f"{model.name} needs it)")
        have = tuple(t["shape"])
        ok = (len(have) == len(shape) and have[1:] == shape[1:] and have[0] >= shape[0]) if is_vocab else have == shape
        if not ok:
            raise ReshardError(f"--checkpoint {ckpt}: holds another model: {key} has global shape {list(have)}, "
                            f"this model ({model.name}) needs {list(shape)}")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise ReshardError(f"--checkpoint {ckpt}: holds another model: it has {extra[0]!r}, which {model.name} at "
                        f"this layout does not")
    model_elements = sum(t["numel"] for t in tensors.values())
    opt_bytes = sum(t["bytes"] for t in optimizer)
    per_rank = {}
    for pp_rank, mods in enumerate(stages):
        read = 0
        for key, (local, stacked) in mods.checkpoint_keys.items():
            t = tensors[key]
            itemsize = t["bytes"] // max(t["numel"], 1)
            n = next(p.numel for p in mods.params if p.name == local)
            read += n * itemsize * (model.num_layers // layout.pp if stacked else 1)
        owned = sum(p.numel for p in mods.params) / layout.dp
        per_rank[f"pp {pp_rank}"] = read + int(opt_bytes * owned / max(model_elements, 1))
    return {"path": str(ckpt), "format": meta.format, "step": meta.step,
            "written_at": meta.layout, "loads": True, "tensors": len(tensors),
            "read_bytes_per_rank": per_rank}


def checkpoint_cost(cfg, model: ModelConfig, stages, cal) -> dict:
    """What saving and loading a training checkpoint costs this job, per trainer rank (`megatron-rl plan`).

    Bytes a rank writes: its DP range of the optimizer's per-parameter state (fp32 main weights and two Adam
    moments: 12 bytes an element; without the distributed optimizer DP rank 0 writes the whole shard's), plus the
    weights its DP rank owns: every DP rank of a shard holds the same weights and each writes a share, assigned
    largest first to the least-loaded rank (`checkpointing/megatron_state.py: spread_replicas`); the KL reference
    model's weights the same way. Host memory during a save: the same bytes (each rank copies what it writes into
    host buffers, kept between saves).

    Bytes a rank reads when the job resumes at its own layout (`checkpointing/loader.py`): a tensor that every DP
    rank of a shard holds (the weights, the KL reference's, and without the distributed optimizer its whole state)
    is read by one of them, `reads.read_owners`' rank, and broadcast; the distributed optimizer's range by the rank
    that owns it; each chunk only as far as the rank needs it. So the weights' reads fall where their writes did.

    Times, from the calibration's rates: training waits while the busiest rank copies its bytes out
    (`host_copy_gbps`, into pinned memory); the save completes when a node's ranks have written theirs
    (`filesystem_write_gbps`, per node; the node holds `gpus_per_node` ranks of the mean size). A load first
    checks every file's checksum, the bytes spread evenly over the trainer's nodes, then reads: it ends with the
    busiest node's reads (the trainer's ranks are the job's first, `gpus_per_node` to a node), both at
    `filesystem_read_gbps` a node; the broadcasts (over the network, faster than the filesystem) are not modelled,
    nor is Megatron-Core's planning (a metadata exchange, about a second on a 2-core CPU)."""
    layout = cfg.trainer.layout
    distributed = cfg.trainer.use_distributed_optimizer
    prefixes = ("", "reference.") if cfg.algorithm.kl_coef > 0 else ("",)  # the policy's weights, the KL reference's

    def balance(sizes: list[tuple[str, int]]) -> list[int]:
        """Each DP rank's bytes of the tensors `read_owners` spreads over the DP group."""
        loads = [0] * layout.dp
        for (_, nbytes), owner in zip(sizes, read_owners([(k, (), b) for k, b in sizes], layout.dp)):
            loads[owner] += nbytes
        return loads

    per_rank, reads, nodes = {}, {}, {}
    for pp_rank, mods in enumerate(stages):
        # A last stage's output layer tied to the first stage's embedding is a copy of it, saved once, by the first.
        copy = [p for p in mods.params if p.name == "output_layer.weight"] if (
            model.tie_word_embeddings and layout.pp > 1 and pp_rank == layout.pp - 1) else []
        weights = balance([(x + p.name, p.nbytes) for x in prefixes for p in mods.params if p not in copy])
        replicated = [(x + p.name, p.nbytes) for x in prefixes for p in mods.params]
        if not distributed:
            replicated += [("optimizer." + p.name, 12 * p.numel) for p in mods.params if p not in copy]
        loaded = balance(replicated)
        for dp_rank, o in enumerate(mods.optimizer):
            elements = o.state_elements - sum(p.numel for p in copy) // (layout.dp if distributed else 1)
            optimizer = 12 * elements if distributed or dp_rank == 0 else 0
            name = f"pp {pp_rank}, dp {dp_rank}"
            per_rank[name] = weights[dp_rank] + optimizer
            reads[name] = loaded[dp_rank] + (12 * elements if distributed else 0)
            for tp_rank in range(layout.tp):
                node = layout.local_rank(tp_rank, pp_rank, dp_rank) // cal.gpus_per_node
                nodes[node] = nodes.get(node, 0) + reads[name]
    busiest = max(per_rank, key=per_rank.get)
    ranks = layout.tp * layout.pp * layout.dp
    total = layout.tp * sum(per_rank.values())
    node = total / ranks * min(cal.gpus_per_node, ranks)
    blocking = per_rank[busiest] / (cal.host_copy_gbps * 1e9)
    read_rate = cal.filesystem_read_gbps * 1e9
    checksum_s, read_s = total / len(nodes) / read_rate, max(nodes.values()) / read_rate
    return {"bytes_per_rank": per_rank, "busiest_rank": busiest, "busiest_rank_bytes": per_rank[busiest],
            "host_bytes_per_rank": per_rank[busiest], "total_bytes": total, "node_bytes": int(node),
            "save_blocking_s": blocking, "save_total_s": blocking + node / (cal.filesystem_write_gbps * 1e9),
            "load_bytes_per_rank": reads, "load_node_bytes": max(nodes.values()),
            "load_s": checksum_s + read_s, "load_checksum_s": checksum_s, "load_read_s": read_s,
            "rates": {"host_copy_gbps": cal.host_copy_gbps, "filesystem_write_gbps": cal.filesystem_write_gbps,
                      "filesystem_read_gbps": cal.filesystem_read_gbps}}

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
    from megatron_rl.checkpointing.inspect import InspectError, dist_tensors, read_meta, resolve_checkpoint

    try:
        ckpt = resolve_checkpoint(path)
        meta = read_meta(ckpt)
        tensors = {t["name"]: t for t in dist_tensors(ckpt / "model", "model")}
        optimizer = dist_tensors(ckpt / "optimizer", "optimizer") if (ckpt / "optimizer").is_dir() else []
    except InspectError as e:
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
    return {"path": str(ckpt), "format": meta.get("format"), "step": meta.get("step"),
            "written_at": meta.get("layout"), "loads": True, "tensors": len(tensors),
            "read_bytes_per_rank": per_rank}

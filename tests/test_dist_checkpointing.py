"""Megatron-Core's dist_checkpointing on the CPU: save in one layout, load in another."""

import torch

from megatron_rl.launch.spawn import run_local
from parallel_workers import dist_checkpoint_worker


def test_save_tp2_pp2_load_tp1_and_tp2_dp2(tmp_path):
    """Saved at TP2 x PP2, loaded at TP1 and TP2 x DP2, by Megatron-Core's own sharded state dict and by
    `model_sharded_state_dict`, whose SwiGLU merges return the parameter the load wrote into (`merge_in_place`):
    both give the saved weights bit for bit."""
    saved = run_local(dist_checkpoint_worker, 4, dict(tp=2, pp=2), str(tmp_path / "ckpt"), "save")[0]
    for layout in (dict(tp=1), dict(tp=2, dp=2)):
        world = layout.get("tp", 1) * layout.get("dp", 1)
        loaded = run_local(dist_checkpoint_worker, world, layout, str(tmp_path / "ckpt"), "load")
        for r in loaded:
            for got in (r["plain"], r["in_place_load"]):  # Megatron-Core's load; ours, into NaN, merges skipped
                assert set(got) == set(saved)
                for k, v in saved.items():
                    assert torch.equal(got[k], v), (layout, k)
            assert r["in_place"] and all(r["in_place"].values()), r["in_place"]
            assert r["elsewhere_merged"]

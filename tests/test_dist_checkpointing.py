"""Megatron-Core's dist_checkpointing on the CPU: save in one layout, load in another."""

import torch

from megatron_rl.launch.spawn import run_local
from parallel_workers import dist_checkpoint_worker


def test_save_tp2_pp2_load_tp1_and_tp2_dp2(tmp_path):
    saved = run_local(dist_checkpoint_worker, 4, dict(tp=2, pp=2), str(tmp_path / "ckpt"), "save")[0]
    for layout in (dict(tp=1), dict(tp=2, dp=2)):
        world = layout.get("tp", 1) * layout.get("dp", 1)
        loaded = run_local(dist_checkpoint_worker, world, layout, str(tmp_path / "ckpt"), "load")
        for r in loaded:
            assert set(r) == set(saved)
            for k, v in saved.items():
                assert torch.equal(r[k], v), (layout, k)

"""Executors with different layouts in one world, each with its own process groups."""

import pytest

from megatron_rl.parallel import ExecutorPlacement, ParallelLayout, check_placements
from megatron_rl.launch.spawn import run_local
from parallel_workers import model_in_two_executors_worker, two_executors_worker


def test_layout_coordinates_follow_megatron_order():
    lay = ParallelLayout(tp=2, pp=2, dp=3)
    seen = set()
    for r in range(lay.size):
        tp, pp, dp = lay.coords(r)
        assert lay.local_rank(tp, pp, dp) == r
        seen.add((tp, pp, dp))
    assert len(seen) == 12
    assert lay.coords(1) == (1, 0, 0)  # TP fastest
    assert lay.coords(2) == (0, 0, 1)  # then DP
    assert lay.coords(6) == (0, 1, 0)  # PP slowest


def test_layout_parse():
    assert ParallelLayout.parse("tp=2,pp=2") == ParallelLayout(2, 2, 1)
    for bad in ("tp=0", "tq=2", "tp=x", "tp"):
        with pytest.raises(ValueError, match="bad layout"):
            ParallelLayout.parse(bad)


def test_placements_beyond_the_world_are_rejected():
    with pytest.raises(ValueError, match="needs ranks 4-7 .* world has only 6"):
        check_placements([ExecutorPlacement("trainer", ParallelLayout(tp=2, pp=2)),
                          ExecutorPlacement("generator", ParallelLayout(tp=4), first_rank=4)], world_size=6)
    with pytest.raises(ValueError, match="used twice"):
        check_placements([ExecutorPlacement("a", ParallelLayout()), ExecutorPlacement("a", ParallelLayout())], 2)


def test_disjoint_executors_have_their_own_groups():
    # trainer TP=2 x PP=2 on ranks 0-3, generator TP=1 x DP=2 on ranks 4-5
    placements = [("trainer", dict(tp=2, pp=2), 0), ("generator", dict(tp=1, dp=2), 4)]
    out = run_local(two_executors_worker, 6, placements, dist_timeout_s=77)
    for rank in range(6):  # every executor group keeps the world's timeout (a slow peer is not a dead one)
        assert [info["timeouts"] for info in out[rank].values() if info] == [{77.0}]
    for rank in range(4):
        t = out[rank]["trainer"]
        assert out[rank]["generator"] is None
        tp_ranks = [0, 1] if rank < 2 else [2, 3]
        assert t["tp"] == (tp_ranks, float(sum(tp_ranks)))
        pp_ranks = [rank % 2, rank % 2 + 2]
        assert t["pp"] == (pp_ranks, float(sum(pp_ranks)))
        assert t["embd"][0] == pp_ranks  # first and last stage
        assert t["dp"] == ([rank], float(rank))
        assert t["mp"] == ([0, 1, 2, 3], 6.0)
    for rank in (4, 5):
        g = out[rank]["generator"]
        assert out[rank]["trainer"] is None
        assert g["dp"] == ([4, 5], 9.0)
        assert g["tp"] == ([rank], float(rank))


def test_colocated_executors_share_ranks_with_different_layouts():
    placements = [("trainer", dict(tp=2), 0), ("generator", dict(tp=1, dp=2), 0)]
    out = run_local(two_executors_worker, 2, placements)
    for rank in (0, 1):
        assert out[rank]["trainer"]["tp"] == ([0, 1], 1.0)
        assert out[rank]["trainer"]["dp"] == ([rank], float(rank))
        assert out[rank]["generator"]["tp"] == ([rank], float(rank))
        assert out[rank]["generator"]["dp"] == ([0, 1], 1.0)


def test_colocated_models_compute_the_same_logits():
    diffs = run_local(model_in_two_executors_worker, 2)
    assert max(diffs) < 1e-5

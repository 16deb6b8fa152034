"""Forward logits and one optimizer step at TP/PP/DP layouts equal a single-process TP=1 PP=1 run (fp32)."""

import pytest
import torch

from megatron_rl.parallel import ParallelLayout
from megatron_rl.launch.spawn import run_local
from parallel_workers import lm_step_worker

# Adam's first step is lr * g / (|g| + eps): a tiny eps turns float noise in near-zero gradients into full-size
# updates. eps=1e-4 keeps the step well conditioned, so 1e-5 measures the parallel arithmetic, not Adam.
OPTIM = dict(lr=1e-3, adam_eps=1e-4)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache = {}

    def get(attention, preset_kw):
        key = (attention, tuple(sorted(preset_kw.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp("ref") / "full.pt"
            ref = run_local(lm_step_worker, 1, dict(tp=1, pp=1, dp=1), preset_kw, None, attention, 2, OPTIM,
                            str(path))[0]
            cache[key] = (str(path), ref)
        return cache[key]

    return get


LAYOUTS = [
    (dict(tp=2, pp=2, dp=2), "sdpa", {}),
    (dict(tp=1, pp=4, dp=2), "sdpa", {}),
    (dict(tp=2, pp=1, dp=2), "local", {}),
    (dict(tp=2, pp=2, dp=1), "sdpa", {"tie_word_embeddings": True}),
]


@pytest.mark.parametrize("layout,attention,preset_kw", LAYOUTS, ids=lambda x: str(x))
def test_layout_matches_single_process(references, layout, attention, preset_kw):
    state_path, ref = references(attention, preset_kw)
    world = ParallelLayout(**layout).size
    results = run_local(lm_step_worker, world, layout, preset_kw, state_path, attention, 1, OPTIM)
    full0 = torch.load(state_path)
    moved = max((ref["params"][k] - full0[k]).abs().max().item() for k in full0)
    assert moved > 1e-4, "the reference step did not change the weights; the comparison would be vacuous"
    seen_dp = set()
    for r in results:
        assert r["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], rel=1e-6)
        assert r["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
        assert not r["metrics"]["skipped"]
        if r["logits"] is not None:
            n = r["logits"].shape[0]
            d = r["dp_rank"]
            seen_dp.add(d)
            torch.testing.assert_close(r["logits"], ref["logits"][d * n:(d + 1) * n], atol=1e-5, rtol=0)
        assert set(r["params"]) == set(ref["params"])
        for k, v in ref["params"].items():
            torch.testing.assert_close(r["params"][k], v, atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    assert seen_dp == set(range(layout["dp"]))

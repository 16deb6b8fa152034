"""The staleness study's statistics (benchmarks/staleness.py) against hand computations."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
_spec = importlib.util.spec_from_file_location("staleness_study", BENCH / "staleness.py")
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


def _run(setting, seed, last):
    return {"setting": setting, "seed": seed, "last": last, "heldout": 100}


def test_a_settings_mean_over_seeds_and_its_standard_error_with_the_binomial_floor():
    results = [_run("a", 0, 0.5), _run("a", 1, 0.7), _run("b", 0, 0.4), _run("b", 1, 0.4)]
    a, b = study.seed_stats(results)
    # a: seeds spread s^2 = (0.1^2 + 0.1^2) / 1 = 0.02 above the binomial 0.6 * 0.4 / 100: SE = sqrt(0.02 / 2)
    assert (a["seeds"], a["mean"], a["se"]) == (2, pytest.approx(0.6), pytest.approx(0.1))
    # b: no spread between its two seeds; the binomial variance 0.4 * 0.6 / 100 is the floor: sqrt(0.0024 / 2)
    assert (b["mean"], b["se"]) == (pytest.approx(0.4), pytest.approx(0.0024 ** 0.5 / 2 ** 0.5))
    q = study.paired(results, "a", "b")
    # differences 0.1 and 0.3: mean 0.2, s^2 = 0.02 > 2 x 0.0024: SE = sqrt(0.02 / 2) = 0.1, two SE
    assert (q["seeds"], q["diff"], q["se"], q["in_se"]) == (2, pytest.approx(0.2), pytest.approx(0.1),
                                                            pytest.approx(2.0))
    assert study.paired(results, "a", "c") is None


def test_run_directories_name_setting_and_seed_and_every_new_correction_is_a_setting():
    assert study._setting_and_seed("async4-mask-seed2") == ("async4-mask", 2)
    assert study._setting_and_seed("async4-uncorrected") == ("async4-uncorrected", None)
    assert study.run_name("sync", 1) == "sync-seed1" and study.run_name("sync", None) == "sync"
    for correction in ("mask", "decoupled", "sequence"):
        assert f"algorithm.correction={correction}" in study.SETTINGS[f"async4-{correction}"]
    assert all(a in study.SETTINGS and b in study.SETTINGS for a, b in study.PAIRS)


def test_a_run_made_without_seeds_joins_a_seeded_study_as_its_seed_0(tmp_path):
    def study_file(name, seed, lasts):
        rows = [{**_run(s, seed, last), "start": 0.1} for s, last in lasts.items()]
        (tmp_path / name).write_text(json.dumps({"config": None, "results": rows}))
        return tmp_path / name

    first = study_file("first.json", None, {"sync": 0.7, "async1": 0.6})  # run.seed 1234, before --seeds
    later = study_file("later.json", 1, {"sync": 0.8, "async1": 0.6})     # --seeds 2 --first-seed 1
    results = study.collect([first, later])
    assert [(r["setting"], r["seed"]) for r in results] == [("sync", 0), ("sync", 1), ("async1", 0), ("async1", 1)]
    assert study.paired(results, "async1", "sync")["seeds"] == 2
    again = study_file("again.json", 0, {"sync": 0.7})
    with pytest.raises(SystemExit, match="sync-seed0 is in both"):
        study.collect([first, again])


def test_the_lag_alone_is_syncs_curve_delayed_by_the_staleness_and_the_rest_is_paired_over_seeds():
    def run(setting, seed, curve, train=None):
        return {"setting": setting, "seed": seed, "heldout": 100, "last": curve[-1][1],
                "curve": [[step, None, r] for step, r in curve], "train": train}

    results = [run("sync", 0, [(0, 0.2), (10, 0.4), (20, 0.6)]), run("sync", 1, [(0, 0.2), (10, 0.5), (20, 0.5)]),
               run("async4", 0, [(0, 0.2), (20, 0.3)]), run("async4", 1, [(0, 0.2), (20, 0.4)])]
    q = study.lag_alone(results, "async4")
    # seed 0: sync at step 16 = 0.4 + 0.6 x 0.2 = 0.52, so the lag is 0.6 - 0.52 = 0.08 and the rest 0.52 - 0.3 = 0.22;
    # seed 1: sync is 0.5 at 16 and 20: no lag, the rest 0.5 - 0.4 = 0.1. Rests 0.22 and 0.1: s^2 = 0.0072, above
    # the binomial floor 0.55 x 0.45 / 100 + 0.35 x 0.65 / 100 = 0.00475, so SE = sqrt(0.0072 / 2) = 0.06.
    assert (q["seeds"], q["lag"], q["rest"], q["gap"], q["rest_se"]) == (
        2, pytest.approx(0.04), pytest.approx(0.16), pytest.approx(0.2), pytest.approx(0.06))
    assert study.lag_alone(results, "sync") is None and study.lag_alone(results, "async1") is None
    with pytest.raises(ValueError, match="outside"):
        study._interpolate(results[0]["curve"], 25)


def test_train_reward_is_compared_at_the_same_policy_versions():
    # (step, generated_with_version, reward): sync samples version v at step v; staleness 2 samples version 0 at
    # steps 0-2 and version 1 at step 3
    results = [{"setting": "sync", "seed": 0, "train": [(0, 0, 0.1), (1, 1, 0.2), (2, 2, 0.3), (3, 3, 0.4)]},
               {"setting": "async2", "seed": 0, "train": [(0, 0, 0.1), (1, 0, 0.3), (2, 0, 0.2), (3, 1, 0.1)]},
               {"setting": "async4", "seed": 0, "train": None}]  # a run kept without its per-step rows
    q = study.by_version(results, "async2", last=2)
    # versions 0 and 1: async2's version 0 batches average 0.2 and its version 1 batch is 0.1, (0.2 + 0.1) / 2 =
    # 0.15, against sync's (0.1 + 0.2) / 2 = 0.15
    assert q["versions"] == (0, 1) and q["diff"] == pytest.approx(0.0) and q["se"] is None
    q = study.by_version(results, "async2", last=1)  # version 1 only: 0.1 - 0.2
    assert q["versions"] == (1, 1) and q["diff"] == pytest.approx(-0.1)
    assert study.by_version(results, "async4") is None

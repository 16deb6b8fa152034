"""Weights & Biases logging (`run.wandb`), always offline: what a job logged is read back from the W&B files in its
run directory (the record log `run-<id>.wandb`, its media files) and compared with metrics.jsonl. No test logs in,
and W&B's server address points at a closed local port, so nothing can reach a server."""

import json
import math
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config, validate
from megatron_rl.controller.metrics import WandbLogger, open_metrics, read_metrics, wandb_mode


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """The environment of a machine without a W&B login, with W&B's own directories inside tmp_path."""
    env = {"WANDB_MODE": "offline", "WANDB_BASE_URL": "http://127.0.0.1:9", "NETRC": str(tmp_path / "no-netrc"),
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
           "WANDB_DATA_DIR": str(tmp_path / "wandb-data"), "WANDB_ARTIFACT_DIR": str(tmp_path / "wandb-artifacts")}
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def _records(path: Path) -> list:
    """The protobuf records of a W&B record log: a 7-byte header (":W&B", magic, version), then LevelDB-style
    log blocks of 32 KiB, each record split into chunks with a 7-byte header (crc, length, type)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, chunks, out = 32768, 7, [], []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 2):  # full, first
            chunks = [payload]
        elif kind in (3, 4):  # middle, last
            chunks.append(payload)
        else:
            continue
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            out.append(record)
    return out


def _offline_runs(run_dir: Path) -> list[dict]:
    """Each offline W&B run in a run directory, oldest first: id, project, name, history {step: {key: value}},
    the sample table's rows (from every increment the history points at), and the logged image files."""
    runs = []
    for d in (run_dir / "wandb").glob("offline-run-*"):
        (log,) = d.glob("run-*.wandb")
        run = {"id": log.stem[len("run-"):], "history": {}, "samples": [], "images": []}
        for record in _records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["project"], run["name"] = record.run.project, record.run.display_name
                run["started"] = record.run.start_time.ToNanoseconds()
            if kind != "history":
                continue
            items = {("/".join(i.nested_key) if i.nested_key else i.key): json.loads(i.value_json)
                     for i in record.history.item}
            run["history"][record.history.step.num] = items
            if "samples/path" in items:
                run["samples"] += json.loads((d / "files" / items["samples/path"]).read_text())["data"]
            if "plot/path" in items:
                run["images"].append(d / "files" / items["plot/path"])
        runs.append(run)
    return sorted(runs, key=lambda r: r["started"])


def _scalars(row: dict) -> dict:
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v)}


def _assert_logged(run: dict, rows: list[dict]) -> None:
    """Every finite number of every row at the row's step, and each row's samples in order in the table."""
    assert sorted(run["history"]) == [r["step"] for r in rows]
    for row in rows:
        logged = run["history"][row["step"]]
        for key, value in _scalars(row).items():
            assert logged[key] == pytest.approx(value, rel=1e-12), key
    assert [tuple(x) for x in run["samples"]] == [(r["step"], i, t) for r in rows for i, t in enumerate(r["samples"])]


# ---- configuration and mode -------------------------------------------------------------------------------------


def test_wandb_config_is_nested_and_checked_in_one_line(tmp_path, monkeypatch):
    cfg = load_config(None, ["run.wandb.mode=offline", "run.wandb.project=p", "run.wandb.entity=team"])
    assert (cfg.run.wandb.mode, cfg.run.wandb.project, cfg.run.wandb.entity) == ("offline", "p", "team")
    assert cfg.run.wandb.enabled and not load_config().run.wandb.enabled
    assert load_config(None, ["run.wandb.project=p"]).run.wandb.enabled  # auto: a project turns it on
    assert not load_config(None, ["run.wandb.project=p", "run.wandb.mode=disabled"]).run.wandb.enabled
    f = tmp_path / "job.yaml"
    f.write_text("run:\n  name: x\n  wandb:\n    mode: online\n    name: nice\n")
    assert load_config(f).run.wandb.name == "nice" and load_config(f).run.wandb.mode == "online"
    for overrides, message in [
        (["run.wandb.mod=offline"], r"^unknown key 'run.wandb.mod' \(did you mean 'run.wandb.mode'\?\)$"),
        (["run.wandbb.mode=offline"], r"^unknown key 'run.wandbb' \(did you mean 'run.wandb'\?\)$"),
        (["run.wandb.mode=cloud"], r"^run.wandb.mode='cloud' is not allowed: expected one of 'auto', 'online'"),
        (["run.wandb=offline"], r"^run.wandb='offline' must be a mapping of its keys"),
        (["run.name.x=1"], r"^'run.name.x' must be SECTION.KEY"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^run.wandb.mode='offline' needs the wandb package: pip install") as e:
        validate(load_config(None, ["run.wandb.mode=offline"]))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^run.wandb.project='p' needs the wandb package"):
        validate(load_config(None, ["run.wandb.project=p"]))
    validate(load_config())  # off by default: no wandb needed


def test_auto_mode_is_offline_without_a_login(tmp_path):
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password k\n")
    other = tmp_path / "other"
    other.write_text("machine example.org\n  login user\n  password k\n")
    missing = str(tmp_path / "missing")
    assert wandb_mode("auto", {"NETRC": missing}) == "offline"
    assert wandb_mode("auto", {"NETRC": missing, "WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode("auto", {"NETRC": str(netrc)}) == "online"
    assert wandb_mode("auto", {"NETRC": str(other)}) == "offline"
    assert wandb_mode("auto", {"NETRC": str(other), "WANDB_BASE_URL": "https://example.org"}) == "online"
    assert wandb_mode("auto", {"NETRC": str(netrc), "WANDB_MODE": "offline"}) == "offline"
    assert wandb_mode("offline", {"WANDB_API_KEY": "k"}) == "offline"
    assert wandb_mode("online", {}) == "online"


# ---- logging ------------------------------------------------------------------------------------------------------


def _rows(steps, tag):
    return [{"step": s, "reward": 0.25 * s, "time/total_s": 1.5 + s, "eval/reward": 1 / 3, "skipped": 0,
             "samples": [f"{tag} {s} a", f"{tag} {s} b"], "grad_norm": float("nan"), "flag": True} for s in steps]


def test_relaunch_resumes_the_same_wandb_run_and_a_fresh_start_begins_another(tmp_path, offline):
    pytest.importorskip("wandb")
    cfg = load_config(None, ["run.wandb.mode=offline", "run.name=unit"])
    run_dir = tmp_path / "run"
    for start, steps, tag in ((0, [0, 1, 2], "first"), (2, [2, 3], "resumed"), (0, [0], "fresh")):
        writer = open_metrics(cfg, run_dir, start)
        assert writer.wandb is not None
        for row in _rows(steps, tag):
            writer.write(row)
        writer.close()
    # `finish` returns once W&B's service has taken the run's records; its writer may still be writing them to the
    # offline file (a job's process exits through W&B's own teardown, which waits). Read after the same wait.
    import wandb

    wandb.teardown()
    first, resumed, fresh = _offline_runs(run_dir)
    assert first["id"] == resumed["id"] != fresh["id"]
    assert (run_dir / WandbLogger.ID_FILE).read_text().strip() == fresh["id"]
    assert first["project"] == "megatron-rl" and first["name"] == "unit"
    _assert_logged(first, _rows([0, 1, 2], "first"))
    _assert_logged(resumed, _rows([2, 3], "resumed"))
    _assert_logged(fresh, _rows([0], "fresh"))
    assert all("grad_norm" not in h and "flag" not in h for h in first["history"].values())
    # The plot at the end covers every row metrics.jsonl has, earlier processes' included.
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0]
    assert len(resumed["images"]) == 1 and resumed["images"][0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 3 in resumed["history"] and "plot/path" in resumed["history"][3]


def test_short_job_logs_its_metrics_plot_and_samples_to_offline_wandb(tmp_path, offline):
    pytest.importorskip("wandb")
    import os

    import warm_cli

    cmd = ["train", "run.steps=3", "trainer.sft_warmup_steps=0",
           "run.eval_interval=2", "rollout.prompts_per_step=4", "data.eval_size=8", f"checkpoint.dir={tmp_path}",
           "run.name=t", "run.wandb.mode=offline", "run.wandb.project=megatron-rl-test"]
    out = warm_cli.run(cmd, env={**os.environ, **offline})
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])  # W&B printed nothing after the summary
    run_dir = tmp_path / "t"
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert summary["steps"] == 3 and [r["step"] for r in rows] == [0, 1, 2]
    (run,) = _offline_runs(run_dir)
    assert run["project"] == "megatron-rl-test" and run["name"] == "t"
    assert run["id"] == (run_dir / WandbLogger.ID_FILE).read_text().strip()
    _assert_logged(run, rows)
    assert {"reward", "loss", "time/total_s", "eval/reward"} <= set(run["history"][2])
    assert len(run["images"]) == 1 and run["images"][0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""Launching in an externally started world: the SLURM recipes run under a stand-in srun/scontrol, torchrun starts
the ranks, `train --launcher env` runs the job; a world of the wrong size fails at once with one line; the recipes
name configs that fit the GPUs they ask for."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config, validate
from megatron_rl.controller.train import check_world
from megatron_rl.launch.world import LaunchError, env_world, resolve_launcher

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "launch" / "slurm").glob("*.sbatch"))

FAKE_SRUN = r"""#!/bin/bash
# Stand-in for srun inside an allocation, ntasks-per-node=1: one task per node, all on this machine.
nodes=${SLURM_NNODES:-1}
kill_on_bad_exit=0
while [[ $# -gt 0 && "$1" == -* ]]; do
    case "$1" in
        --nodes=*) nodes=${1#--nodes=} ;;
        -N) nodes=$2; shift ;;
        --kill-on-bad-exit*|-K) kill_on_bad_exit=1 ;;
    esac
    shift
done
echo "srun nodes=$nodes: $*" >> "$FAKE_SLURM_LOG"
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM  # as srun does, a SIGTERM goes on to every task
for ((i = 0; i < nodes; i++)); do
    SLURM_PROCID=$i SLURM_NODEID=$i SLURM_LOCALID=0 SLURM_NNODES=$nodes SLURM_NTASKS=$nodes SLURM_STEP_ID=0 "$@" &
    pids+=($!)
done
rc=0
while (( ${#pids[@]} )); do
    done_pid=""
    wait -n -p done_pid "${pids[@]}"; status=$?
    [[ -n $done_pid ]] || continue  # the forwarded signal ended the wait, not a task
    left=(); for p in "${pids[@]}"; do [[ $p == "$done_pid" ]] || left+=("$p"); done; pids=("${left[@]}")
    if (( status != 0 )); then
        rc=$status
        if (( kill_on_bad_exit )) && (( ${#pids[@]} )); then kill "${pids[@]}" 2>/dev/null; fi
    fi
done
exit $rc
"""

FAKE_SCONTROL = r"""#!/bin/bash
# Stand-in for `scontrol show hostnames LIST` (comma-separated host names only) and `scontrol requeue JOBID`
# (recorded in $FAKE_SLURM_LOG).
if [[ "$1" == show && "$2" == hostnames ]]; then tr ',' '\n' <<< "$3"; exit 0; fi
if [[ "$1" == requeue && -n "$2" ]]; then echo "scontrol requeue $2" >> "$FAKE_SLURM_LOG"; exit 0; fi
echo "fake scontrol: unsupported: $*" >&2
exit 1
"""

# The 8B recipe's config, shrunk to the tiny model on 3 CPU processes.
TINY = ["model.preset=tiny", "trainer.tp=2", "trainer.pp=1", "trainer.dp=1", "trainer.dtype=fp32",
        "trainer.micro_batch_size=64", "trainer.lr=1e-4", "trainer.sft_warmup_steps=2", "generator.tp=1",
        "generator.dp=1", "generator.dtype=fp32", "generator.max_batch_size=16", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_prompt_length=48", "rollout.max_new_tokens=8",
        "data.dataset=synthetic-arithmetic", "data.eval_size=4", "reward.kind=auto", "reward.num_workers=1",
        "run.steps=2", "run.world_size=3", "run.eval_interval=10"]


@pytest.fixture
def slurm_env(tmp_path):
    """The environment of an sbatch allocation of one node, with srun and scontrol stand-ins on PATH. Its
    MASTER_PORT is held for the test (`reserve_port`): torchrun's store listens on it, and no other process's bind
    to port 0 (another xdist worker's world) is handed it meanwhile."""
    from megatron_rl.launch.spawn import reserve_port

    held = reserve_port()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SLURM_JOB_ID="4242", SLURM_NNODES="1",
               SLURM_JOB_NODELIST="localhost", SLURM_SUBMIT_DIR=str(REPO), FAKE_SLURM_LOG=str(tmp_path / "srun.log"),
               MASTER_PORT=str(held.getsockname()[1]), TORCHRUN=f"{sys.executable} -m torch.distributed.run",
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with held:
        yield env


def _sbatch(script, env, args, cwd, timeout=240):
    return subprocess.run(["bash", str(script), *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


TWO_NODES = [*TINY, "generator.dp=2", "run.world_size=4"]  # 2 nodes x 2 ranks: trainer TP2, generator DP2
# 2 nodes x 1 rank (a trainer, a generator): what a multi-node failure or stop needs, at half the cold-started ranks
ONE_PER_NODE = [*[o for o in TINY if not o.startswith(("trainer.tp=", "run.world_size="))], "trainer.tp=1",
                "run.world_size=2"]


def test_8b_recipe_runs_the_job_on_two_nodes_under_srun_and_torchrun(slurm_env, tmp_path):
    env = dict(slurm_env, SLURM_NNODES="2", SLURM_JOB_NODELIST="localhost,localhost", GPUS_PER_NODE="2",
               PYTHON=sys.executable)
    out = _sbatch(REPO / "launch/slurm/llama3_8b.sbatch", env,
                  [*TWO_NODES, f"checkpoint.dir={tmp_path / 'ckpt'}", "run.name=slurm"], cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    srun = (tmp_path / "srun.log").read_text().splitlines()
    assert len(srun) == 1 and srun[0].startswith("srun nodes=2: ")
    assert f"--rdzv-endpoint localhost:{env['MASTER_PORT']}" in srun[0] and "--nproc-per-node 2" in srun[0]
    assert "-c configs/llama3-8b.yaml" in srun[0] and "--launcher env" in srun[0]
    run_dir = tmp_path / "ckpt" / "slurm"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert [r["generated_with_version"] for r in rows] == [0, 0]  # async, staleness 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["launcher"] == "env (torchrun)" and summary["world_size"] == 4 and summary["steps"] == 2
    assert json.loads(out.stdout.strip().splitlines()[-1])["run_dir"] == str(run_dir)  # printed by rank 0 only
    assert out.stdout.count('"run_dir"') == 1
    assert "preset: tiny" in (run_dir / "config.yaml").read_text()
    assert out.stderr == ""  # progress and torchrun's lines are in the log the banner names
    assert f"progress in {run_dir / 'torchrun-4242.log'}" in out.stdout


def test_a_bad_config_under_the_recipe_is_one_line_and_starts_nothing(slurm_env, tmp_path):
    env = dict(slurm_env, SLURM_NNODES="2", GPUS_PER_NODE="2", PYTHON=sys.executable)
    out = _sbatch(REPO / "launch/slurm/llama3_8b.sbatch", env,
                  [*TWO_NODES, "reward.kind=function", "reward.function=reward_fns:says_mat",
                   f"checkpoint.dir={tmp_path / 'ckpt'}"], cwd=tmp_path, timeout=120)
    assert out.returncode == 2
    assert out.stderr.startswith("megatron-rl: config error: ") and len(out.stderr.strip().splitlines()) == 1, \
        out.stderr
    assert not (tmp_path / "srun.log").exists() and not (tmp_path / "ckpt").exists()


def test_a_dead_rank_under_the_recipe_is_one_line_naming_it(slurm_env, tmp_path):
    env = dict(slurm_env, SLURM_NNODES="2", SLURM_JOB_NODELIST="localhost,localhost", GPUS_PER_NODE="1",
               PYTHON=sys.executable, MEGATRON_RL_FAILPOINT="train_step:1")
    out = _sbatch(REPO / "launch/slurm/llama3_8b.sbatch", env,
                  [*ONE_PER_NODE, "run.steps=4", f"checkpoint.dir={tmp_path / 'ckpt'}", "run.name=dead"], cwd=tmp_path)
    assert out.returncode != 0
    log = tmp_path / "ckpt" / "dead" / "torchrun-4242.log"
    assert re.fullmatch(rf"megatron-rl: rank 0 \(trainer\) died with signal 9 \(SIGKILL\); torchrun's report: "
                        rf"{log}\n", out.stderr), out.stderr[-3000:]
    assert "ChildFailedError" in log.read_text()


def test_too_small_world_fails_at_once_with_one_line(slurm_env, tmp_path):
    line = "megatron-rl: config error: executors need 3 ranks (trainer 2 + generator 1) but 2 were launched"
    # The SLURM recipe on one node with 2 GPUs.
    out = _sbatch(REPO / "launch/slurm/llama3_8b.sbatch", dict(slurm_env, GPUS_PER_NODE="2"),
                  [*TINY, f"checkpoint.dir={tmp_path / 'a'}"], cwd=tmp_path, timeout=120)
    assert out.returncode != 0
    assert out.stderr.count(line) == 1, out.stderr[-3000:]
    assert not (tmp_path / "a").exists()  # nothing was started, not even the run directory
    # The local torchrun script with 2 processes.
    out = subprocess.run(["bash", str(REPO / "launch/local.sh"), *TINY, f"checkpoint.dir={tmp_path / 'b'}"],
                         env=dict(slurm_env, NPROC="2"), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and out.stderr.count(line) == 1, out.stderr[-3000:]


@pytest.mark.parametrize("script", RECIPES, ids=lambda p: p.name)
def test_recipe_is_valid_bash_and_its_config_fits_its_allocation(shared_data, script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.M))
    assert sbatch["ntasks-per-node"] == "1" and "exclusive" in sbatch
    nodes, gpus = int(sbatch["nodes"]), int(sbatch["gpus-per-node"])
    config = re.search(r"^CONFIG=\$\{CONFIG:-(\S+)\}", text, re.M).group(1)
    assert re.search(rf"SLURM_NNODES:-{nodes}\}}", text) and re.search(rf"GPUS_PER_NODE:-{gpus}\}}", text)
    assert 'scontrol show hostnames "${SLURM_JOB_NODELIST' in text and "--rdzv-backend c10d" in text
    assert '-m megatron_rl.cli train --launcher env -c "$CONFIG" "$@"' in text
    cfg = load_config(REPO / config)
    validate(cfg)  # what `megatron-rl config -c FILE` checks, with run.world_size
    assert cfg.run.world_size == nodes * gpus == cfg.world_size_needed
    check_world(cfg, nodes * gpus)
    from megatron_rl.cli import main

    assert main(["config", "-c", str(REPO / config)]) == 0


def test_launcher_choice_and_environment(tmp_path, monkeypatch):
    assert resolve_launcher("auto", {"WORLD_SIZE": "4"}) == "env"
    assert resolve_launcher("auto", {}) == "local"
    assert resolve_launcher("local", {"WORLD_SIZE": "4"}) == "local"
    w = env_world({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "1234"})
    assert (w.rank, w.world_size, w.local_rank, w.master_addr, w.master_port, w.source) == (5, 8, 1, "h0", 1234,
                                                                                            "torchrun")
    # srun without torchrun: the rendezvous host is the first node of the allocation (through scontrol).
    (tmp_path / "scontrol").write_text(FAKE_SCONTROL)
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    w = env_world({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
                   "SLURM_JOB_NODELIST": "node7,node8"})
    assert (w.rank, w.world_size, w.local_rank, w.master_addr, w.master_port, w.source) == (3, 4, 1, "node7", 29500,
                                                                                            "slurm")
    with pytest.raises(LaunchError, match="torchrun .* or srun"):
        env_world({})
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        env_world({"RANK": "0", "WORLD_SIZE": "2"})
    cfg = load_config(None, ["generator.colocated=true", "generator.tp=2"])
    with pytest.raises(ConfigError, match=r"^executors need 2 ranks \(trainer 2, generator 2 colocated\) but 4 were"):
        check_world(cfg, 4)


def test_backend_and_gpus_per_rank():
    """Where CUDA is present ranks use NCCL with a GPU each; a machine or node with fewer GPUs than ranks fails in
    one line before anything starts (two ranks on one GPU cannot share an NCCL communicator)."""
    from megatron_rl.controller.train import env_backend
    from megatron_rl.launch.spawn import resolve_backend
    from megatron_rl.launch.world import EnvWorld

    assert resolve_backend("auto", 3, 0) == "gloo"
    assert resolve_backend("auto", 3, 8) == "nccl"
    assert resolve_backend("gloo", 3, 1) == "gloo"
    with pytest.raises(LaunchError, match=r"^3 ranks need 3 GPUs \(one each\) but this machine shows 1; .*"
                                          r"CUDA_VISIBLE_DEVICES= to run on the CPU$"):
        resolve_backend("auto", 3, 1)
    with pytest.raises(LaunchError, match="needs CUDA"):
        resolve_backend("nccl", 1, 0)
    with pytest.raises(LaunchError, match="'mpi' is not one of"):
        resolve_backend("mpi", 1, 0)
    cfg = load_config(None, ["run.backend=auto"])
    rank = EnvWorld(rank=9, world_size=16, local_rank=1, master_addr="h", master_port=1, source="torchrun")
    assert env_backend(cfg, rank, 8) == "nccl" and env_backend(cfg, rank, 0) == "gloo"
    with pytest.raises(ConfigError, match="^rank 9 has local rank 1 but its node shows 1 GPU: start at most one"):
        env_backend(cfg, rank, 1)


def test_local_train_with_an_impossible_backend_fails_before_writing(tmp_path, capsys, monkeypatch):
    """`megatron-rl train run.backend=nccl` on a machine without CUDA, or with a start method that does not exist:
    one line, exit 2, no run directory."""
    import torch

    from megatron_rl.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rc = main(["train", "--launcher", "local", f"checkpoint.dir={tmp_path}", "run.name=x", "run.backend=nccl"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["megatron-rl: config error: the NCCL backend needs CUDA, which this process does not "
                               "see"]
    assert not (tmp_path / "x").exists()
    # the start method the tests use to run ranks as GPU machines do, misspelt
    monkeypatch.setenv("MEGATRON_RL_START_METHOD", "spwan")
    rc = main(["train", "--launcher", "local", f"checkpoint.dir={tmp_path}", "run.name=x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["megatron-rl: config error: MEGATRON_RL_START_METHOD='spwan' is not one of spawn, "
                               "forkserver"]
    assert not (tmp_path / "x").exists()


def test_run_local_without_a_time_limit():
    """`megatron-rl train` runs as long as its steps need (the local launcher once killed jobs after an hour)."""
    from megatron_rl.launch.spawn import run_local

    from parallel_workers import rank_and_world_worker

    assert run_local(rank_and_world_worker, 2, timeout=None) == [(0, 2), (1, 2)]


def test_a_local_worlds_ranks_leave_together(tmp_path):
    """A rank that has returned stays until every rank has (`run_local`): one that left at once could fail a peer
    still connecting a process group with it (gloo; a CI run of 2026-11-27). Ranks 1 and 2 return at once, rank 0 a
    second later, and finds them still running."""
    from megatron_rl.launch.spawn import run_local

    from parallel_workers import others_running_a_second_after_returning

    assert run_local(others_running_a_second_after_returning, 3, str(tmp_path)) == [[True, True], None, None]


def test_a_fork_servers_ranks_start_with_its_preloaded_modules():
    """The session's fork server (conftest.py) imported the job's modules once: its ranks start with them, and with
    Megatron-Core, instead of importing them each. A module nobody preloaded is not there."""
    from megatron_rl.launch.spawn import run_local

    from parallel_workers import imported_at_start

    names = ["megatron.core", "megatron_rl.controller.job", "megatron_rl.controller.loop", "gen_workers",
             "megatron_rl.evaluation.eval"]
    for seen in run_local(imported_at_start, 2, names):
        assert seen == [True, True, True, True, False]


def test_a_fork_servers_ranks_start_with_its_imports_frozen():
    """The fork server froze what it imported (`launch/preloaded.py`): a rank's first full collection does not
    re-read torch and Megatron-Core (2-3 s on a loaded machine, before the rank's first heartbeat)."""
    import gc

    from megatron_rl.launch.spawn import run_local

    from parallel_workers import frozen_at_start

    ours = gc.get_freeze_count()  # 0 here; 375 on the H200 image (Python 3.12, a library froze some at import)
    frozen = run_local(frozen_at_start, 2)
    # torch + Megatron-Core + the job's modules: hundreds of thousands of objects more than this process froze
    assert all(n > ours + 100_000 for n in frozen), (ours, frozen)


def test_a_local_world_shares_the_cores_among_its_ranks(monkeypatch):
    """Each rank of a local world takes its share of the usable cores as torch threads, at least one: a world of one
    uses them all. OMP_NUM_THREADS, where set, is each rank's count: 16 threads for each rank of twelve xdist
    workers' worlds on a 16-core GPU machine ran the suite past 470 s, where it took 136 s."""
    from megatron_rl.launch.spawn import LaunchError, run_local, threads_per_rank

    from parallel_workers import threads_at_start

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert [threads_per_rank(n) for n in (1, 2, cores, 4 * cores)] == [cores, max(1, cores // 2), 1, 1]
    assert run_local(threads_at_start, 1) == [cores]
    assert run_local(threads_at_start, 2) == [max(1, cores // 2)] * 2
    assert [threads_per_rank(2, {"OMP_NUM_THREADS": v}) for v in ("3", " 5 ", "4,2")] == [3, 5, 4]
    for bad in ("0", "two", "-1"):
        with pytest.raises(LaunchError, match=rf"OMP_NUM_THREADS='{bad}' is not a positive whole number"):
            threads_per_rank(1, {"OMP_NUM_THREADS": bad})
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # read by the launcher: the fork server's ranks saw it unset
    assert run_local(threads_at_start, 1) == [1]


def test_train_with_spawned_ranks_as_on_gpu_machines(tmp_path):
    """`megatron-rl train` as a GPU machine starts it (ranks spawned as fresh interpreters, nothing inherited),
    here on the CPU: the config, the job function and its arguments must survive the trip. Its output is the
    banner, the progress bar and the summary: no dependency warnings (`megatron_rl.quiet`), in any process."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env.update(MEGATRON_RL_START_METHOD="spawn", OMP_NUM_THREADS="1")
    cfg = [o for o in ONE_PER_NODE if not o.startswith("run.world_size")]  # 2 ranks: a trainer, a generator
    out = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "--launcher", "local", *cfg,
                          f"checkpoint.dir={tmp_path}", "run.name=spawned"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["backend"] == "gloo"
    assert "Warning" not in out.stderr, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "spawned" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]


def _stopped_recipe(slurm_env, tmp_path, signum, name, **env_extra):
    """The 8B recipe on two simulated nodes, one rank each, with a long run; once it has logged 2 steps, `signum` to
    the batch shell alone (where SLURM sends its time-limit warning). Returns (the recipe's process, its stdout, its
    stderr, the run directory, every process it had started by then)."""
    import time

    import psutil

    env = dict(slurm_env, SLURM_NNODES="2", SLURM_JOB_NODELIST="localhost,localhost", GPUS_PER_NODE="1",
               PYTHON=sys.executable, **env_extra)
    run_dir = tmp_path / "ckpt" / name
    proc = subprocess.Popen(["bash", str(REPO / "launch/slurm/llama3_8b.sbatch"), *ONE_PER_NODE, "run.steps=400",
                             f"checkpoint.dir={tmp_path / 'ckpt'}", f"run.name={name}"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 240
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.5)
    started = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=240)
    gone, alive = psutil.wait_procs(started, timeout=30)
    assert alive == [], [p.cmdline() for p in alive]  # no process is left
    return proc, out, err, run_dir


def _stop_step(out: str, run_dir: Path) -> int:
    """The step the run stopped after (rank 0's summary), with its checkpoint complete and `latest`."""
    from megatron_rl.checkpointing.layout import verify

    summary = json.loads(out.strip().splitlines()[-1])
    step = summary["stopped_after_step"]
    assert summary["stopped_by"] == "SIGTERM" and (run_dir / "latest").read_text().strip() == f"step_{step:08d}"
    assert verify(run_dir / f"step_{step:08d}", checksums=True).step == step
    return step


def test_the_time_limit_warning_stops_the_run_with_a_checkpoint_and_requeues_it_once(slurm_env, tmp_path):
    import signal

    proc, out, err, run_dir = _stopped_recipe(slurm_env, tmp_path, signal.SIGUSR1, "limit")
    step = _stop_step(out, run_dir)
    assert proc.returncode != 0
    assert err == (f"megatron-rl: stopped by SIGTERM after step {step}; checkpoint step_{step:08d} saved; the time "
                   f"limit is near: job 4242 requeued, its next allocation resumes the run\n")
    asked = (tmp_path / "srun.log").read_text().splitlines()
    assert [a for a in asked if a.startswith("scontrol")] == ["scontrol requeue 4242"]


FAKE_SRUN_STEP = r"""#!/bin/bash
# Stand-in for srun whose job step only waits for a stop: at SIGTERM it writes the ranks' stop line (or, with
# FAKE_STEP_FAILS set, a failure) to its stderr, the recipe's torchrun log, and exits 1.
echo "srun $*" >> "$FAKE_SLURM_LOG"
trap 'stopped=1' TERM
touch "$FAKE_SLURM_LOG.started"
while [[ -z ${stopped:-} ]]; do sleep 0.1; done
if [[ -n ${FAKE_STEP_FAILS:-} ]]; then
    echo "RuntimeError: a rank failed while stopping" >&2
else
    echo "megatron-rl: stopped by SIGTERM after step 3; checkpoint step_00000003 saved; relaunch to resume" >&2
fi
exit 1
"""


@pytest.mark.parametrize("case", ["cancel", "requeue_off", "failed"])
def test_a_stopped_run_is_not_requeued_when_cancelled_switched_off_or_failed(slurm_env, tmp_path, case):
    """The recipe's own logic, with a job step that only stops: a cancel (SIGTERM to the batch shell) stops the run
    and is never requeued; after the time-limit warning, `MEGATRON_RL_REQUEUE=0` turns the requeue off, and a run
    that fails (no stop with a checkpoint in its log) is never requeued. The recipe stops the job step the same way
    for a cancel as for the warning, so the checkpoint a real job leaves at the stop is the time-limit test's."""
    import signal
    import time

    (tmp_path / "bin" / "srun").write_text(FAKE_SRUN_STEP)
    env = dict(slurm_env, SLURM_NNODES="2", GPUS_PER_NODE="2", PYTHON=sys.executable,
               **{"cancel": {}, "requeue_off": {"MEGATRON_RL_REQUEUE": "0"}, "failed": {"FAKE_STEP_FAILS": "1"}}[case])
    proc = subprocess.Popen(["bash", str(REPO / "launch/slurm/llama3_8b.sbatch"), *TWO_NODES,
                             f"checkpoint.dir={tmp_path / 'ckpt'}", "run.name=x"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started, deadline = Path(env["FAKE_SLURM_LOG"] + ".started"), time.monotonic() + 120
    while not started.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM if case == "cancel" else signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    log = tmp_path / "ckpt" / "x" / "torchrun-4242.log"
    assert err == {"cancel": "megatron-rl: stopped by SIGTERM after step 3; checkpoint step_00000003 saved; "
                             "cancelled: not requeued (submit the same command to resume)\n",
                   "requeue_off": "megatron-rl: stopped by SIGTERM after step 3; checkpoint step_00000003 saved; the "
                                  "time limit is near and requeueing is off (MEGATRON_RL_REQUEUE=0): submit the same "
                                  "command to resume\n",
                   "failed": f"megatron-rl: srun exited with code 1 before any rank reported; torchrun's report: "
                             f"{log}; not requeued\n"}[case]
    assert not any(a.startswith("scontrol") for a in Path(env["FAKE_SLURM_LOG"]).read_text().splitlines())


def test_a_local_worlds_port_is_held_from_its_choice_until_the_world_ends():
    """`reserve_port`: while held, rank 0's store listens on the port, and no other `bind` to port 0 on this machine
    is handed it (a port found free and released could be: two xdist workers' worlds met on one, EADDRINUSE)."""
    import torch.distributed as dist

    from megatron_rl.launch.spawn import reserve_port

    held = reserve_port()
    port = held.getsockname()[1]
    try:
        handed = set()
        for _ in range(3000):
            with socket.socket() as s:
                s.bind(("", 0))
                handed.add(s.getsockname()[1])
        assert port not in handed and len(handed) > 100
        store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        held.close()

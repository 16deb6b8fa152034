"""The world a job runs in: which ranks there are, which one this process is, and where they meet.

    LocalWorld  this process starts `world_size` ranks on this machine (`spawn.run_local`) and speaks for the job
    EnvWorld    this process *is* one rank of a world that torchrun or srun started (`env_world` reads it)

`--launcher` picks one (`resolve_launcher`): env when WORLD_SIZE is set in the environment (torchrun sets it), else
local. torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. srun without torchrun sets SLURM_PROCID,
SLURM_NTASKS and SLURM_LOCALID; the rendezvous host is then MASTER_ADDR if set, else the first host of
SLURM_JOB_NODELIST (`scontrol show hostnames`), and the port MASTER_PORT if set, else 29500.

Either way a rank finds its peers through the same environment variables (`set_rendezvous_env`, the one place that
sets them): torch.distributed's default `env://` rendezvous reads them.

A world that cannot be launched (an environment that names none, a machine with too few GPUs) is a `LaunchError`:
one line, before any process starts. This package sits below the job's configuration, so the controller turns it
into the configuration error the user sees.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Optional

LAUNCHERS = ("auto", "local", "env")
DEFAULT_PORT = 29500


class LaunchError(RuntimeError):
    """The world cannot be launched here (one line, before any process starts)."""


@dataclass(frozen=True)
class LocalWorld:
    """The local launcher's world: this process starts `world_size` ranks on this machine and speaks for the job."""

    world_size: int
    rank: int = 0
    source: str = "local"


@dataclass(frozen=True)
class EnvWorld:
    """This process's place in an externally started world."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" or "slurm"


def resolve_launcher(choice: str, environ: Optional[dict] = None) -> str:
    """"auto" -> "env" when WORLD_SIZE is set, else "local"; "local" and "env" are returned as they are."""
    env = os.environ if environ is None else environ
    if choice not in LAUNCHERS:
        raise LaunchError(f"--launcher={choice!r} is not allowed: expected one of {', '.join(LAUNCHERS)}")
    if choice == "auto":
        return "env" if env.get("WORLD_SIZE") else "local"
    return choice


def _int_env(env: dict, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise LaunchError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list ("node[01-04]" -> "node01"), through scontrol."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=60, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError) as e:
        raise LaunchError(f"cannot expand SLURM_JOB_NODELIST={nodelist!r} with scontrol ({e}); set MASTER_ADDR") \
            from None
    if not out:
        raise LaunchError(f"scontrol listed no hosts for SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR")
    return out[0]


def env_world(environ: Optional[dict] = None) -> EnvWorld:
    """Rank, world size and rendezvous of this process, from torchrun's or srun's environment variables."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise LaunchError(f"--launcher env: RANK and WORLD_SIZE are set but {' and '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} not (start the ranks with torchrun)")
        return EnvWorld(_int_env(env, "RANK"), _int_env(env, "WORLD_SIZE"),
                        _int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
                        env["MASTER_ADDR"], _int_env(env, "MASTER_PORT"), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR")
        if not addr:
            if not env.get("SLURM_JOB_NODELIST"):
                raise LaunchError("--launcher env under srun: neither MASTER_ADDR nor SLURM_JOB_NODELIST is set")
            addr = _first_slurm_host(env["SLURM_JOB_NODELIST"])
        port = _int_env(env, "MASTER_PORT") if env.get("MASTER_PORT") else DEFAULT_PORT
        return EnvWorld(_int_env(env, "SLURM_PROCID"), _int_env(env, "SLURM_NTASKS"),
                        _int_env(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0, addr, port, "slurm")
    raise LaunchError("--launcher env needs a world started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) "
                      "or srun (SLURM_PROCID, SLURM_NTASKS); none is set")


def set_rendezvous_env(master_addr: str, master_port: int, rank: int, world_size: int, local_rank: int) -> None:
    """Where this rank meets its peers, in the variables torch.distributed's `env://` rendezvous reads. Every rank
    sets them before it joins its world: a local rank (`spawn.run_local`), and a rank of a launched world (srun
    alone sets none of them)."""
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank))

"""Rank functions and a reward function for tests/test_stop.py (importable by the fork server's children and by
reward worker processes)."""

import os
import signal


def exact_answer(prompt, response, reference):
    """1 when the response is the reference answer."""
    return float(response.strip() == str(reference).strip())


def rank_1_raises(rank, world_size):
    """Rank 1 fails; the others wait for it in a collective and get their gloo error when it is gone."""
    import torch.distributed as dist

    if rank == 1:
        raise FileNotFoundError("data/x.jsonl")
    dist.barrier()


def rank_1_hangs(rank, world_size):
    """Rank 1 never reaches the collective the others wait in (their gloo timeout is short)."""
    import time

    import torch.distributed as dist

    if rank == 1:
        time.sleep(3600)
    dist.barrier()


def rank_1_is_killed(rank, world_size):
    """Rank 1 is SIGKILLed; the others wait for it in a collective."""
    import torch.distributed as dist

    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


_KEPT = []  # pools a rank leaves running (a module global: a local would be closed when the function returns)


def starts_reward_workers(rank, world_size, close):
    """Starts a reward worker pool and closes it, or leaves it running, as a Job that never closed its task did."""
    from megatron_rl.sandbox import WorkerPool

    pool = WorkerPool("stop_workers:exact_answer", num_workers=1)
    if close:
        pool.close()
    else:
        _KEPT.append(pool)
    return rank

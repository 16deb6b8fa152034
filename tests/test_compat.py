"""The CPU layer by itself: what it redirects, and that it does nothing when CUDA is available."""

import importlib.util
import textwrap
from pathlib import Path

import pytest
import torch

import warm_cli


def _run(code: str) -> str:
    """`code` in a process of its own (warm: forked from the session's fork server, which imported torch and
    Megatron-Core but never activated the CPU layer); its stdout."""
    out = warm_cli.run([textwrap.dedent(code)], timeout=120, main="warm_cli:python_c")
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the CPU redirections")
def test_redirects_cuda_placements_to_cpu():
    out = _run("""
        import threading, torch
        from megatron_rl.compat import activate, is_active
        assert activate() and is_active() and activate()  # idempotent
        x = torch.empty(3, device=torch.cuda.current_device())
        assert x.device.type == "cpu"
        assert torch.ones(2, device="cuda").device.type == "cpu"
        assert torch.zeros(2, device=torch.device("cuda", 0), pin_memory=True).device.type == "cpu"
        assert x.cuda() is x and x.to("cuda").device.type == "cpu" and x.pin_memory() is x
        assert x.type() == "torch.cuda.FloatTensor" and x.type(torch.float64).dtype == torch.float64
        torch.cuda.synchronize(); torch.cuda.empty_cache()
        s = torch.cuda.Stream(); e = torch.cuda.Event(); e.record(); s.wait_event(e)
        with torch.cuda.stream(s):
            pass
        box = []
        t = threading.Thread(target=lambda: box.append(torch.zeros(1, device="cuda").device.type))
        t.start(); t.join()
        assert box == ["cpu"], box
        # The CUDA RNG is the CPU generator: Megatron's tracker forks it and restores it.
        torch.cuda.manual_seed(5); a = torch.rand(3)
        torch.manual_seed(5); b = torch.rand(3)
        assert torch.equal(a, b)
        from megatron.core.tensor_parallel import random as r
        r.model_parallel_cuda_manual_seed(11, tp_rank=0, ep_rank=0, etp_rank=0)
        before = torch.get_rng_state()
        with r.get_cuda_rng_tracker().fork():
            inside = torch.rand(4)
        assert torch.equal(torch.get_rng_state(), before)
        with r.get_cuda_rng_tracker().fork():
            again = torch.rand(4)
        assert not torch.equal(inside, again)  # the tracked state advanced
        from megatron_rl.compat.cpu import deactivate
        deactivate()
        assert not is_active()
        try:
            torch.cuda.current_device()
            raise SystemExit("current_device should fail again after deactivate")
        except (AssertionError, RuntimeError):
            pass
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_inactive_when_cuda_is_available():
    out = _run("""
        import torch
        original = {n: getattr(torch.cuda, n) for n in ("current_device", "synchronize", "get_rng_state", "Stream")}
        torch.cuda.is_available = lambda: True
        from megatron_rl.compat import activate, is_active
        assert activate() is False and not is_active()
        assert all(getattr(torch.cuda, n) is f for n, f in original.items())
        from torch.overrides import _get_current_function_mode_stack
        assert _get_current_function_mode_stack() == []
        assert torch.empty(1).type() == "torch.FloatTensor"
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_megatron_core_is_imported_without_wandb_and_inductor():
    """`compat/megatron_core.py` (the fork server's and this session's import): Megatron-Core's own wandb logging
    sees no wandb and its jit fuser is the identity on a machine without CUDA, while torch.compile and wandb stay
    as they are for everything else."""
    import sys

    import megatron.core.jit
    import megatron.core.timers

    import megatron_rl.compat.megatron_core  # noqa: F401

    def f(x):
        return x

    assert megatron.core.timers.wandb is None
    assert megatron.core.jit.jit_fuser(f) is f
    assert torch.compile.__module__.startswith("torch") and sys.modules.get("wandb", 0) is not None
    if importlib.util.find_spec("wandb") is not None:
        import wandb

        assert hasattr(wandb, "init")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer's own import of Megatron-Core")
def test_a_cold_rank_activating_the_cpu_layer_loads_megatron_core_without_wandb_and_inductor():
    """A rank torchrun or srun starts (`controller/train.py: _join_world`) first meets Megatron-Core in `activate()`:
    it is loaded through `compat/megatron_core.py` there too (it was a plain `import megatron.core`: wandb and
    Inductor loaded in every such rank, 2-3 s of its cold start). A cold process, as such a rank is."""
    import os
    import subprocess
    import sys

    code = ("import sys; from megatron_rl.compat import activate; assert activate(); "
            "print(sys.modules.get('wandb') is None, 'torch._inductor.compile_fx' in sys.modules)")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False"], out.stdout


def test_modules_importing_megatron_core_import_it_through_compat_first():
    """A cold process (a torchrun rank, any `megatron-rl` command) imports Megatron-Core through whichever of our
    modules gets there first: each that imports it at module level imports `compat/megatron_core.py` before it, so
    Megatron-Core is always loaded without wandb and Inductor (a rank's modules, cold: 10-12 s and 400 MB without
    this, 6 s and 310 MB with it on the 2-core test machine)."""
    import ast

    def imported(node):
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        return [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []

    late = []
    for path in sorted((Path(__file__).resolve().parents[1] / "megatron_rl").rglob("*.py")):
        if path.name == "megatron_core.py":
            continue
        names = [name for node in ast.parse(path.read_text()).body for name in imported(node)]  # module level
        mcore = [i for i, name in enumerate(names) if name == "megatron" or name.startswith("megatron.")]
        if mcore and "megatron_rl.compat.megatron_core" not in names[:mcore[0]]:
            late.append(str(path))
    assert late == []

"""The test session's own rule (conftest.py): every test runs on the CPU, and the `gpu` set sees the GPUs as the
session found them, in every process of the session."""

import os
import subprocess
import sys
from pathlib import Path

from session_gpus import SESSION_CUDA_VISIBLE_DEVICES, SESSION_GPUS_VAR

HERE = Path(__file__).resolve().parent
READ = "import session_gpus; print(repr(session_gpus.SESSION_CUDA_VISIBLE_DEVICES))"
# A session in miniature: it reads the GPUs, hides them as conftest.py does, and starts a worker that reads them
# again (as each pytest-xdist worker imports conftest.py afresh).
SESSION = f"""
import os, subprocess, sys
import session_gpus
os.environ["CUDA_VISIBLE_DEVICES"] = ""
print(subprocess.run([sys.executable, "-c", {READ!r}], capture_output=True, text=True).stdout.strip())
"""


def _python(code: str, env: dict) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_tests_see_no_gpu_and_the_sessions_workers_find_the_gpus_it_found():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    # a process this session starts inherits the hidden value, and still finds what the session found
    assert _python(READ, dict(os.environ)) == repr(SESSION_CUDA_VISIBLE_DEVICES)
    clean = {k: v for k, v in os.environ.items() if k not in (SESSION_GPUS_VAR, "CUDA_VISIBLE_DEVICES")}
    for found in (None, "0,1", ""):  # a machine's every GPU, two of them, none
        env = clean if found is None else {**clean, "CUDA_VISIBLE_DEVICES": found}
        assert _python(SESSION, env) == repr(found)


def test_heavy_files_share_a_worker_per_four_cores_and_smollm2s_files_one():
    """conftest.py's xdist groups: every file it names exists (a renamed file would silently leave its group), a
    2-core machine runs all of them in turn on one worker, a 16-core one over four, SmolLM2's files together."""
    import conftest

    named = conftest._SMOLLM2_FILES + conftest._WORLD_FILES
    assert len(set(named)) == len(named) and set(named) <= {p.name for p in HERE.glob("test_*.py")}
    assert {conftest.worker_group(n, 2) for n in named} == {"cores-0"}
    assert {conftest.worker_group(n, 16) for n in named} == {f"cores-{i}" for i in range(4)}
    assert {conftest.worker_group(n, 16) for n in conftest._SMOLLM2_FILES} == {"cores-0"}
    assert conftest.worker_group("test_aipo.py", 2) is None

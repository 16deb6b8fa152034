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

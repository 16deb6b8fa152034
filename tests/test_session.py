"""The test session's own rule (conftest.py): every test runs on the CPU, and the `gpu` set sees the GPUs as the
session found them, in every process of the session."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_tests_sharing_an_expensive_fixture_share_a_worker():
    """conftest.py's xdist groups: SmolLM2's session fixtures put a test in one group, a module-scoped fixture in its
    file's, anything else in none."""
    import conftest

    assert conftest.worker_group("test_eval.py", {"smollm2": "session", "tmp_path_factory": "session"}) == "smollm2"
    assert conftest.worker_group("test_smollm2.py", {"hf": "module", "smollm2_hf": "session"}) == "smollm2"
    assert conftest.worker_group("test_plan.py", {"recipe_plans": "module"}) == "test_plan.py"
    assert conftest.worker_group("test_aipo.py", {"tmp_path_factory": "session", "tmp_path": "function"}) is None


@pytest.fixture(scope="module")
def _built_once():
    return os.getpid()


def test_under_xdist_a_test_with_a_module_fixture_runs_in_its_files_group(_built_once, request):
    """The groups reach xdist: its scheduler reads a test's group from its id, which xdist extends from the
    `xdist_group` marks before conftest.py's hook would add them unless that hook runs first (as it did not at stop
    50, when no group took effect), and not at all with pytest 9.2 (pytest-xdist#1386; pyproject.toml keeps pytest
    below it)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        pytest.skip("the suite runs without xdist workers (-n 0)")
    assert request.node.nodeid.endswith("@test_session.py") and _built_once == os.getpid()

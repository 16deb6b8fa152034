"""The GPUs as the test session found them, before conftest.py hides them (`CUDA_VISIBLE_DEVICES=""`) from every
test and every process a test starts.

The value is kept in the environment too (`SESSION_GPUS_VAR`), because some of those processes import conftest.py
again and must find what the session found, not the hidden value they inherit: pytest-xdist's workers (on one H200,
2026-11-27, the `gpu` set skipped in every worker as "hidden" until this was kept) and `gpu_checks.py`. Importing
this module touches nothing else, so a test can check it in a fresh process cheaply.
"""

import os

SESSION_GPUS_VAR = "MEGATRON_RL_TEST_SESSION_GPUS"
_UNSET = "<unset>"  # CUDA_VISIBLE_DEVICES was not set: every GPU the driver shows

_found = os.environ.setdefault(SESSION_GPUS_VAR, os.environ.get("CUDA_VISIBLE_DEVICES", _UNSET))
SESSION_CUDA_VISIBLE_DEVICES = None if _found == _UNSET else _found

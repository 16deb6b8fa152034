"""Import what a user names as `module:attr` (or `path/to/file.py:attr`): a reward function, an environment class,
an agent function.

The sandbox's workers import user code themselves (nothing is inherited from the job's process), and the job
imports it once too, to check it before any process starts; both go through `resolve`, so a spec that cannot be used
reads the same wherever it is found: one line naming what it is (`what`: "reward function", "env", "agent"), the
spec and the reason (`SpecError.reason`, the line without its first words, for callers that name the spec
themselves).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Any, Optional


class SpecError(ValueError):
    """A `module:attr` spec that cannot be used: bad form, missing file, module or attribute, an import that raises,
    or (with `callable_only`) an attribute that is not callable. One line, `{what} {spec!r}: {reason}` (`of`), or a
    line a worker sent as it is (`reason` then the whole line)."""

    def __init__(self, line: str, reason: Optional[str] = None):
        super().__init__(line)
        self.reason = line if reason is None else reason

    @classmethod
    def of(cls, what: str, spec: Any, reason: str) -> "SpecError":
        return cls(f"{what} {spec!r}: {reason}", reason)


FORM = "must look like 'module:function' (or 'path/file.py:function')"


def resolve(spec: str, what: str = "function", callable_only: bool = True) -> Any:
    """Import `module:attr` (or `path/to/file.py:attr`); the attribute may be dotted (`Class.method`). A file is
    imported under a private name derived from its path, so two files with the same basename do not collide.

    Raises SpecError (one line, see the class) for anything that stops it, the module's own exceptions included.
    """
    if not isinstance(spec, str) or ":" not in spec:
        raise SpecError.of(what, spec, FORM)
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise SpecError.of(what, spec, FORM)
    if module_name.endswith(".py") or "/" in module_name:
        module = _from_file(spec, what, os.path.abspath(module_name))
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
                raise SpecError.of(what, spec, f"no module named {module_name!r}") from None
            raise SpecError.of(what, spec, f"importing {module_name!r} failed: {e}") from None
        except (Exception, SystemExit) as e:  # what importing a user's module may raise besides ImportError
            raise SpecError.of(what, spec, f"importing {module_name!r} raised {type(e).__name__}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SpecError.of(what, spec, f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if callable_only and not callable(obj):
        raise SpecError.of(what, spec, f"{attr!r} is not callable")
    return obj


def _from_file(spec: str, what: str, path: str):
    if not os.path.isfile(path):
        raise SpecError.of(what, spec, f"file {path} not found")
    name = "_megatron_rl_user_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    module = sys.modules.get(name)
    if module is None:
        file_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[name] = module
        try:
            file_spec.loader.exec_module(module)
        except (Exception, SystemExit) as e:
            del sys.modules[name]
            raise SpecError.of(what, spec, f"loading {path} raised {type(e).__name__}: {e}") from None
    return module

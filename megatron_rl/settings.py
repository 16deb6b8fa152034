"""Settings classes that are also sections of the job's configuration.

A component declares what it can be told in one dataclass deriving from `Section`: each field with its default,
its range beside it (`ranged`), and the rules that tie its fields together (`rules`). That class is the YAML section
(`algorithm`, `trainer`, ...) which `megatron_rl.config` composes into the job, and it is what the component
receives: nothing is copied from one into the other, and each rule is written once.

`problems()` names every problem of an instance, one line each, by the field's path in the job's configuration
(`algorithm.rho=0.5 must be >= 1 ...`). Building an instance that has a problem raises ValueError with the same
lines, so code that builds settings directly (tests, benchmarks) meets the rules that a configuration meets.
Imports nothing heavy: `megatron-rl config` reports a bad value without importing torch.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, ClassVar, Literal, Union

# The ranges a number field may declare: the rule as the error message says it, and its test.
RULES: dict[str, typing.Callable[[Any], bool]] = {
    ">= 0": lambda v: v >= 0, ">= 1": lambda v: v >= 1, "> 0": lambda v: v > 0,
    "in (0, 1]": lambda v: 0 < v <= 1, "in [0, 1]": lambda v: 0 <= v <= 1, "in [0, 1)": lambda v: 0 <= v < 1,
    "in [0, 2**32)": lambda v: 0 <= v < 2**32, "in [1, 64]": lambda v: 1 <= v <= 64,
}


def ranged(default: Any, rule: str, why: str = "") -> Any:
    """A number field with its range: `rho: float = ranged(4.0, ">= 1", "(importance weights are truncated at
    rho)")`. `why` follows the rule in the error message."""
    if rule not in RULES:
        raise ValueError(f"unknown range {rule!r}; known: {', '.join(RULES)}")
    return dataclasses.field(default=default, metadata={"range": rule, "why": why})


def _options(tp) -> tuple[tuple, bool]:
    """(the non-None members of a Union (or the type itself), whether None is allowed)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = typing.get_args(tp)
        return tuple(a for a in args if a is not type(None)), type(None) in args
    return (tp,), False


class Section:
    """A settings class that is a section of the job's configuration (a dataclass deriving from this).

    SECTION: where it sits in the configuration ("algorithm", "reward.executor"), the prefix of its messages.
    Subclasses write the rules between their own fields in `rules`; rules between sections live in
    `megatron_rl.config.validate`."""

    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))

    def problems(self, path: str = "") -> list[str]:
        """Every problem of this section and the sections inside it: a float that is not finite, a number out of
        its range, a word that is not one of its field's choices, and what `rules` finds."""
        path = path or self.SECTION
        out: list[str] = []
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value, where = getattr(self, f.name), f"{path}.{f.name}"
            if isinstance(value, Section):
                out += value.problems(where)
                continue
            kinds, optional = _options(hints[f.name])
            words = [a for k in kinds if typing.get_origin(k) is Literal for a in typing.get_args(k)]
            if isinstance(value, str) and words and value not in words:
                out.append(f"{where}={value!r} is not allowed: expected one of {', '.join(map(repr, words))}")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if isinstance(value, float) and not math.isfinite(value):
                out.append(f"{where}={value} must be a finite number")
            elif "range" in f.metadata and not RULES[f.metadata["range"]](value):
                why = f.metadata["why"]
                out.append(f"{where}={value} must be {f.metadata['range']}{' or null' if optional else ''}"
                           f"{' ' + why if why else ''}")
        return out + self.rules(path)

    def rules(self, path: str) -> list[str]:
        """Problems between this section's own fields, one line each; `path` is the section's place."""
        return []


def sections(root: Section, path: str = "") -> typing.Iterator[tuple[str, Section]]:
    """(path, section) of `root` and every section inside it, depth first."""
    path = path or root.SECTION
    yield path, root
    for f in dataclasses.fields(root):
        value = getattr(root, f.name)
        if isinstance(value, Section):
            yield from sections(value, f"{path}.{f.name}")

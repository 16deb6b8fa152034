"""`tools/import_graph.py`: the package has no import cycle, and the checker finds one where there is one."""

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "import_graph.py"

_spec = importlib.util.spec_from_file_location("import_graph", TOOL)
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)


def test_the_package_has_no_import_cycle():
    out = subprocess.run([sys.executable, str(TOOL), "--edges"], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stdout[out.stdout.find("cycle of"):] + out.stderr
    assert "no import cycles" in out.stderr
    edges = set(out.stdout.splitlines())
    assert "megatron_rl.checkpointing.inspect -> megatron_rl.checkpointing.layout" in edges
    assert "megatron_rl.rewards.registry -> megatron_rl.data.registry" in edges


def test_cycles_are_found_in_a_synthetic_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a", "f"}, "f": {"e"}, "g": {"g"}}
    assert import_graph.find_cycles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert import_graph.cycle_path(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert import_graph.find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    long_chain = {str(i): {str(i + 1)} for i in range(5000)}  # deeper than Python's recursion limit
    long_chain["5000"] = {"0"}
    assert len(import_graph.find_cycles(long_chain)[0]) == 5001


def test_edges_follow_the_stated_rule():
    modules = {"p", "p.a", "p.b", "p.c", "p.q", "p.q.x", "p.q.y"}
    source = """
from __future__ import annotations
import os
from typing import TYPE_CHECKING
from p.b import thing                  # a module: p.b
from p import c                        # a submodule named in a from-import: p.c
if TYPE_CHECKING:
    from p.q import y                  # never runs: no edge

def later():
    import p.q.x                       # deferred imports count, and run p/q/__init__ first: p.q and p.q.x
"""
    assert import_graph.module_imports("p.a", source, modules) == {"p.b", "p.c", "p.q", "p.q.x"}
    # Inside p.q: relative imports resolve against the package; p.q itself is already being imported.
    assert import_graph.module_imports("p.q.x", "from . import y\nfrom .. import b\n", modules) == {"p.q.y", "p.b"}
    # A package's __init__ importing its own submodule is an edge to it; the submodule has no edge back, unless it
    # takes a name from the package's __init__ (which must have run past that name: the classic partial import).
    assert import_graph.module_imports("p.q", "from p.q.x import f\n", modules, is_package=True) == {"p.q.x"}
    assert import_graph.module_imports("p.q.x", "import p.q.y\n", modules) == {"p.q.y"}
    assert import_graph.module_imports("p.q.x", "from p.q import z\n", modules) == {"p.q"}
    assert import_graph.find_cycles({"p.q": {"p.q.x"}, "p.q.x": {"p.q"}}) == [["p.q", "p.q.x"]]


def test_a_cycle_hidden_in_a_function_fails_the_check(tmp_path, monkeypatch, capsys):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.b import g\n    return g()\n")
    (pkg / "b.py").write_text("from pkg import a\n\ndef g():\n    return 1\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph.build_graph(tmp_path, "pkg")
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    monkeypatch.setattr(import_graph, "build_graph", lambda: graph)
    assert import_graph.main([]) == 1
    assert capsys.readouterr().out == "cycle of 2 modules: pkg.a -> pkg.b -> pkg.a\n"


def test_no_arrow_points_up_and_one_is_found_where_it_does():
    graph = import_graph.build_graph()
    assert import_graph.arrows_up(graph) == []
    # the arrow issue 28 found (a launcher helper importing the controller's signal handling) is one
    graph["megatron_rl.parallel.topology"] = {*graph["megatron_rl.parallel.topology"], "megatron_rl.controller.job"}
    assert import_graph.arrows_up(graph) == [("megatron_rl.parallel.topology", "megatron_rl.controller.job")]
    assert import_graph.unplaced(graph) == []
    # Between components too (issue 67): the two arrows that ran up (the model section and the GGUF tokenizer
    # importing checkpointing) are gone, and an import that ran up again would fail.
    graph["megatron_rl.models.builder"] = {*graph["megatron_rl.models.builder"], "megatron_rl.checkpointing.layout"}
    graph["megatron_rl.rewards.registry"] = {*graph["megatron_rl.rewards.registry"], "megatron_rl.inference.engine"}
    assert set(import_graph.arrows_up(graph)) == {
        ("megatron_rl.parallel.topology", "megatron_rl.controller.job"),
        ("megatron_rl.models.builder", "megatron_rl.checkpointing.layout"),
        ("megatron_rl.rewards.registry", "megatron_rl.inference.engine")}
    graph["megatron_rl.newpkg.mod"] = set()  # a package nobody placed in a layer is reported too
    assert import_graph.unplaced(graph) == ["megatron_rl.newpkg.mod"]


def test_no_function_of_the_package_is_longer_than_80_lines():
    """Issue 28's readability rule: a function a newcomer reads top to bottom fits on a screen or two."""
    import ast

    long = []
    for path in sorted((REPO / "megatron_rl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})")
    assert long == []


def test_every_module_compiles_with_warnings_as_errors():
    """Python 3.12 shows a SyntaxWarning for an invalid escape in a docstring at the first import of its module (3.11
    a DeprecationWarning): a user's first command printed one. Every file of the project compiles without any."""
    import warnings

    files = [p for top in ("megatron_rl", "tests", "tools", "benchmarks") for p in sorted((REPO / top).rglob("*.py"))]
    assert len(files) > 100
    bad = []
    for path in files:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                compile(path.read_text(), str(path), "exec")
            except (SyntaxError, Warning) as e:
                bad.append(f"{path.relative_to(REPO)}: {e}")
    assert not bad, bad

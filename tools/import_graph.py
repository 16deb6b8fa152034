"""The import graph of the `megatron_rl` package, its cycles, and its arrows pointing up.

    python tools/import_graph.py            print every cycle and every arrow pointing up; exit 1 if there is one
    python tools/import_graph.py --edges    also print the graph, one `importer -> imported` line per edge

The source is parsed, never imported. Every `import` statement counts, wherever it stands: at module level, inside
a function (a deferred import only postpones a cycle to the first call), or under `try`. The one exception is an
`if TYPE_CHECKING:` block, which never runs.

Rule for an edge from module M (`a.b.__init__` is the module `a.b`):
- `import a.b.c` and `from a.b.c import x` give an edge to `a.b.c`; `from a.b import c`, where `a.b.c` is a
  module, gives an edge to `a.b.c`, otherwise (`c` is a name defined in `a/b/__init__.py`) to `a.b`.
- Importing `a.b.c` also runs `a/__init__.py` and `a/b/__init__.py` the first time, so each package on the way is an
  edge too, except the packages that contain M itself: those are already initialised (or being initialised, by
  the very import that loads M) whenever M runs, so passing through them says nothing about import order. A name
  taken from such a package (`from a.b import name` in `a.b.m`) is still an edge to it: it needs `a/b/__init__.py`
  to have run past that name.
- Relative imports are resolved against M's package; imports of anything outside `megatron_rl` are left out.

An arrow pointing up is an edge from a module to one in a higher layer of `LAYERS` (a component importing the
controller, say): each layer may import itself and the layers below.

A cycle is a strongly connected component of more than one module. A package `__init__` that re-exports its own
submodules is not a cycle by the rule above, as long as the submodules take nothing from the `__init__`.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Iterable, Mapping, Optional

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "megatron_rl"
# The package's layers, lowest first, by the name under `megatron_rl` (a subpackage or a top-level module).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("settings", "run_settings", "quiet", "failpoints", "compat", "rollout", "formats"),  # foundations
    ("parallel", "launch", "sandbox"),  # process groups and layouts; starting and stopping processes; user code's
    # The components, each layer using only those below it:
    ("tokenizers", "data", "algorithms"),  # text and ids, prompt records, the RL objective's math
    ("models",),  # the GPTModel, its presets, families and parameter names
    ("training",),  # the trainer's step over a model
    ("checkpointing",),  # checkpoints of models and trainers, conversion, the model section (a checkpoint's shape)
    ("ddma", "rewards"),  # weights moved between layouts; verifiers and reward models
    ("inference",),  # the generator and its engine, taking DDMA's weights
    ("environments", "serving"),  # episodes against environments; the OpenAI-compatible endpoint on a generator
    ("agents",),  # episodes played by agents through the endpoint
    ("evaluation",),  # a checkpoint without training: eval and serve
    ("config", "config_fit"),  # the job's configuration: the components' sections composed, fitted to the machine
    ("planning",),  # what a configuration needs
    ("controller",),  # the executors, the RL loop, the launcher
    ("cli",),
)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of `package` under `root`: dotted name -> file."""
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    """Import statements of a module, wherever they stand, except under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _with_packages(target: str, importer: str, is_package: bool) -> set[str]:
    """`target` plus the packages on its path that the import executes (not those that contain `importer`)."""
    own = importer if is_package else importer.rpartition(".")[0]
    containing = {".".join(own.split(".")[:i]) for i in range(1, own.count(".") + 2)} if own else set()
    parts = target.split(".")
    out = {target}
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        if pkg not in containing:
            out.add(pkg)
    return out


def module_imports(name: str, source: str, modules: Mapping[str, object], is_package: bool = False) -> set[str]:
    """The modules of `modules` that module `name` imports, by the rule of this file's docstring."""
    tree = ast.parse(source)
    out: set[str] = set()

    def add(target: str) -> None:
        while target and target not in modules:  # `import a.b.C`-style names that are not modules
            target = target.rpartition(".")[0]
        if target and target != name:
            out.update(t for t in _with_packages(target, name, is_package) if t in modules and t != name)

    for node in _imports(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
            continue
        base = node.module or ""
        if node.level:
            anchor = name.split(".") if is_package else name.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:
            sub = f"{base}.{alias.name}" if base else alias.name
            add(sub if sub in modules else base)
    return out


def build_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """The import graph of `package`: module -> the modules it imports."""
    modules = find_modules(root, package)
    return {name: module_imports(name, path.read_text(), modules, path.name == "__init__.py")
            for name, path in modules.items()}


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan's algorithm, iterative), each sorted, in
    sorted order. A self-edge is not reported."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    nodes = set(graph) | {m for targets in graph.values() for m in targets}
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def cycle_path(graph: Mapping[str, Iterable[str]], component: list[str]) -> list[str]:
    """One closed path through a component, first node repeated at the end (a readable witness of the cycle)."""
    members = set(component)
    start = component[0]
    # Breadth-first search from `start` back to it, staying inside the component: a shortest cycle through it.
    parent: dict[str, Optional[str]] = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child == start:
                    path = [node]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]
                if child in members and child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    return component


def layer_of(module: str, layers=LAYERS, package: str = PACKAGE) -> Optional[int]:
    """The index in `layers` of a module's first name under `package` (None: the package itself, or unlisted)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != package:
        return None
    return next((i for i, names in enumerate(layers) if parts[1] in names), None)


def arrows_up(graph: Mapping[str, Iterable[str]], layers=LAYERS, package: str = PACKAGE) -> list[tuple[str, str]]:
    """Edges from a module of `package` into a higher layer than its own, sorted."""
    out = []
    for name in sorted(graph):
        here = layer_of(name, layers, package)
        out += [(name, target) for target in sorted(graph[name])
                if here is not None and (layer_of(target, layers, package) or 0) > here]
    return out


def unplaced(graph: Mapping[str, Iterable[str]], layers=LAYERS, package: str = PACKAGE) -> list[str]:
    """Modules of `package` below its top level whose name is in no layer: a new package must be given one."""
    return sorted(m for m in graph if m.startswith(package + ".") and layer_of(m, layers, package) is None)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="import_graph", description=__doc__.splitlines()[0])
    p.add_argument("--edges", action="store_true", help="print the graph, one 'importer -> imported' per line")
    args = p.parse_args(argv)
    graph = build_graph()
    if args.edges:
        for name in sorted(graph):
            for target in sorted(graph[name]):
                print(f"{name} -> {target}")
    cycles = find_cycles(graph)
    for component in cycles:
        print(f"cycle of {len(component)} modules: {' -> '.join(cycle_path(graph, component))}")
        if len(component) > 2:
            print("  all of: " + ", ".join(component))
    if not cycles:
        print(f"no import cycles among {len(graph)} modules of {PACKAGE}", file=sys.stderr)
    up, lost = arrows_up(graph), unplaced(graph)
    for name, target in up:
        print(f"arrow pointing up: {name} -> {target}")
    for name in lost:
        print(f"in no layer: {name} (add its package to LAYERS)")
    if not up and not lost:
        print(f"no arrow pointing up across the {len(LAYERS)} layers", file=sys.stderr)
    return 1 if cycles or up or lost else 0


if __name__ == "__main__":
    sys.exit(main())

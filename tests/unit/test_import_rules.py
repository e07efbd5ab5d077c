"""The import rules of docs/architecture.md, checked on the source: a forbidden import fails here.

Every import counts: at module level, inside functions, ``importlib.import_module`` / ``__import__`` of a
literal name (or of an f-string's literal prefix: every module under it), and a package's lazy
``__getattr__`` map (``from kvloom import LLM`` loads what the map names for ``LLM``). An import the reader
cannot resolve fails the tests, so they cannot be narrower than the rules. A lazy import defers a dependency
to run time but a reader still follows it, and a cycle through it is still a cycle. An import under
``if TYPE_CHECKING:`` never runs: it counts for cycles and for what a layer may name, not for what a module
loads.

What a module loads is followed transitively, through the parent packages that Python runs first, so "the
scheduler reaches no torch" is checked as a path, not as one file's imports.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kvloom"
# The model side of the engine/runner seam: it reads plain data (kvloom.step_io) and nothing of the engine.
MODEL_SIDE = ("worker", "executor", "models", "layers", "ops", "sample", "loader")
FORBIDDEN_FOR_MODEL_SIDE = ("kvloom.engine", "kvloom.entrypoints")
# The control path that never touches tensors: none of these may reach torch, by any path.
TORCH_FREE = ("kvloom.engine.scheduler", "kvloom.engine.kv_cache_manager", "kvloom.engine.request",
              "kvloom.step_io", "kvloom.sampling_params")
# These load without torch (the config names torch in the functions that resolve it for the runner).
LOADS_WITHOUT_TORCH = (*TORCH_FREE, "kvloom.config")
# Outside packages the control path may load besides the standard library: none (a third-party package
# may load torch behind our back).
CONTROL_PATH_THIRD_PARTY: frozenset[str] = frozenset()

# Import cycles among kvloom modules allowed for now, each entry naming the modules of one cycle: none is
# left. The test below fails on any cycle not listed, and on an entry here that is no longer a cycle.
KNOWN_CYCLES: dict[str, frozenset[str]] = {}
# Low modules and what they must never import: the types they share live in them or below them.
LOWER_LAYERS: dict[str, tuple[str, ...]] = {
    "kvloom.stats": ("kvloom.",),  # plain dataclasses read by engine, metrics, server and router
    "kvloom.version": ("kvloom.",),
    "kvloom.envs": ("kvloom.",),
    "kvloom.metrics": ("kvloom.engine", "kvloom.entrypoints"),
    "kvloom.platform": ("kvloom.config", "kvloom.engine", "kvloom.entrypoints"),
    "kvloom.config": ("kvloom.engine", "kvloom.entrypoints", "kvloom.worker", "kvloom.executor", "kvloom.llm"),
}


# --- reading the imports ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class RawImport:
    """One import as written. ``kind``: "import" (``import a.b``: ``name`` is a.b), "from" (``from a import
    b``: ``name`` is a, ``attr`` b), "prefix" (an f-string's literal prefix: every module under it) or
    "unread" (a dynamic import whose name the reader cannot know; ``name`` is its source text)."""

    line: int
    kind: str
    name: str
    attr: str = ""
    type_only: bool = False


@dataclass
class ModuleSource:
    name: str
    path: Path
    imports: list[RawImport] = field(default_factory=list)
    lazy_map: dict[str, str] = field(default_factory=dict)  # a lazy ``__getattr__``'s name -> module


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_dynamic_import(func: ast.expr) -> bool:
    """``importlib.import_module``, a bare ``import_module`` (``from importlib import import_module``) or
    ``__import__``."""
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("import_module", "__import__")


class _ImportReader(ast.NodeVisitor):
    """Collects every import of one file, noting those under ``if TYPE_CHECKING:`` and those in a module-level
    ``__getattr__``."""

    def __init__(self, package: str) -> None:
        self.package = package  # what a relative import is relative to
        self.imports: list[RawImport] = []
        self.in_getattr: list[RawImport] = []  # dynamic imports a lazy map may explain
        self.type_only = 0
        self.depth = 0  # function nesting
        self.getattr_depth = -1

    def _add(self, record: RawImport) -> None:
        self.imports.append(record)

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.type_only += 1
        for child in node.body:
            self.visit(child)
        self.type_only -= 1
        for child in node.orelse:
            self.visit(child)

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        if self.depth == 0 and node.name == "__getattr__":
            self.getattr_depth = self.depth
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1
        if self.depth == self.getattr_depth:
            self.getattr_depth = -1

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(RawImport(node.lineno, "import", alias.name, type_only=bool(self.type_only)))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
        for alias in node.names:
            self._add(RawImport(node.lineno, "from", base, alias.name, type_only=bool(self.type_only)))

    def visit_Call(self, node: ast.Call) -> None:
        if _is_dynamic_import(node.func) and node.args:
            argument = node.args[0]
            type_only = bool(self.type_only)
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                self._add(RawImport(node.lineno, "import", argument.value, type_only=type_only))
            elif (isinstance(argument, ast.JoinedStr) and argument.values
                  and isinstance(argument.values[0], ast.Constant) and "." in str(argument.values[0].value)):
                self._add(RawImport(node.lineno, "prefix", str(argument.values[0].value), type_only=type_only))
            else:
                record = RawImport(node.lineno, "unread", ast.unparse(node), type_only=type_only)
                (self.in_getattr if self.getattr_depth >= 0 else self.imports).append(record)
        self.generic_visit(node)


def _string_maps(tree: ast.Module) -> dict[str, str]:
    """Module-level dicts of string keys to string values (``_EXPORTS = {"LLM": "kvloom.llm", ...}``)."""
    found: dict[str, str] = {}
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Dict) and value.keys and all(
                isinstance(part, ast.Constant) and isinstance(part.value, str)
                for part in (*value.keys, *value.values)):
            found.update({key.value: item.value for key, item in zip(value.keys, value.values)})  # type: ignore[union-attr]
    return found


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_package(root: Path) -> dict[str, ModuleSource]:
    """Every module of the package at ``root`` with the imports it writes. A module-level ``__getattr__``
    that imports a name it computes is read as a lazy map: a module-level dict of names to module names."""
    modules: dict[str, ModuleSource] = {}
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        tree = ast.parse(path.read_text(), str(path))
        reader = _ImportReader(name if path.name == "__init__.py" else name.rpartition(".")[0])
        reader.visit(tree)
        source = ModuleSource(name, path, reader.imports)
        if reader.in_getattr:
            source.lazy_map = _string_maps(tree)
            if not source.lazy_map:  # a lazy __getattr__ whose names no map gives: the reader cannot follow it
                source.imports.extend(reader.in_getattr)
        modules[name] = source
    return modules


# --- the graph --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Edge:
    line: int
    target: str  # a module of the package, or an outside package's top-level name
    type_only: bool


def resolve(modules: dict[str, ModuleSource], record: RawImport, root_name: str) -> set[str]:
    """The modules an import loads (a name imported from a module maps to that module; from a package with a
    lazy map, to the module the map names). Outside the package: the top-level package's name."""

    def owner(name: str) -> str:  # the module that defines name, or name itself if a module
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    def inside(name: str) -> bool:
        return name == root_name or name.startswith(root_name + ".")

    if record.kind == "prefix":
        prefix = record.name
        if not inside(prefix):
            return {prefix.partition(".")[0]}
        found = {name for name in modules if name.startswith(prefix)}
        return found | {owner(prefix.rstrip("."))}
    if not inside(record.name):
        return {record.name.partition(".")[0]} if record.name else set()
    if record.kind == "import":
        target = owner(record.name)
        lazy = modules[target].lazy_map if target == record.name else {}
        return {target, *lazy.values()}  # ``import pkg`` may reach any name of its lazy map
    # from base import attr
    base = owner(record.name)
    submodule = f"{record.name}.{record.attr}"
    if submodule in modules:
        return {base, submodule}
    lazy = modules[base].lazy_map if base == record.name else {}
    if record.attr in lazy:
        return {base, lazy[record.attr]}
    if record.attr == "*":
        return {base, *lazy.values()}
    return {base}


def import_edges(root: Path = PACKAGE) -> dict[str, list[Edge]]:
    """Package module -> every import it writes, resolved (self-imports dropped)."""
    modules = read_package(root)
    root_name = root.name
    unread = [f"{source.path}:{record.line}: {record.name}" for source in modules.values()
              for record in source.imports if record.kind == "unread"]
    if unread:
        raise ValueError("imports the rule test cannot follow (import a literal module name, or give a lazy "
                         "__getattr__ a module-level dict of names to modules):\n" + "\n".join(unread))
    edges: dict[str, list[Edge]] = {}
    for name, source in modules.items():
        edges[name] = sorted({Edge(record.line, target, record.type_only) for record in source.imports
                              for target in resolve(modules, record, root_name) if target and target != name},
                             key=lambda edge: (edge.line, edge.target))
    return edges


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """kvloom module -> the kvloom modules it names in any import (a package's own submodules importing it
    are not edges: Python runs the package first anyway)."""
    edges = import_edges(root)
    return {name: {edge.target for edge in found if edge.target in edges and not name.startswith(edge.target + ".")}
            for name, found in edges.items()}


def loaded_from(start: str, edges: dict[str, list[Edge]]) -> dict[str, str | None]:
    """Everything importing ``start`` can load, at once or later, with the module each was first reached from:
    every import that runs (not ``TYPE_CHECKING``) and the parent packages Python runs first."""
    came_from: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        parents = [module.rsplit(".", depth)[0] for depth in range(1, module.count(".") + 1)]
        runs = [edge.target for edge in edges.get(module, ()) if not edge.type_only]
        for target in (*parents, *runs):
            if target not in came_from:
                came_from[target] = module
                if target in edges:
                    queue.append(target)
    return came_from


def path_to(target: str, came_from: dict[str, str | None]) -> str:
    steps = [target]
    while (previous := came_from[steps[-1]]) is not None:
        steps.append(previous)
    return " -> ".join(reversed(steps))


def import_cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[frozenset[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(frozenset(component))
    return cycles


def imports_of_folder(folder: str) -> list[tuple[str, Edge]]:
    edges = import_edges()
    prefix = f"kvloom.{folder}"
    found = [(name, edge) for name, module_edges in edges.items() if name == prefix or name.startswith(prefix + ".")
             for edge in module_edges]
    assert found, f"kvloom/{folder} has no imports"
    return found


# --- the rules --------------------------------------------------------------------------------------------

def test_no_import_cycles_but_the_known_ones() -> None:
    cycles = import_cycles(import_graph())
    new = [sorted(cycle) for cycle in cycles if not any(cycle <= known for known in KNOWN_CYCLES.values())]
    assert not new, f"import cycles among kvloom modules: {new}"
    stale = [name for name, known in KNOWN_CYCLES.items() if not any(cycle & known for cycle in cycles)]
    assert not stale, f"these cycles are broken: delete them from KNOWN_CYCLES: {stale}"


@pytest.mark.parametrize("module", sorted(LOWER_LAYERS))
def test_low_modules_import_nothing_above_them(module: str) -> None:
    graph = import_graph()
    names = [name for name in graph if name == module or name.startswith(module + ".")]
    assert names, f"{module} does not exist"
    bad = [f"{name} imports {target}" for name in names for target in graph[name]
           if target.startswith(LOWER_LAYERS[module]) and not target.startswith(module)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("folder", MODEL_SIDE)
def test_model_side_imports_nothing_from_the_engine_or_entrypoints(folder: str) -> None:
    bad = [f"{name}:{edge.line} imports {edge.target}" for name, edge in imports_of_folder(folder)
           if edge.target.startswith(FORBIDDEN_FOR_MODEL_SIDE)]
    assert not bad, "\n".join(bad)


def test_the_engine_imports_nothing_from_the_server() -> None:
    """The server sits on the engine: ``kvloom/engine/`` (the data-parallel router included) never
    imports ``kvloom.entrypoints``."""
    bad = [f"{name}:{edge.line} imports {edge.target}" for name, edge in imports_of_folder("engine")
           if edge.target.startswith("kvloom.entrypoints")]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_no_path_leads_from_the_control_path_to_torch(module: str) -> None:
    """Whatever the control path imports, at once or lazily, and whatever that imports in turn, loads no
    torch and no outside package but the standard library."""
    edges = import_edges()
    assert module in edges, f"{module} does not exist"
    came_from = loaded_from(module, edges)
    outside = sorted(name for name in came_from if name not in edges and name not in sys.stdlib_module_names
                     and name not in CONTROL_PATH_THIRD_PARTY)
    assert not outside, "\n".join(path_to(name, came_from) for name in outside)


def test_the_control_path_loads_without_torch() -> None:
    """Importing the scheduler, KV cache manager, request, the seam's data and the config does not import
    torch (the test above reads the source; this one runs it)."""
    code = (f"import sys\nimport {', '.join(LOADS_WITHOUT_TORCH)}\n"
            f"print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:5])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"torch was imported: {result.stdout.strip()}"


# --- the reader sees what it must (so the rules above can fail) -------------------------------------------

def test_the_cycle_check_sees_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [frozenset({"a", "b", "c"})]


def _write(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_reader_follows_every_kind_of_import(tmp_path: Path) -> None:
    """Lazy imports in functions, ``importlib`` by literal and by f-string prefix, a lazy ``__getattr__`` map,
    relative imports and parent packages each lead on; a ``TYPE_CHECKING`` import is seen but never runs."""
    root = tmp_path / "pkg"
    _write(root, {
        "__init__.py": ('import importlib\n_NAMES = {"Heavy": "pkg.heavy"}\n'
                        "def __getattr__(name):\n    return getattr(importlib.import_module(_NAMES[name]), name)\n"),
        "heavy.py": "import torch\nclass Heavy: ...\n",
        "core/__init__.py": "",
        "core/a.py": "def f():\n    from pkg.core import b\n",
        "core/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import numpy\nfrom . import c\n",
        "core/c.py": "def g():\n    import importlib\n    return importlib.import_module('pkg.core.d')\n",
        "core/d.py": "from pkg import Heavy\n",
        "plug/__init__.py": "",
        "plug/one.py": "import json\n",
        "core/e.py": "import importlib\ndef h(kind):\n    return importlib.import_module(f'pkg.plug.{kind}')\n",
    })
    edges = import_edges(root)
    came_from = loaded_from("pkg.core.a", edges)
    assert path_to("torch", came_from) == "pkg.core.a -> pkg.core.b -> pkg.core.c -> pkg.core.d -> pkg.heavy -> torch"
    assert "numpy" not in came_from  # seen, but only for type checkers
    assert Edge(3, "numpy", True) in edges["pkg.core.b"]
    assert "pkg" in came_from and "pkg.core" in came_from  # the parent packages run first
    assert {"pkg.plug", "pkg.plug.one"} <= set(loaded_from("pkg.core.e", edges))
    assert "pkg.heavy" not in loaded_from("pkg.plug.one", edges)  # the parent's lazy map runs only when asked


def test_an_import_the_reader_cannot_follow_fails(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    _write(root, {"__init__.py": "",
                  "a.py": "import importlib\ndef f(name):\n    return importlib.import_module(name)\n"})
    with pytest.raises(ValueError, match=r"a.py:3: importlib.import_module\(name\)"):
        import_edges(root)

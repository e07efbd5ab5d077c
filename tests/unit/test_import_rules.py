"""The import rules of docs/architecture.md, checked on the source: a forbidden import fails here.

Every import counts, lazy ones inside functions and ``if TYPE_CHECKING:`` ones too: a lazy import defers a
dependency to run time but a reader still follows it, and a cycle through it is still a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kvloom"
# The model side of the engine/runner seam: it reads plain data (kvloom.step_io) and nothing of the engine.
MODEL_SIDE = ("worker", "executor", "models", "layers", "ops", "sample", "loader")
FORBIDDEN_FOR_MODEL_SIDE = ("kvloom.engine", "kvloom.entrypoints")
# The control path that never touches tensors.
TORCH_FREE = ("kvloom.engine.scheduler", "kvloom.engine.kv_cache_manager", "kvloom.engine.request",
              "kvloom.step_io", "kvloom.sampling_params", "kvloom.config")


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


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module an import statement in the file names (lazy ones inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
    return found


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """kvloom module -> the kvloom modules it imports (a name imported from a module maps to that module; a
    package's own submodules importing it are not edges: Python runs the package first anyway)."""
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}

    def owner(name: str) -> str | None:  # the module that defines name, or name itself if a module
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(owner(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                targets.update(owner(f"{base}.{alias.name}") for alias in node.names)
        graph[name] = {t for t in targets if t and t != name and not name.startswith(t + ".")}
    return graph


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


def test_the_cycle_check_sees_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [frozenset({"a", "b", "c"})]


@pytest.mark.parametrize("folder", MODEL_SIDE)
def test_model_side_imports_nothing_from_the_engine_or_entrypoints(folder: str) -> None:
    files = sorted((PACKAGE / folder).rglob("*.py"))
    assert files, f"kvloom/{folder} has no modules"
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
           for path in files for line, module in imported_modules(path)
           if module.startswith(FORBIDDEN_FOR_MODEL_SIDE)]
    assert not bad, "\n".join(bad)


def test_the_control_path_loads_without_torch() -> None:
    """Importing the scheduler, KV cache manager, request and the seam's data must not import torch."""
    code = (f"import sys\nimport {', '.join(TORCH_FREE)}\n"
            f"print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:5])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"torch was imported: {result.stdout.strip()}"


def test_the_checks_see_a_forbidden_import(tmp_path: Path) -> None:
    """The walker finds lazy and from-imports alike (so the tests above can fail)."""
    source = tmp_path / "bad.py"
    source.write_text("def f():\n    from kvloom.engine.request import Request\n    import kvloom.entrypoints.cli\n")
    modules = [module for _, module in imported_modules(source)]
    assert "kvloom.engine.request" in modules and "kvloom.entrypoints.cli" in modules


def test_the_engine_imports_nothing_from_the_server() -> None:
    """The server sits on the engine: ``kvloom/engine/`` (the data-parallel router included) never
    imports ``kvloom.entrypoints``."""
    files = sorted((PACKAGE / "engine").rglob("*.py"))
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
           for path in files for line, module in imported_modules(path) if module.startswith("kvloom.entrypoints")]
    assert not bad, "\n".join(bad)

"""The import rules of docs/architecture.md, checked on the source: a forbidden import fails here."""

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

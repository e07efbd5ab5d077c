"""Lets the scripts in benchmarks/ import ``kvloom.bench`` from this checkout in any environment.

A peer's venv (vLLM's) has no kvloom installed, and importing kvloom's engine there would add its
imports to the peer's start-up time. So unless the kvloom engine itself is asked for, ``kvloom``
is registered as a bare namespace over ``<repo>/kvloom`` and only ``kvloom.bench`` is loaded.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def bench_module(name: str, need_engine: bool) -> ModuleType:
    """``kvloom.bench.<name>``; with need_engine False, kvloom/__init__.py is never run."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if not need_engine and "kvloom" not in sys.modules:
        package = types.ModuleType("kvloom")
        package.__path__ = [str(ROOT / "kvloom")]
        package.__file__ = None
        sys.modules["kvloom"] = package
    return importlib.import_module(f"kvloom.bench.{name}")


def wants_kvloom_engine(argv: list[str]) -> bool:
    """True unless ``--engine X`` / ``--engine=X`` names a peer (kvloom is the default engine)."""
    for i, arg in enumerate(argv):
        if arg == "--engine" and i + 1 < len(argv):
            return argv[i + 1] == "kvloom"
        if arg.startswith("--engine="):
            return arg.split("=", 1)[1] == "kvloom"
    return True

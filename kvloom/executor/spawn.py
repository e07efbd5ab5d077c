"""Starting spawned processes, shared by the executors' worker processes and the data-parallel
replicas (``kvloom/engine/data_parallel/replica.py``); no torch."""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Start spawned processes without re-running the user's __main__ in them.

    spawn re-imports the parent's main script in every child so that objects defined there can be
    unpickled; a worker needs nothing from it, and a script without an ``if __name__ ==
    "__main__":`` guard (the seeds' offline example) would build a whole engine again in each worker.
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main

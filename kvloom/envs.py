"""Every environment variable kvloom reads, in one place.

Each ``KVLOOM_*`` variable is an alias for an engine or backend setting; an explicit argument
(``LLM(...)`` keyword or CLI flag) wins over the variable.
"""

from __future__ import annotations

import os

ENVIRONMENT_VARIABLES: dict[str, str] = {
    "KVLOOM_API_KEY": "API key the server requires on /v1/* (same as --api-key)",
    "KVLOOM_NUM_THREADS": "torch intra-op threads on the CPU (default: all cores)",
    "KVLOOM_LOGGING_LEVEL": "log level of the kvloom logger (default INFO)",
    "KVLOOM_CACHE_DIR": "folder for kvloom's on-disk caches; compiled CPU kernels go to its extensions/ "
    "(default ~/.cache/kvloom)",
}


def get(name: str) -> str | None:
    """The value of a documented kvloom environment variable, or None when unset or empty."""
    if name not in ENVIRONMENT_VARIABLES:
        raise KeyError(f"{name} is not a documented kvloom environment variable")
    value = os.environ.get(name, "").strip()
    return value or None


def get_int(name: str) -> int | None:
    """A positive integer, or None when unset."""
    raw = get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be a positive integer") from None
    if value < 1:
        raise ValueError(f"{name}={raw!r} must be a positive integer")
    return value

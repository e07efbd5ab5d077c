"""Every environment variable kvloom reads, in one place.

Each ``KVLOOM_*`` variable is an alias for an engine or backend setting; an explicit argument
(``LLM(...)`` keyword or CLI flag) wins over the variable.
"""

from __future__ import annotations

import os

ENVIRONMENT_VARIABLES: dict[str, str] = {
    "KVLOOM_CONTEXT_LENGTH_BUCKETS": "comma-separated prefill token-count buckets, e.g. '128,512,1024' "
    "(the seeds' NEURON_CONTEXT_LENGTH_BUCKETS)",
    "KVLOOM_TOKEN_GEN_BUCKETS": "comma-separated decode batch-size buckets, e.g. '1,8,64' "
    "(the seeds' NEURON_TOKEN_GEN_BUCKETS)",
    "KVLOOM_COMPILED_ARTIFACTS": "folder where compiled graphs are saved and reloaded at the next start "
    "(the seeds' NEURON_COMPILED_ARTIFACTS)",
    "KVLOOM_QUANT_DTYPE": "'s8' stores linear weights as int8 (the seeds' NEURON_QUANT_DTYPE)",
    "KVLOOM_API_KEY": "API key the server requires on /v1/* (same as --api-key)",
    "KVLOOM_NUM_THREADS": "torch intra-op threads on the CPU (default: all cores)",
    "KVLOOM_LOGGING_LEVEL": "log level of the kvloom logger (default INFO)",
}


def get(name: str) -> str | None:
    """The value of a documented kvloom environment variable, or None when unset or empty."""
    if name not in ENVIRONMENT_VARIABLES:
        raise KeyError(f"{name} is not a documented kvloom environment variable")
    value = os.environ.get(name, "").strip()
    return value or None


def get_int_list(name: str) -> list[int] | None:
    """A comma-separated list of positive integers, or None when unset."""
    raw = get(name)
    if raw is None:
        return None
    try:
        values = [int(part) for part in raw.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be a comma-separated list of integers") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{name}={raw!r} must list one or more positive integers")
    return sorted(set(values))

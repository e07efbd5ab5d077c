"""``StructuredOutputsConfig``: vLLM's ``structured_outputs_config`` (``--structured-outputs-config.backend``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

# "auto" picks xgrammar, the one backend kvloom has; vLLM's others are refused by name.
STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar")
# How long a request waits for its grammar to compile before it ends with an error (seconds). xgrammar
# compiles ordinary JSON schemas in milliseconds; this bounds a pathological one.
DEFAULT_COMPILE_TIMEOUT = 30.0


@dataclass
class StructuredOutputsConfig:
    backend: str = "auto"
    compile_timeout: float = DEFAULT_COMPILE_TIMEOUT
    # vLLM's: JSON grammars allow no free whitespace between tokens, for every request (small models
    # otherwise tend to spend their tokens on it).
    disable_any_whitespace: bool = False

    @classmethod
    def from_value(cls, value: dict[str, Any] | str | None) -> StructuredOutputsConfig:
        """From a dict or its JSON text (None: the defaults); ValueError naming a bad key or value."""
        if value is None:
            return cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"structured_outputs_config is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs_config must be a dict or JSON object, got {value!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"structured_outputs_config got unknown key(s) {unknown}; allowed: {known}")
        config = cls(**value)
        if config.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"structured outputs backend {config.backend!r} is not available: kvloom supports "
                             f"{list(STRUCTURED_OUTPUT_BACKENDS)} ('auto' is xgrammar)")
        timeout = config.compile_timeout
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise ValueError(f"structured_outputs_config.compile_timeout must be a positive number of "
                             f"seconds, got {timeout!r}")
        if not isinstance(config.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs_config.disable_any_whitespace must be true or false, "
                             f"got {config.disable_any_whitespace!r}")
        return config

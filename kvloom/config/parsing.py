"""Values as users write them: byte sizes ('2GiB'), integers with a floor, booleans on a command line."""

from __future__ import annotations

import re
from typing import Any


def check_int(name: str, value: Any, minimum: int) -> None:
    """ValueError unless ``value`` is an int (not a bool) >= ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def parse_bool(text: str) -> bool:
    """1/true/yes/on or 0/false/no/off, as a command line writes them."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def parse_memory(value: int | float | str | None) -> int | None:
    """Bytes from an int, or a string such as '2GiB', '512MiB', '1.5GB'."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"kv_cache_memory must be a byte count or a size like '2GiB', got {value!r}")
    if isinstance(value, (int, float)):
        number = int(value)
    else:
        match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B?|B)?\s*", str(value), re.IGNORECASE)
        if not match:
            raise ValueError(f"kv_cache_memory must be a byte count or a size like '2GiB', "
                             f"got {value!r}")
        unit = (match.group(2) or "B").upper().rstrip("B").rstrip("I")
        scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
        number = int(float(match.group(1)) * scale)
    if number <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {value!r}")
    return number



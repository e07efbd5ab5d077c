"""Structured outputs: grammars that constrain what a request may sample (backend.py is the seam,
xgrammar_backend.py the backend, manager.py the cache, compile thread and per-step bitmask, bitmask.py
the in-place masking of the logits)."""

from kvloom.structured_output.manager import (
    BACKENDS,
    GrammarBitmask,
    StructuredOutputManager,
    StructuredOutputRequest,
    check_backend,
)

__all__ = ["BACKENDS", "GrammarBitmask", "StructuredOutputManager", "StructuredOutputRequest", "check_backend"]

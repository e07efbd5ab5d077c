"""Reasoning models (``--reasoning-parser``): a reply's reasoning told from its content, as text for the
server's responses and as token ids for the grammar of a constrained request. No torch."""

from kvloom.reasoning.parsers import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Phase,
    Qwen3ReasoningParser,
    ReasoningGate,
    ReasoningParser,
    ReasoningStream,
    check_reasoning_parser,
    get_reasoning_parser,
)

__all__ = ["REASONING_PARSERS", "DeepSeekR1ReasoningParser", "Phase", "Qwen3ReasoningParser", "ReasoningGate",
           "ReasoningParser", "ReasoningStream", "check_reasoning_parser", "get_reasoning_parser"]

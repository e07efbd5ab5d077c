"""The seam between kvloom and a grammar library: what a backend compiles and what its matchers do.

A backend turns a request's ``StructuredOutputsParams`` into a compiled grammar (once per spec and
tokenizer, cached by the manager) and makes one matcher per request from it. The matcher follows the
request's sampled tokens and, before each sampling step, writes which tokens may come next as a packed
bitmask row: int32 words, bit ``j % 32`` of word ``j // 32`` set when token ``j`` is allowed (the
layout xgrammar and llguidance both use, so a second backend plugs in here without touching the
sampler).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from kvloom.sampling_params import StructuredOutputsParams


class GrammarMatcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over sampled tokens; False (and the matcher left where it was) when one is not allowed."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32 [rows, ceil(V / 32)], on the CPU)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar has ended (its stop token was accepted): nothing more may be generated."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer and vocabulary, and makes matchers for them."""

    name: str

    @abstractmethod
    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError naming the problem when the constraint is malformed (cheap: no token masks)."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (slow: precomputes token masks); ValueError when it does not compile."""

    @abstractmethod
    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of the compiled grammar."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """The width of the model's logits, which the bitmask covers."""


def bitmask_width(vocab_size: int) -> int:
    """int32 words in a bitmask row of ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32

"""A grammar that waits for the reasoning to end (``--reasoning-parser``), as vLLM's ``reasoning_ended``.

``ReasoningMatcher`` wraps a request's matcher. While the request reasons, every token is allowed and none
reaches the grammar; the token that ends the reasoning (``</think>``) is not part of it either; from the next
token on the grammar constrains and follows the reply as usual. A request whose reply may open its reasoning
(qwen3, no think tag in the prompt) gets the grammar's first token or ``<think>``.
"""

from __future__ import annotations

import torch

from kvloom.reasoning import Phase, ReasoningGate
from kvloom.structured_output.backend import GrammarMatcher


class ReasoningMatcher(GrammarMatcher):
    def __init__(self, matcher: GrammarMatcher, gate: ReasoningGate) -> None:
        self.matcher = matcher
        self.gate = gate
        # Per accepted token: the phase before it and whether the grammar took it (what rollback undoes).
        self.history: list[tuple[Phase, bool]] = []

    @property
    def reasoning_ended(self) -> bool:
        return self.gate.phase is Phase.CONTENT

    def accept_tokens(self, token_ids: list[int]) -> bool:
        phase = self.gate.phase
        steps: list[tuple[Phase, bool]] = []
        constrained: list[int] = []
        for token_id in token_ids:
            after, takes = self.gate.next_phase(phase, token_id)
            steps.append((phase, takes))
            if takes:
                constrained.append(token_id)
            phase = after
        if constrained and not self.matcher.accept_tokens(constrained):
            return False
        self.gate.phase = phase
        self.history += steps
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.gate.phase is Phase.REASONING:
            bitmask[row].fill_(-1)
            return
        self.matcher.fill_bitmask(bitmask, row)
        if self.gate.phase is Phase.BEFORE:
            word, bit = divmod(self.gate.start_token_id, 32)
            bitmask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)  # the bit of an int32 word

    def is_terminated(self) -> bool:
        return self.gate.phase is Phase.CONTENT and self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        undone = self.history[-num_tokens:]
        del self.history[-num_tokens:]
        taken = sum(takes for _, takes in undone)
        if taken:
            self.matcher.rollback(taken)
        self.gate.phase = undone[0][0]

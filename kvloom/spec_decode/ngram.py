"""N-gram prompt lookup: propose what followed the last time the request's latest n tokens appeared.

For each n from ``max_n`` down to ``min_n``, the request's last n tokens are looked up earlier in its
own tokens (prompt and output); the most recent earlier match wins, and the (up to) k tokens after it
are the proposal. No second model, no device work: it pays where outputs repeat their context
(summaries, code edits, extraction).
"""

from __future__ import annotations


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int = 1) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                             f"min={prompt_lookup_min}, max={prompt_lookup_max}")
        self.k = num_speculative_tokens
        self.max_n = prompt_lookup_max
        self.min_n = prompt_lookup_min

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """Up to k draft tokens to follow ``token_ids`` (empty when no n-gram recurs)."""
        k = self.k if k is None else k
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            pattern = token_ids[length - n:]
            # The most recent earlier occurrence: its continuation is the likeliest to repeat.
            for start in range(length - n - 1, -1, -1):
                if token_ids[start:start + n] == pattern:
                    return token_ids[start + n:start + n + k]
        return []

"""N-gram prompt lookup: propose what followed the last time the request's latest n tokens appeared.

For each n from ``max_n`` down to ``min_n``, the request's last n tokens are looked up earlier in its
own tokens (prompt and output); the most recent earlier match wins, and the (up to) k tokens after it
are the proposal. No second model, no device work: it pays where outputs repeat their context
(summaries, code edits, extraction).

A request's tokens only grow, so each keeps an ``NgramIndex``: per n, a dict from every n-gram seen so far
to where its most recent occurrence ends. A step indexes the tokens added since the last one and looks the
suffix up in O(max_n), instead of scanning the whole sequence (which at 64 requests of a few hundred tokens
cost ~10 ms a step in Python).
"""

from __future__ import annotations


class NgramIndex:
    """Where each n-gram of a token sequence last occurred (min_n <= n <= max_n), kept up to date as the
    sequence grows. An n-gram is indexed once it is no longer the sequence's suffix: a lookup of the suffix
    then finds its most recent *earlier* occurrence (which may overlap the suffix)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        # by_n[n][ngram] = the position just past its most recent indexed occurrence
        self.by_n: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.num_indexed = 0  # n-grams ending before this position are indexed

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        length = len(token_ids)
        # Index the n-grams ending at positions num_indexed .. length - 2 (all but the suffix).
        for end in range(self.num_indexed, length - 1):
            for n, table in self.by_n.items():
                if end + 1 >= n:
                    table[tuple(token_ids[end + 1 - n:end + 1])] = end + 1
        self.num_indexed = max(self.num_indexed, length - 1)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            after = self.by_n[n].get(tuple(token_ids[length - n:]))
            if after is not None:
                return token_ids[after:after + k]
        return []


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

    def new_index(self) -> NgramIndex:
        return NgramIndex(self.min_n, self.max_n)

    def propose(self, token_ids: list[int], k: int | None = None, index: NgramIndex | None = None) -> list[int]:
        """Up to k draft tokens to follow ``token_ids`` (empty when no n-gram recurs). ``index``: the one kept
        for this sequence across calls (its tokens may only have grown since); a fresh one when None."""
        return (index or self.new_index()).lookup(token_ids, self.k if k is None else k)

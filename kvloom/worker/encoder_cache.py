"""The runner's encoder cache: each image's rows (the vision tower + connector's output) by content hash.

An image is encoded once, on the step whose chunk first reaches its tokens, and its rows [num_embeds, H]
are kept here, so a chunked prompt's later chunks, a preempted request's recomputation and another request
with the same image (the second turn of a chat, the same picture sent again) read them instead of running
the encoder. Entries leave in LRU order when the budget (in rows) is exceeded; an entry a step needs is
held for that step whatever the budget, so eviction only ever costs a recompute.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

# Rows kept per token of max_num_batched_tokens: a step's own images plus about as many recent ones again, so
# a second request with the same image finds it (4 x 2,048 rows of a 576-wide model: ~19 MB in fp32).
BUDGET_ROWS_PER_BATCHED_TOKEN = 4


class EncoderCache:
    def __init__(self, budget_rows: int) -> None:
        self.budget_rows = budget_rows
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_rows = 0

    def get(self, content_hash: str) -> torch.Tensor | None:
        rows = self.entries.get(content_hash)
        if rows is not None:
            self.entries.move_to_end(content_hash)
        return rows

    def put(self, content_hash: str, rows: torch.Tensor) -> None:
        if content_hash in self.entries:
            return
        self.entries[content_hash] = rows
        self.num_rows += rows.shape[0]
        while self.num_rows > self.budget_rows and len(self.entries) > 1:
            _, evicted = self.entries.popitem(last=False)
            self.num_rows -= evicted.shape[0]


def multimodal_embeddings(items: Sequence[Any], query_start_loc: Sequence[int], features_of: Callable[[str], Any],
                          cache: EncoderCache, encode: Callable[[torch.Tensor], torch.Tensor],
                          device: torch.device) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, int, int]:
    """The image rows this step's tokens take: (flat token indices [M], rows [M, H]) or None, and the number
    of images found in the cache and encoded.

    ``items``: the step's ScheduledRequests, laid end to end from ``query_start_loc``; ``features_of(request id)``
    its ImageFeatures. An image is needed when the chunk [num_computed_tokens, + num_new_tokens) holds any of
    its positions; only those of its rows are placed, so a chunk may end inside an image."""
    needed: list[tuple[Any, int, int, int]] = []  # (feature, first row, end row, flat index of position 0)
    for item, start_index in zip(items, query_start_loc):
        features = features_of(item.request_id)
        if not features:
            continue
        start = item.num_computed_tokens
        end = start + item.num_new_tokens
        for feature in features:
            if feature.offset >= end or feature.end <= start:
                continue
            lo = bisect_left(feature.embed_positions, start)
            hi = bisect_left(feature.embed_positions, end)
            if lo < hi:
                needed.append((feature, lo, hi, start_index - start))
    if not needed:
        return None, 0, 0
    rows_by_hash: dict[str, torch.Tensor] = {}
    missing: dict[str, Any] = {}
    hits = 0
    for feature, _, _, _ in needed:
        key = feature.content_hash
        if key in rows_by_hash or key in missing:
            continue
        rows = cache.get(key)
        if rows is None:
            missing[key] = feature
        else:
            rows_by_hash[key] = rows
            hits += 1
    if missing:
        # Every missing image's tiles in one encoder batch [tiles, C, S, S].
        features = list(missing.values())
        pixels = torch.from_numpy(np.concatenate([f.pixel_values for f in features])).to(device)
        encoded = encode(pixels)
        offset = 0
        for feature in features:
            rows = encoded[offset:offset + feature.num_embeds]
            offset += feature.num_embeds
            rows_by_hash[feature.content_hash] = rows
            cache.put(feature.content_hash, rows)
    index: list[int] = []
    parts: list[torch.Tensor] = []
    for feature, lo, hi, shift in needed:
        index.extend(p + shift for p in feature.embed_positions[lo:hi])
        parts.append(rows_by_hash[feature.content_hash][lo:hi])
    return (torch.tensor(index, device=device), torch.cat(parts)), hits, len(missing)

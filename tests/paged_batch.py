"""Requests placed in a paged KV cache, as the attention tests of every backend need them.

Each request has ``context`` tokens already cached and ``new`` tokens this step; its blocks are drawn
from a shuffled pool (block 0 stays the null block, which pads the block tables), so a kernel that
ignores the block table reads the wrong keys.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class PagedBatch:
    block_tables: list[list[int]]  # each request's blocks, padded with the null block to one width
    slot_mapping: list[int]  # the cache slot of every new token, requests end to end
    seq_lens: list[int]  # context + new tokens
    query_start_loc: list[int]  # B + 1 prefix sums of the new tokens
    num_decodes: int  # requests with exactly one new token
    num_blocks: int  # the pool's size, the null block included


def place_requests(query_lens: list[int], context_lens: list[int], block_size: int,
                   num_blocks: int | None = None, seed: int = 0) -> PagedBatch:
    """Blocks for each request's whole sequence, from a shuffled pool of ``num_blocks`` (default: just
    enough for every request, plus the null block)."""
    needed = [-(-(q + c) // block_size) for q, c in zip(query_lens, context_lens)]
    num_blocks = 1 + sum(needed) if num_blocks is None else num_blocks
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    width = max(needed)
    tables, slots, seq_lens, starts = [], [], [], [0]
    for new, context, count in zip(query_lens, context_lens, needed):
        blocks = [free.pop() for _ in range(count)]
        tables.append(blocks + [0] * (width - count))
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(context, context + new))
        seq_lens.append(context + new)
        starts.append(starts[-1] + new)
    return PagedBatch(tables, slots, seq_lens, starts, sum(1 for q in query_lens if q == 1), num_blocks)

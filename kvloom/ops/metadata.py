"""What attention needs to know about a step's flat batch.

The batch is every scheduled request's new tokens laid end to end, decodes (one new token) first,
then prefills (chunks of prompts). Request i owns tokens [query_start_loc[i], query_start_loc[i+1])
and attends to the first seq_lens[i] positions of its sequence, which live in the KV cache at

    slot = block_table[i, pos // block_size] * block_size + pos % block_size

Unused block-table entries point at block 0, the null block, whose keys and values stay zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    block_table: torch.Tensor  # [B, max_blocks] int64, padded with the null block
    seq_lens: torch.Tensor  # [B] int64: context length after this step, new tokens included
    query_start_loc: list[int]  # B + 1 host ints: prefix sums of the query lengths
    seq_lens_host: list[int]  # the same as seq_lens, on the host (loops and shapes need it)
    num_decodes: int  # the first num_decodes requests have exactly one new token
    block_size: int
    sliding_window: int | None = None
    # Decode fast path, built once per step and shared by every layer:
    decode_num_blocks: int = 0  # block-table columns the decodes need (a bucketed length)
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, L] bool, True = attend
    # query_start_loc as a [B + 1] int64 tensor on the device (kernels that take the whole batch)
    query_start_loc_tensor: torch.Tensor | None = None
    max_query_len: int = 1  # the longest request's new tokens (a kernel's grid size)

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_host)

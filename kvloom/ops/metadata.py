"""What attention needs to know about a step's flat batch.

The batch is every scheduled request's new tokens laid end to end, decodes (one new token) first,
then prefills (chunks of prompts). Request i owns tokens [query_start_loc[i], query_start_loc[i+1])
and attends to the first seq_lens[i] positions of its sequence, which live in the KV cache at

    slot = block_table[i, pos // block_size] * block_size + pos % block_size

Unused block-table entries point at block 0, the null block, whose keys and values stay zero.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

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
    # with_sliding_window's copies of this step's metadata by window, built once per step and shared by
    # every layer with that window (models whose layers differ: Gemma 2/3).
    windowed: dict[int | None, AttentionMetadata] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_host)


def with_sliding_window(metadata: AttentionMetadata, sliding_window: int | None) -> AttentionMetadata:
    """This step's metadata for a layer that attends within ``sliding_window`` (None: the whole context),
    where a model's layers differ from the window the metadata was built with. The tensors are shared;
    only the decode mask (where the step has one) is narrowed: [num_decodes, 1, 1, L], True = attend."""
    if sliding_window == metadata.sliding_window:
        return metadata
    narrowed = metadata.windowed.get(sliding_window)
    if narrowed is not None:
        return narrowed
    decode_mask = metadata.decode_mask
    if decode_mask is not None:
        key_pos = torch.arange(decode_mask.shape[-1], device=decode_mask.device)
        lens = metadata.seq_lens[:decode_mask.shape[0], None]
        decode_mask = key_pos < lens
        if sliding_window is not None:
            decode_mask &= key_pos > lens - 1 - sliding_window
        decode_mask = decode_mask[:, None, None, :]
    narrowed = dataclasses.replace(metadata, sliding_window=sliding_window, decode_mask=decode_mask, windowed={})
    metadata.windowed[sliding_window] = narrowed
    return narrowed


def whole_prefill(lengths: list[int], block_size: int, sliding_window: int | None,
                  device: torch.device | str = "cpu") -> tuple[AttentionMetadata, torch.Tensor, int]:
    """Whole sequences of these lengths prefilled in one step into fresh blocks of a scratch cache, laid
    end to end from block 1 (block 0 stays the null block): (metadata, positions [sum(lengths)], the
    cache's block count)."""
    blocks = [-(-n // block_size) for n in lengths]
    block_table = torch.zeros(len(lengths), max(blocks), dtype=torch.long)
    slot_mapping, positions, starts = [], [], [0]
    next_block = 1
    for row, (n, count) in enumerate(zip(lengths, blocks)):
        block_table[row, :count] = torch.arange(next_block, next_block + count)
        slot_mapping.append(torch.arange(n) + next_block * block_size)
        positions.append(torch.arange(n))
        starts.append(starts[-1] + n)
        next_block += count
    metadata = AttentionMetadata(
        slot_mapping=torch.cat(slot_mapping).to(device), block_table=block_table.to(device),
        seq_lens=torch.tensor(lengths, dtype=torch.long, device=device), query_start_loc=starts,
        query_start_loc_tensor=torch.tensor(starts, dtype=torch.long, device=device), seq_lens_host=list(lengths),
        num_decodes=0, block_size=block_size, sliding_window=sliding_window, max_query_len=max(lengths))
    return metadata, torch.cat(positions).to(device), next_block

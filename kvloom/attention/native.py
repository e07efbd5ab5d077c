"""Fast attention through torch's fused scaled_dot_product_attention (CPU flash kernel, CUDA flash).

Decodes are one batched call over keys gathered by block table up to a bucketed length (the null
block pads shorter rows, the mask hides it). A prefill with no earlier context attends to its own
new keys directly (no cache read); a chunk that continues a sequence gathers its context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvloom.attention.metadata import AttentionMetadata
from kvloom.attention.reference import causal_mask, gather_sequence, write_kv_cache


def attention_native(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     key_cache: torch.Tensor, value_cache: torch.Tensor,
                     metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """query: [T, Hq, D]; key, value: [T, Hkv, D]; returns [T, Hq, D]."""
    write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
    out = torch.empty_like(query)
    num_decodes = metadata.num_decodes
    if num_decodes:
        out[:num_decodes] = _decode(query[:num_decodes], key_cache, value_cache, metadata, scale)
    for i in range(num_decodes, metadata.num_requests):
        start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
        seq_len = metadata.seq_lens_host[i]
        query_len = end - start
        q = query[start:end].transpose(0, 1)  # [Hq, Q, D]
        if seq_len == query_len and (metadata.sliding_window is None or seq_len <= metadata.sliding_window):
            k = key[start:end].transpose(0, 1)
            v = value[start:end].transpose(0, 1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            k = gather_sequence(key_cache, metadata.block_table[i], seq_len).transpose(0, 1)
            v = gather_sequence(value_cache, metadata.block_table[i], seq_len).transpose(0, 1)
            mask = causal_mask(query_len, seq_len, metadata.sliding_window, query.device)
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                               scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
    return out


def _decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """query: [B, Hq, D] (one token per request) -> [B, Hq, D]."""
    batch, num_heads, head_dim = query.shape
    num_blocks = metadata.decode_num_blocks
    block_table = metadata.block_table[:batch, :num_blocks]
    num_kv_heads = key_cache.shape[2]
    # [B, nb, bs, Hkv, D] -> [B, Hkv, L, D]
    k = key_cache[block_table].view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = value_cache[block_table].view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    q = query.unsqueeze(2)  # [B, Hq, 1, D]
    o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=metadata.decode_mask,
                                       scale=scale, enable_gqa=True)
    return o.squeeze(2)

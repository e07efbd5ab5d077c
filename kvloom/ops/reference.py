"""The plain-torch references of every hot op: the oracles that each fast path is tested against.

Attention goes one request at a time, in fp32, every key gathered by its slot: slow and obvious.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvloom.ops import huge_pages
from kvloom.ops.metadata import AttentionMetadata


def kv_cache_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    pairs: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One layer's (key_cache, value_cache) shapes, in one of two layouts:

    rows   both [num_blocks, block_size, Hkv, D];
    pairs  keys [num_blocks, Hkv, D / 2, block_size, 2] and values [num_blocks, Hkv, block_size / 2, D, 2]: per
           block and kv head, keys as pairs of dimensions with the block's keys side by side, and values as
           pairs of keys with the dimensions side by side, as the CPU kernel's bf16 dot products read them
           (csrc/paged_attention.cpp).
    int8   rows of D codes and then the row's fp16 scale (kv_cache_dtype="int8", quantize_kv_rows).
    """
    if dtype == torch.int8:
        shape = (num_blocks, block_size, num_kv_heads, head_dim + INT8_KV_SCALE_BYTES)
        return shape, shape
    if not pairs:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return shape, shape
    return ((num_blocks, num_kv_heads, head_dim // 2, block_size, 2),
            (num_blocks, num_kv_heads, block_size // 2, head_dim, 2))


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: torch.device | str = "cpu", pairs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's zeroed (key_cache, value_cache) (shapes: kv_cache_shapes)."""
    return allocate_kv_caches(1, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, pairs)[0]


# A CPU cache of this many bytes or more (all layers) is mapped zeroed on first touch instead of torch.zeros.
LAZY_ZEROS_MIN_BYTES = 1 << 20


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device | str = "cpu", pairs: bool = False
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's zeroed (key_cache, value_cache) (shapes: kv_cache_shapes).

    On the CPU a cache of LAZY_ZEROS_MIN_BYTES or more is one private anonymous mapping for all layers, whose pages
    the kernel zero-fills when a step first writes them: torch.zeros writes every page at start-up (~1.3 s a GiB
    on a Zen 4 VM, 12 ms a MiB in small tensors: most of a start that maps a packed model), this costs nothing
    until the blocks are used. The memory is reserved by the budget, not made resident up front. Where available
    it is on huge pages (ops/huge_pages.py): attention reads blocks scattered over the whole cache, and a huge
    page is faulted in whole."""
    key_shape, value_shape = kv_cache_shapes(num_blocks, block_size, num_kv_heads, head_dim, dtype, pairs)
    nbytes = num_layers * (math.prod(key_shape) + math.prod(value_shape)) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < LAZY_ZEROS_MIN_BYTES:
        return [(torch.zeros(key_shape, dtype=dtype, device=device),
                 torch.zeros(value_shape, dtype=dtype, device=device)) for _ in range(num_layers)]
    tensors = huge_pages.zeros_many([key_shape, value_shape] * num_layers, dtype)
    return list(zip(tensors[0::2], tensors[1::2], strict=True))


INT8_KV_SCALE_BYTES = 2  # an int8 KV row ends in its scale, one fp16
FP8_MAX = 448.0  # the largest finite float8_e4m3fn: an fp8 KV cache clamps to it


def quantize_kv_rows(rows: torch.Tensor) -> torch.Tensor:
    """[..., D] keys or values -> int8 [..., D + 2]: per row the codes round(x / s) (half to even, clamped to
    +-127) and then s = fp16(max|x| / 127) in its 2 bytes; a row of zeros has s = 0 and codes 0. The C++
    kernels write (csrc/fused_ops.cpp write_int8_row) and read exactly this."""
    x = rows.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127).clamp(max=65504.0).half()
    scale_f = scale.float()
    codes = torch.where(scale_f > 0, torch.round(x / torch.where(scale_f > 0, scale_f, 1.0)), 0.0)
    codes = codes.clamp(-127, 127).to(torch.int8)
    return torch.cat((codes, scale.view(torch.int8).view(*scale.shape[:-1], INT8_KV_SCALE_BYTES)), dim=-1)


def dequantize_kv_rows(rows: torch.Tensor) -> torch.Tensor:
    """int8 [..., D + 2] rows (quantize_kv_rows) -> fp32 [..., D]: codes times the row's scale."""
    scale = rows[..., -INT8_KV_SCALE_BYTES:].contiguous().view(torch.float16).float()
    return rows[..., :-INT8_KV_SCALE_BYTES].float() * scale


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value: [T, Hkv, D]; caches as allocate_kv_cache makes them (rows or pairs, int8 rows, fp8 rows)."""
    if key_cache.dtype == torch.int8:
        key, value = quantize_kv_rows(key), quantize_kv_rows(value)
        key_cache.view(-1, *key.shape[1:]).index_copy_(0, slot_mapping, key)
        value_cache.view(-1, *value.shape[1:]).index_copy_(0, slot_mapping, value)
        return
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    if key_cache.dtype == torch.float8_e4m3fn:  # kv_cache_dtype="fp8": e4m3 saturates at +-448
        key, value = (t.float().clamp(-FP8_MAX, FP8_MAX).to(key_cache.dtype).view(torch.uint8) for t in (key, value))
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)  # (CPU copies need it)
    key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    if key_cache.dim() == 4:
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
        return
    block_size = key_cache.shape[3]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_cache[blocks, :, :, offsets] = key.view(-1, num_kv_heads, head_dim // 2, 2)
    value_cache[blocks, :, offsets // 2, :, offsets % 2] = value


def causal_mask(query_len: int, seq_len: int, sliding_window: int | None, device: torch.device
                ) -> torch.Tensor:
    """[query_len, seq_len] bool, True where query i (at position seq_len - query_len + i) may attend."""
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    key_pos = torch.arange(seq_len, device=device)[None, :]
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask


def gather_sequence(cache: torch.Tensor, block_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len positions of one request's K or V, from a rows cache: [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    positions = torch.arange(seq_len, device=cache.device)
    slots = block_row[positions // block_size] * block_size + positions % block_size
    return cache.view(-1, cache.shape[2], cache.shape[3]).index_select(0, slots)


def gather_keys_values(key_cache: torch.Tensor, value_cache: torch.Tensor, block_row: torch.Tensor,
                       seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first seq_len positions of one request's K and V, from caches in either layout: [seq_len, Hkv, D] each."""
    if key_cache.dtype == torch.int8:
        return (dequantize_kv_rows(gather_sequence(key_cache, block_row, seq_len)),
                dequantize_kv_rows(gather_sequence(value_cache, block_row, seq_len)))
    if key_cache.dim() == 4:
        return (gather_sequence(key_cache, block_row, seq_len), gather_sequence(value_cache, block_row, seq_len))
    block_size = key_cache.shape[3]
    positions = torch.arange(seq_len, device=key_cache.device)
    blocks, offsets = block_row[positions // block_size], positions % block_size
    keys = key_cache[blocks, :, :, offsets].flatten(2)  # [S, Hkv, D / 2, 2] -> [S, Hkv, D]
    return keys, value_cache[blocks, :, offsets // 2, :, offsets % 2]


def attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        key_cache: torch.Tensor, value_cache: torch.Tensor,
                        metadata: AttentionMetadata, scale: float, logit_softcap: float | None = None
                        ) -> torch.Tensor:
    """query: [T, Hq, D]; key, value: [T, Hkv, D] (this step's); returns [T, Hq, D].
    ``logit_softcap`` (Gemma 2): scores become cap * tanh(scores / cap) before the mask and softmax."""
    write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
    num_heads, head_dim = query.shape[1], query.shape[2]
    group = num_heads // key.shape[1]
    out = torch.empty_like(query)
    for i in range(metadata.num_requests):
        start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
        seq_len = metadata.seq_lens_host[i]
        k, v = (t.float() for t in gather_keys_values(key_cache, value_cache, metadata.block_table[i], seq_len))
        k = k.repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        q = query[start:end].float()  # [Q, Hq, D]
        scores = torch.einsum("qhd,shd->hqs", q, k) * scale
        if logit_softcap is not None:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        mask = causal_mask(end - start, seq_len, metadata.sliding_window, query.device)
        scores = scores.masked_fill(~mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqs,shd->qhd", probs, v).to(query.dtype)
    return out.view(-1, num_heads, head_dim)


# ---- the small ops ------------------------------------------------------------------------------
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain torch in fp32, as HF's LlamaRMSNorm computes it: y = w * x / sqrt(mean(x^2) + eps)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] (HF's rotate-half layout); cos, sin: [T, head_dim // 2]. Computed in fp32."""
    dtype = x.dtype
    x = x.float()
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :].float(), sin[:, None, :].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] laid out as [gate | up] -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- mixture of experts ----------------------------------------------------------------------------
def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The T * k (token, expert) assignments grouped by expert: (order [T * k], the flat assignment index of
    each grouped row; token_index [T * k], its token; counts [E], rows per expert). Stable, so within an
    expert tokens keep their batch order."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, order // topk_ids.shape[1], torch.bincount(flat, minlength=num_experts)


# One expert's product: (expert, rows [n, K]) -> [n, N].
ExpertProduct = Callable[[int, torch.Tensor], torch.Tensor]


def grouped_experts(hidden: torch.Tensor, gate_up: ExpertProduct, down: ExpertProduct, num_experts: int,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts over their routed tokens, summed with the routing weights: hidden [T, H], topk_weights
    [T, k], topk_ids [T, k] int64 -> [T, H]. The tokens are grouped by expert once and each expert with tokens
    runs its two products once over all of them (a loop over experts, never over tokens)."""
    order, token_index, counts = sort_by_expert(topk_ids, num_experts)
    rows = hidden.index_select(0, token_index)  # [T * k, H], grouped by expert
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts.tolist()):  # one host sync per call, for the group sizes
        if count:
            group = rows[start:start + count]
            out[start:start + count] = down(expert, silu_and_mul(gate_up(expert, group)))
            start += count
    out *= topk_weights.reshape(-1)[order, None].to(out.dtype)
    return torch.zeros_like(hidden).index_add_(0, token_index, out)


def fused_experts_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor) -> torch.Tensor:
    """grouped_experts with F.linear on the stacked weights: w13 [E, 2I, H] (each expert's gate rows, then up
    rows), w2 [E, H, I]."""
    return grouped_experts(hidden, lambda e, x: F.linear(x, w13[e]), lambda e, x: F.linear(x, w2[e]),
                           w13.shape[0], topk_weights, topk_ids)


def fused_experts_int8_reference(hidden: torch.Tensor, w13_qweight: torch.Tensor, w13_scale: torch.Tensor,
                                 w2_qweight: torch.Tensor, w2_scale: torch.Tensor, topk_weights: torch.Tensor,
                                 topk_ids: torch.Tensor) -> torch.Tensor:
    """grouped_experts on int8 expert weights in the dense layers' per-row format, weight-only: codes int8
    w13_qweight [E, 2I, H], w2_qweight [E, H, I] with one fp32 scale per row, w13_scale [E, 2I], w2_scale
    [E, H]; each product is (x @ q^T) * scale in fp32 (ops/int8.py int8_linear_reference)."""
    from kvloom.ops.int8 import int8_linear_reference

    return grouped_experts(hidden, lambda e, x: int8_linear_reference(x, w13_qweight[e], w13_scale[e]),
                           lambda e, x: int8_linear_reference(x, w2_qweight[e], w2_scale[e]),
                           w13_qweight.shape[0], topk_weights, topk_ids)


class ReferenceExperts:
    """The experts' stacked weights, run by fused_experts_reference: (hidden, topk_weights, topk_ids) -> [T, H]."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.w13, self.w2 = w13, w2

    def __call__(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts_reference(hidden, self.w13, self.w2, topk_weights, topk_ids)

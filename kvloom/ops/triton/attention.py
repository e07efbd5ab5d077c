"""Paged attention in Triton: the KV-cache write, decode (one query token per request) and prefill chunks.

The KV cache holds every request's keys and values in fixed-size blocks; a request's block-table row
says which physical block holds each run of ``block_size`` positions::

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]   (block 0 = null block)

    block_table[i] = [ 7, 2, 9, 0, 0 ]        request i, seq_len 10, block_size 4
                       |  |  |  '--'--- padding (the null block)
                       |  |  '-- positions 8..9
                       |  '----- positions 4..7
                       '-------- positions 0..3

    slot(i, p) = block_table[i, p // block_size] * block_size + p % block_size

The kernels gather each key tile token by token through the block table (any ``block_size``, from 1 to
the whole context) and never copy the cache. The cache holds the model's dtype, or (``kv_cache_dtype``):

    int8   [num_blocks, block_size, num_kv_heads, head_dim + 2]: per row (token, kv head) the codes
           round(x / s) and then s = fp16(max|x| / 127) in 2 bytes (ops/reference.py quantize_kv_rows);
           attention multiplies a key's scores by its s and a value's probabilities by its own
    fp8    float8_e4m3fn [num_blocks, block_size, num_kv_heads, head_dim], values clamped to +-448

Every kernel takes its loop bounds from ``seq_lens`` and ``query_start_loc`` on the device, so a launch
needs no host sync and a decode launch (fixed grid) can be captured in a CUDA graph. Softmax and
accumulation are fp32; the output is written in ``out``'s dtype.

The flat batch (``paged_attention``) is every request's new tokens end to end, decodes first::

    query: [T, Hq, D]   | d0 | d1 | d2 |  prefill 0 (q_len 5)  | prefill 1 (q_len 3) |
    query_start_loc:     0    1    2    3                       8                     11

A prefill chunk's tokens are the last ``q_len`` positions of its ``seq_len``-long sequence, so a chunk
that continues a cached prefix attends the prefix and itself, causally.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kvloom.ops.reference import INT8_KV_SCALE_BYTES

# Decode: one program per (request, kv head) holds its query heads in one tile padded to 16 rows, the
# smallest tl.dot M; 64-token key tiles keep 4 warps busy on 64..128-dim heads with little tail waste.
DECODE_BLOCK_N = 64
DECODE_NUM_WARPS = 4
# With 2+ stages Triton prefetches the next tile's K/V with cp.async; a third also prefetches the block-table
# entries that address that copy (sm_90 compile: ~64 registers, ~21 KB shared at head_dim 64).
DECODE_NUM_STAGES = 3
# Split-K ("flash decoding") when B * Hkv programs cannot fill the SMs: up to 8 splits per context.
DECODE_MAX_SPLITS = 8
# Prefill: 64 x 64 tiles fit the short chunks of a mixed batch (a 128-row tile would be mostly
# padding); at head_dim 128 and 3 stages that is ~82 KB of shared memory, two programs per H100 SM.
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 64
PREFILL_NUM_WARPS = 4
PREFILL_NUM_STAGES = 3
# write_kv_cache moves one token (all kv heads) per program; it is pure bandwidth.
WRITE_NUM_WARPS = 4

_LOG2_E = 1.4426950408889634
_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
# Cache dtypes: the model's, int8 rows with their scale, or fp8 e4m3 (clamped to FP8_MAX, 448: the kernels
# write that number, Triton reads no Python globals).
CACHE_DTYPES = (*_DOT_DTYPES, torch.int8, torch.float8_e4m3fn)


def _dot_config(query: torch.Tensor) -> tuple[tl.dtype, str]:
    """The dtype tl.dot's operands are cast to (the query's: an int8 code or an fp8 value is exact in it), and
    its fp32 input precision.

    Tensor cores take 16-bit operands on a GPU. Triton's interpreter sums bf16 dots wrongly (it
    multiplies the raw bits), so there, and on CPU tensors, operands go in as fp32. fp32 dots use
    "ieee" rather than tf32 so that fp32 caches give fp32-accurate results.
    """
    if os.environ.get("TRITON_INTERPRET") == "1" or query.device.type == "cpu" or query.dtype == torch.float32:
        return tl.float32, "ieee"
    return _DOT_DTYPES[query.dtype], "tf32"


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _head_dim_pad(head_dim: int) -> int:
    # tl.arange needs a power of two and tl.dot needs K >= 16; other head dims are masked.
    return max(16, triton.next_power_of_2(head_dim))


def _check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> int:
    """Validates the caches and returns their head_dim (an int8 row's last 2 bytes are its scale)."""
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1:
        raise ValueError("key_cache and value_cache must have the same strides and a contiguous last dim")
    if key_cache.dtype != value_cache.dtype or key_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"the caches must share one of {list(CACHE_DTYPES)}, got {key_cache.dtype} and "
                         f"{value_cache.dtype}")
    return key_cache.shape[3] - (INT8_KV_SCALE_BYTES if key_cache.dtype == torch.int8 else 0)


def _check_attention_args(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor) -> int:
    """Validates shapes (host metadata only, no sync) and returns the GQA group size."""
    cache_head_dim = _check_caches(key_cache, value_cache)
    if query.dim() != 3 or out.shape != query.shape:
        raise ValueError(f"query and out must both be [T, num_heads, head_dim], got {tuple(query.shape)} and "
                         f"{tuple(out.shape)}")
    if query.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("query and out must have a contiguous last dim (other strides are free)")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if head_dim != cache_head_dim:
        raise ValueError(f"query head_dim {head_dim} differs from the cache's {cache_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be [B, max_blocks] int32 or int64, got {tuple(block_table.shape)} "
                         f"{block_table.dtype}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != block_table.shape[0]:
        raise ValueError(f"seq_lens must be [B] with B = block_table.shape[0] = {block_table.shape[0]}, "
                         f"got {tuple(seq_lens.shape)}")
    return num_heads // num_kv_heads


# --------------------------------------------------------------------------------------------------
# KV-cache write
# --------------------------------------------------------------------------------------------------


@triton.jit
def _round_half_even(x):
    """torch.round's rounding (half to even), from floor: Triton's interpreter has no rint."""
    r = tl.floor(x + 0.5)
    return tl.where(((r - x) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0), r - 1.0, r)


@triton.jit
def _round_to_e4m3(x):
    """x clamped to +-448 and rounded (half to even) to e4m3's 3 mantissa bits, in fp32: the conversion that
    follows is then exact everywhere (Triton's interpreter rounds subnormals and mantissa carries wrongly)."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    exponent = (x.to(tl.int32, bitcast=True) >> 23) & 255
    step = (tl.maximum(exponent - 3, 127 - 9) << 23).to(tl.float32, bitcast=True)  # >= 2^-9, subnormals' step
    return _round_half_even(x / step) * step


@triton.jit
def _load_kv(ptrs, mask, KV_INT8: tl.constexpr):
    """K or V values, 0 where masked (an int 0 for int8 codes: the interpreter casts no float to them)."""
    if KV_INT8:
        return tl.load(ptrs, mask=mask, other=0)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store_rows(cache_ptr, row_offs, x, heads_mask, dims, mask,
                HEAD_DIM: tl.constexpr, KV_INT8: tl.constexpr, KV_FP8: tl.constexpr):
    """x [heads, dims] fp32 into the cache rows at row_offs [heads], in the cache's format."""
    offs = row_offs[:, None] + dims[None, :]
    if KV_INT8:  # ops/reference.py quantize_kv_rows, bit for bit (IEEE division: a GPU's '/' is approximate)
        scale = tl.minimum(tl.div_rn(tl.max(tl.abs(x), 1), 127.0), 65504.0).to(tl.float16)
        scale_f = scale.to(tl.float32)
        codes = _round_half_even(tl.div_rn(x, tl.where(scale_f > 0, scale_f, 1.0)[:, None]))
        codes = tl.minimum(tl.maximum(tl.where(scale_f[:, None] > 0, codes, 0.0), -127.0), 127.0)
        tl.store(cache_ptr + offs, codes.to(tl.int8), mask=mask)
        bits = scale.to(tl.int16, bitcast=True)
        tl.store(cache_ptr + row_offs + HEAD_DIM, (bits & 255).to(tl.int8), mask=heads_mask)
        tl.store(cache_ptr + row_offs + HEAD_DIM + 1, ((bits >> 8) & 255).to(tl.int8), mask=heads_mask)
    elif KV_FP8:
        tl.store(cache_ptr + offs, _round_to_e4m3(x).to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(cache_ptr + offs, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_scales(cache_ptr, row_offs, mask, HEAD_DIM: tl.constexpr):
    """The fp32 scales of int8 rows at row_offs (their fp16 in the row's last 2 bytes); 0 where masked."""
    lo = tl.load(cache_ptr + row_offs + HEAD_DIM, mask=mask, other=0).to(tl.uint8).to(tl.uint16)
    hi = tl.load(cache_ptr + row_offs + HEAD_DIM + 1, mask=mask, other=0).to(tl.uint8).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr,  # [T, Hkv, D]
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, Hkv, D (+ 2 for int8)]
    slot_mapping_ptr,  # [T] int64, negative = padding
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_cache_block, stride_cache_pos, stride_cache_head,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, NUM_KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, KV_INT8: tl.constexpr, KV_FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, NUM_KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    heads_mask = heads < NUM_KV_HEADS
    mask = heads_mask[:, None] & (dims[None, :] < HEAD_DIM)
    row_offs = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_pos \
        + heads * stride_cache_head
    key = tl.load(key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :], mask=mask,
                  other=0.0).to(tl.float32)
    _store_rows(key_cache_ptr, row_offs, key, heads_mask, dims, mask, HEAD_DIM, KV_INT8, KV_FP8)
    value = tl.load(value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :],
                    mask=mask, other=0.0).to(tl.float32)
    _store_rows(value_cache_ptr, row_offs, value, heads_mask, dims, mask, HEAD_DIM, KV_INT8, KV_FP8)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Writes this step's keys and values into their cache slots, converting to the cache's format.

    key, value: [T, Hkv, D], any token/head strides, contiguous last dim (e.g. slices of a fused qkv).
    key_cache, value_cache: [num_blocks, block_size, Hkv, D] (int8: D + 2, each row's codes and scale; fp8:
    values clamped to +-448). slot_mapping: [T] int; a negative slot is a padding token (CUDA-graph batches) and
    writes nothing.
    """
    cache_head_dim = _check_caches(key_cache, value_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if key.shape != value.shape or (key_cache.shape[2], cache_head_dim) != (num_kv_heads, head_dim):
        raise ValueError(f"key and value must be [T, Hkv, D] matching the cache's [.., .., {key_cache.shape[2]}, "
                         f"{cache_head_dim}], got {tuple(key.shape)} and {tuple(value.shape)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must have a contiguous last dim")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [T] = [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        BLOCK_SIZE=key_cache.shape[1], NUM_KV_HEADS=num_kv_heads,
        NUM_KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        KV_INT8=key_cache.dtype == torch.int8, KV_FP8=key_cache.dtype == torch.float8_e4m3fn,
        num_warps=WRITE_NUM_WARPS,
    )


# --------------------------------------------------------------------------------------------------
# Decode: one query token per request
# --------------------------------------------------------------------------------------------------


@triton.jit
def _softcap(x, cap_log2):
    """Gemma 2's cap * tanh(scale * s / cap), in the kernels' log2 domain: x = scale * s / cap, so this is
    cap * log2(e) * tanh(x), with tanh(x) = 1 - 2 / (exp(2x) + 1) (exp overflowing to inf gives 1, as it should)."""
    return cap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))


def _score_scales(scale: float, logit_softcap: float | None) -> tuple[float, float]:
    """(qk_scale, softcap_log2) for the kernels: see _softcap."""
    if logit_softcap is None:
        return scale * _LOG2_E, 0.0
    if not logit_softcap > 0:
        raise ValueError(f"attention logit soft-capping must be a positive number, got {logit_softcap}")
    return scale / logit_softcap, logit_softcap * _LOG2_E


@triton.jit
def _tile_scores(q, key_cache_ptr, kv_offs, key_mask, dims, dim_mask, qk_scale, softcap_log2,
                 HEAD_DIM: tl.constexpr, KV_INT8: tl.constexpr, SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """The scores [rows, BLOCK_N] of q [rows, D] against the key tile at kv_offs [BLOCK_N], in the kernels' log2
    domain (soft-capped where SOFTCAP); masked keys are left to the caller."""
    k = _load_kv(key_cache_ptr + kv_offs[None, :] + dims[:, None],  # [D, BLOCK_N]
                 key_mask[None, :] & dim_mask[:, None], KV_INT8)
    s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * qk_scale
    if KV_INT8:  # a key's codes times its row's scale
        s = s * _row_scales(key_cache_ptr, kv_offs, key_mask, HEAD_DIM)[None, :]
    if SOFTCAP:
        s = _softcap(s, softcap_log2)
    return s


@triton.jit
def _tile_values(acc, p, value_cache_ptr, kv_offs, key_mask, dims, dim_mask, HEAD_DIM: tl.constexpr,
                 KV_INT8: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + p [rows, BLOCK_N] times the value tile at kv_offs."""
    v = _load_kv(value_cache_ptr + kv_offs[:, None] + dims[None, :],  # [BLOCK_N, D]
                 key_mask[:, None] & dim_mask[None, :], KV_INT8)
    if KV_INT8:  # a value's codes times its row's scale, folded into its probabilities
        p = p * _row_scales(value_cache_ptr, kv_offs, key_mask, HEAD_DIM)[None, :]
    return acc + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)


@triton.jit
def _decode_kernel(
    out_ptr,  # [B, Hq, D]
    query_ptr,  # [B, Hq, D]
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, Hkv, D (+ 2 for int8)]
    block_table_ptr,  # [B, max_blocks] int32/int64
    seq_lens_ptr,  # [B]
    partial_out_ptr,  # [B, Hq, NUM_SPLITS, D] fp32, only when NUM_SPLITS > 1
    partial_lse_ptr,  # [B, Hq, NUM_SPLITS] fp32 (log2 domain), only when NUM_SPLITS > 1
    qk_scale,  # softmax scale * log2(e): the kernel works in exp2 (scale / cap where SOFTCAP)
    softcap_log2,  # logit soft-cap * log2(e), read where SOFTCAP
    stride_out_token, stride_out_head, stride_query_token, stride_query_head,
    stride_cache_block, stride_cache_pos, stride_cache_head,
    stride_table_row, stride_table_col,
    stride_partial_token, stride_partial_head, stride_partial_split,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_INT8: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)

    rows = tl.arange(0, GROUP_PAD)  # the query heads that share this kv head, padded for tl.dot
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q = tl.load(query_ptr + req * stride_query_token + heads[:, None] * stride_query_head + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(DOT_DTYPE)

    # The query sits at position seq_len - 1; it attends keys [lo, hi). A split takes a run of tiles.
    lo = 0
    if SLIDING_WINDOW > 0:
        lo = tl.maximum(seq_len - SLIDING_WINDOW, 0)
    hi = seq_len
    if NUM_SPLITS > 1:
        tiles_per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), NUM_SPLITS)
        lo = lo + split * tiles_per_split * BLOCK_N
        hi = tl.minimum(lo + tiles_per_split * BLOCK_N, hi)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table_row = block_table_ptr + req * stride_table_row
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n  # [BLOCK_N] key positions
        key_mask = pos < hi
        block = tl.load(table_row + (pos // BLOCK_SIZE) * stride_table_col, mask=key_mask, other=0).to(tl.int64)
        kv_offs = block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_pos + kv_head * stride_cache_head
        s = _tile_scores(q, key_cache_ptr, kv_offs, key_mask, dims, dim_mask, qk_scale, softcap_log2,  # [GROUP_PAD, N]
                         HEAD_DIM, KV_INT8, SOFTCAP, DOT_DTYPE, DOT_PRECISION)
        s = tl.where(key_mask[None, :], s, float("-inf"))
        # Every tile holds a key for every row (the mask is per key), so m_new is finite from the first.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _tile_values(acc * alpha[:, None], p, value_cache_ptr, kv_offs, key_mask, dims, dim_mask, HEAD_DIM,
                           KV_INT8, DOT_DTYPE, DOT_PRECISION)
        m_i = m_new

    # An empty range (seq_len 0: a padded CUDA-graph row, or a split past the context) gives zeros.
    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    mask = row_mask[:, None] & dim_mask[None, :]
    if NUM_SPLITS > 1:
        partial = req * stride_partial_token + heads * stride_partial_head + split * stride_partial_split
        tl.store(partial_out_ptr + partial[:, None] + dims[None, :], result, mask=mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + partial // HEAD_DIM, lse, mask=row_mask)
    else:
        tl.store(out_ptr + req * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_combine_kernel(
    out_ptr,  # [B, Hq, D]
    partial_out_ptr,  # [B, Hq, NUM_SPLITS, D] fp32
    partial_lse_ptr,  # [B, Hq, NUM_SPLITS] fp32
    stride_out_token, stride_out_head,
    stride_partial_token, stride_partial_head, stride_partial_split,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    partial = req * stride_partial_token + head * stride_partial_head + splits * stride_partial_split
    lse = tl.load(partial_lse_ptr + partial // HEAD_DIM)  # [NUM_SPLITS], -inf where a split saw no key
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    weight = tl.exp2(lse - m)
    o = tl.load(partial_out_ptr + partial[:, None] + dims[None, :], mask=dim_mask[None, :], other=0.0)
    total = tl.sum(weight, 0)
    result = tl.sum(weight[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + req * stride_out_token + head * stride_out_head + dims,
             result.to(out_ptr.dtype.element_ty), mask=dim_mask)


def _decode_num_splits(num_programs: int, device: torch.device) -> int:
    """Split the context when (request, kv head) programs are too few to fill the GPU's SMs."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return 1
    num_sms = _num_sms(device)
    if num_programs >= num_sms:
        return 1
    return min(DECODE_MAX_SPLITS, triton.next_power_of_2(triton.cdiv(num_sms, num_programs)))


def decode_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, sliding_window: int,
                     *, num_splits: int | None = None, logit_softcap: float | None = None) -> None:
    """Attention of one new token per request over its whole cached context, written into out.

    out, query: [B, Hq, D] (any token/head strides, contiguous last dim). key_cache, value_cache:
    [num_blocks, block_size, Hkv, D]. block_table: [B, max_blocks] int32/int64. seq_lens: [B], the
    context length including the new token; 0 marks a padded row, which gets zeros.
    sliding_window: 0 for none, else the query at position q attends keys (q - sliding_window, q].
    num_splits: how many pieces each context is split into (a power of two); None picks from the
    batch size and the SM count. The grid depends only on B, Hkv and num_splits, never on seq_lens.
    logit_softcap: None, or Gemma 2's cap (scores become cap * tanh(scores / cap) before the softmax).
    """
    group = _check_attention_args(out, query, key_cache, value_cache, block_table, seq_lens)
    num_reqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if block_table.shape[0] != num_reqs:
        raise ValueError(f"decode_attention takes one query token per request: query has {num_reqs} tokens, "
                         f"block_table {block_table.shape[0]} rows")
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be 0 (none) or positive, got {sliding_window}")
    qk_scale, softcap_log2 = _score_scales(scale, logit_softcap)
    if num_reqs == 0:
        return
    if num_splits is None:
        num_splits = _decode_num_splits(num_reqs * num_kv_heads, query.device)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    dot_dtype, dot_precision = _dot_config(query)
    if num_splits > 1:
        partial_out = torch.empty(num_reqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                                  device=query.device)
        partial_lse = torch.empty(num_reqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        partial_out, partial_lse = out, out  # unused
    # partial_lse shares partial_out's index with the head_dim stride divided out.
    partial_strides = (num_heads * num_splits * head_dim, num_splits * head_dim, head_dim)
    _decode_kernel[(num_reqs, num_kv_heads, num_splits)](
        out, query, key_cache, value_cache, block_table, seq_lens, partial_out, partial_lse,
        qk_scale, softcap_log2,
        out.stride(0), out.stride(1), query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_table.stride(0), block_table.stride(1),
        *partial_strides,
        BLOCK_SIZE=key_cache.shape[1], GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=_head_dim_pad(head_dim), BLOCK_N=DECODE_BLOCK_N,
        SLIDING_WINDOW=sliding_window, NUM_SPLITS=num_splits, SOFTCAP=logit_softcap is not None,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision, KV_INT8=key_cache.dtype == torch.int8,
        num_warps=DECODE_NUM_WARPS, num_stages=DECODE_NUM_STAGES,
    )
    if num_splits > 1:
        _decode_combine_kernel[(num_reqs, num_heads)](
            out, partial_out, partial_lse, out.stride(0), out.stride(1), *partial_strides,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=_head_dim_pad(head_dim), NUM_SPLITS=num_splits,
            num_warps=1,
        )


# --------------------------------------------------------------------------------------------------
# Prefill: variable-length chunks, causal
# --------------------------------------------------------------------------------------------------


@triton.jit
def _prefill_kernel(
    out_ptr,  # [T, Hq, D]
    query_ptr,  # [T, Hq, D]
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, Hkv, D (+ 2 for int8)]
    block_table_ptr,  # [B, max_blocks] int32/int64
    seq_lens_ptr,  # [B]
    query_start_loc_ptr,  # [B + 1]: request i owns tokens [query_start_loc[i], query_start_loc[i + 1])
    qk_scale,  # softmax scale * log2(e): the kernel works in exp2 (scale / cap where SOFTCAP)
    softcap_log2,  # logit soft-cap * log2(e), read where SOFTCAP
    stride_out_token, stride_out_head, stride_query_token, stride_query_head,
    stride_cache_block, stride_cache_pos, stride_cache_head,
    stride_table_row, stride_table_col,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
    KV_INT8: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + req).to(tl.int32)
    query_len = tl.load(query_start_loc_ptr + req + 1).to(tl.int32) - query_start
    if tile * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    context_len = seq_len - query_len  # positions cached before this chunk

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_mask = rows < query_len
    dim_mask = dims < HEAD_DIM
    q_pos = context_len + rows  # [BLOCK_M]; rows past the chunk attend all keys and are not stored
    tokens = (query_start + rows).to(tl.int64)
    q = tl.load(query_ptr + tokens[:, None] * stride_query_token + head * stride_query_head + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(DOT_DTYPE)

    # Keys past the tile's last query are above the diagonal for every row: the loop stops there.
    hi = tl.minimum(context_len + (tile + 1) * BLOCK_M, seq_len)
    lo = 0
    if SLIDING_WINDOW > 0:
        lo = tl.maximum(context_len + tile * BLOCK_M - SLIDING_WINDOW + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table_row = block_table_ptr + req * stride_table_row
    kv_head = head // GROUP
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n  # [BLOCK_N] key positions
        key_mask = pos < hi
        block = tl.load(table_row + (pos // BLOCK_SIZE) * stride_table_col, mask=key_mask, other=0).to(tl.int64)
        kv_offs = block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_pos + kv_head * stride_cache_head
        s = _tile_scores(q, key_cache_ptr, kv_offs, key_mask, dims, dim_mask, qk_scale, softcap_log2,  # [BLOCK_M, N]
                         HEAD_DIM, KV_INT8, SOFTCAP, DOT_DTYPE, DOT_PRECISION)
        mask = key_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            mask &= pos[None, :] > q_pos[:, None] - SLIDING_WINDOW
        s = tl.where(mask, s, float("-inf"))
        # A row may see no key in a tile (the diagonal, a window): keep its max finite for exp2.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _tile_values(acc * alpha[:, None], p, value_cache_ptr, kv_offs, key_mask, dims, dim_mask, HEAD_DIM,
                           KV_INT8, DOT_DTYPE, DOT_PRECISION)
        m_i = m_new

    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_out_token + head * stride_out_head + dims[None, :],
             result.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def prefill_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      max_query_len: int, scale: float, sliding_window: int,
                      logit_softcap: float | None = None) -> None:
    """Causal attention of variable-length chunks, all requests in one launch, written into out.

    out, query: [T, Hq, D] (any token/head strides, contiguous last dim). key_cache, value_cache:
    [num_blocks, block_size, Hkv, D], already holding this step's keys and values. block_table:
    [B, max_blocks] int32/int64. seq_lens: [B], context length including the chunk.
    query_start_loc: [B + 1] int on the device; request i owns query tokens
    [query_start_loc[i], query_start_loc[i + 1]), the last positions of its sequence. The offsets are
    absolute token indices into query, so a slice of a larger batch's query_start_loc works as is.
    max_query_len: host int, the longest chunk (sizes the grid). sliding_window: 0 for none.
    logit_softcap: None, or Gemma 2's cap (as in decode_attention).
    """
    group = _check_attention_args(out, query, key_cache, value_cache, block_table, seq_lens)
    num_reqs = block_table.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[2]
    if query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(f"query_start_loc must be [B + 1] = [{num_reqs + 1}], got {tuple(query_start_loc.shape)}")
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be 0 (none) or positive, got {sliding_window}")
    qk_scale, softcap_log2 = _score_scales(scale, logit_softcap)
    if num_reqs == 0 or max_query_len <= 0:
        return
    dot_dtype, dot_precision = _dot_config(query)
    grid = (num_reqs, num_heads, triton.cdiv(max_query_len, PREFILL_BLOCK_M))
    _prefill_kernel[grid](
        out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        qk_scale, softcap_log2,
        out.stride(0), out.stride(1), query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_table.stride(0), block_table.stride(1),
        BLOCK_SIZE=key_cache.shape[1], GROUP=group,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=_head_dim_pad(head_dim),
        BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N, SLIDING_WINDOW=sliding_window,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision, SOFTCAP=logit_softcap is not None,
        KV_INT8=key_cache.dtype == torch.int8, num_warps=PREFILL_NUM_WARPS, num_stages=PREFILL_NUM_STAGES,
    )


def paged_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    num_decodes: int, max_query_len: int, scale: float, sliding_window: int,
                    logit_softcap: float | None = None) -> None:
    """Attention for a whole flat batch: num_decodes one-token requests first, then prefill chunks.

    out, query: [T, Hq, D]; block_table: [B, max_blocks]; seq_lens: [B]; query_start_loc: [B + 1] on the
    device; max_query_len: host int over the batch. The decodes take decode_attention, the rest
    prefill_attention, both on views of the same tensors (no copies).
    """
    num_reqs = block_table.shape[0]
    if not 0 <= num_decodes <= num_reqs:
        raise ValueError(f"num_decodes must be in [0, {num_reqs}], got {num_decodes}")
    if num_decodes:
        decode_attention(out[:num_decodes], query[:num_decodes], key_cache, value_cache,
                         block_table[:num_decodes], seq_lens[:num_decodes], scale, sliding_window,
                         logit_softcap=logit_softcap)
    if num_decodes < num_reqs:
        # query_start_loc holds absolute offsets, so the prefills index the full query and out.
        prefill_attention(out, query, key_cache, value_cache, block_table[num_decodes:], seq_lens[num_decodes:],
                          query_start_loc[num_decodes:], max_query_len, scale, sliding_window,
                          logit_softcap=logit_softcap)

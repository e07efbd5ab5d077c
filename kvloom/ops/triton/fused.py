"""Fused RMSNorm, residual-add RMSNorm, rotary embedding and SiLU-and-mul for CUDA, in Triton.

The same ops as the C++ CPU ones in kvloom/ops/csrc/fused_ops.cpp (torch.ops.kvloom.*), with the
same signatures: outputs are written into tensors the caller passes, and nothing is returned. Each is a
single launch with no host sync, so all of them can be captured in a CUDA graph. Everything is computed
in fp32 and rounded to the tensor's dtype where the plain-torch references in kvloom/ops/reference.py round.

Rows are one program each (norms, rotary) or a tile of one row (silu_and_mul); widths that are not a
power of two (SmolLM2's 576 and 1536) are a power-of-two block with the tail masked off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# One program holds a whole row for the norms, in registers: at 16 warps, 16384 values are 32 a thread (64
# registers with the weight's); wider rows would spill. 16384 is the widest hidden size of a current model.
MAX_NORM_BLOCK = 16384
# Threads per row: 256 values per warp is 8 per thread, one 16-byte load in bf16, so H = 2048 takes 8
# warps; 16 warps caps it (H = 8192 holds 16 values a thread, still well within registers).
NORM_VALUES_PER_WARP = 256
MAX_NORM_WARPS = 16
# silu_and_mul is elementwise: a row is cut into tiles of 1024 outputs (8 per thread at 4 warps), so
# I = 8192 gives 8 programs a row, and T = 8192 rows gives 65536 programs, enough to fill an H100.
ACT_BLOCK = 1024
ACT_WARPS = 4
# Rotary: a program rotates up to 1024 pairs (a block of one token's heads) with 4 warps: at D = 64 (32
# pairs a head) that is 32 heads, so Llama-1B's 32 query + 8 key heads take 2 programs a token.
ROTARY_PAIRS_PER_PROGRAM = 1024
ROTARY_WARPS = 4


def _check_rows(name: str, t: torch.Tensor, what: str) -> None:
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{name}: {what} must be 2-D [T, H] with a contiguous last dim, "
                         f"got shape {tuple(t.shape)} and strides {t.stride()}")


def _norm_launch(name: str, hidden: int, weight: torch.Tensor) -> tuple[int, int]:
    """(BLOCK, num_warps) for a norm over rows of `hidden` values."""
    if weight.shape != (hidden,) or (hidden > 1 and weight.stride(0) != 1):
        raise ValueError(f"{name}: weight must be contiguous [{hidden}], got shape {tuple(weight.shape)} "
                         f"and strides {weight.stride()}")
    block = triton.next_power_of_2(hidden)
    if block > MAX_NORM_BLOCK:
        raise ValueError(f"{name}: hidden size {hidden} is wider than the {MAX_NORM_BLOCK} supported")
    return block, max(1, min(MAX_NORM_WARPS, block // NORM_VALUES_PER_WARP))


@triton.jit
def _rms_norm_kernel(out_ptr, x_ptr, weight_ptr, out_row_stride, x_row_stride, hidden, eps,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    # As HF (and rms_norm_reference): the normalized value is rounded to x's dtype before the weight
    # multiply, whose product is rounded to the output's dtype.
    normed = (x * scale).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, x_row_stride, residual_row_stride, hidden, eps,
                               BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x_row = x_ptr + row * x_row_stride + cols
    residual_row = residual_ptr + row * residual_row_stride + cols
    x = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_row, mask=mask, other=0.0).to(tl.float32)
    # Rounded once to the dtype, as torch's `x + residual` rounds; the norm is of the rounded sum.
    total = (x + residual).to(residual_ptr.dtype.element_ty)
    tl.store(residual_row, total, mask=mask)
    total = total.to(tl.float32)
    scale = tl.rsqrt(tl.sum(total * total, axis=0) / hidden + eps)
    normed = (total * scale).to(residual_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_row, (weight * normed).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(x_ptr, positions_ptr, cos_ptr, sin_ptr, token_stride, head_stride, cache_stride, heads, half,
                   BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head_ids = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + position * cache_stride + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + position * cache_stride + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    # [BLOCK_HEADS, BLOCK_HALF] pointers to x1, the first half of each head; x2 is `half` further on.
    first = x_ptr + token * token_stride + head_ids[:, None].to(tl.int64) * head_stride + cols[None, :]
    mask = (head_ids[:, None] < heads) & col_mask[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + half, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, out_row_stride, x_row_stride, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate_row = x_ptr + row * x_row_stride + cols
    gate = tl.load(gate_row, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_row + inner, mask=mask, other=0.0).to(tl.float32)
    # silu(g) = g / (1 + exp(-g)): for g below about -88, exp overflows to inf and the result is -0, as in torch.
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """out = weight * x / sqrt(mean(x^2) + eps), row by row.

    out, x: [T, H] (rows may be strided; the last dim contiguous); weight: [H].
    """
    _check_rows("rms_norm", x, "x")
    _check_rows("rms_norm", out, "out")
    tokens, hidden = x.shape
    if out.shape != x.shape:
        raise ValueError(f"rms_norm: out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")
    block, num_warps = _norm_launch("rms_norm", hidden, weight)
    if tokens == 0:
        return
    _rms_norm_kernel[(tokens,)](out, x, weight, out.stride(0), x.stride(0), hidden, eps,
                                BLOCK=block, num_warps=num_warps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual <- x + residual; x <- weight * rms_norm(residual).

    x, residual: [T, H] (rows may be strided; the last dim contiguous); weight: [H].
    """
    _check_rows("fused_add_rms_norm", x, "x")
    _check_rows("fused_add_rms_norm", residual, "residual")
    tokens, hidden = x.shape
    if residual.shape != x.shape:
        raise ValueError(f"fused_add_rms_norm: residual must have x's shape {tuple(x.shape)}, "
                         f"got {tuple(residual.shape)}")
    block, num_warps = _norm_launch("fused_add_rms_norm", hidden, weight)
    if tokens == 0:
        return
    _fused_add_rms_norm_kernel[(tokens,)](x, residual, weight, x.stride(0), residual.stride(0), hidden, eps,
                                          BLOCK=block, num_warps=num_warps)


def rotary_embedding(x: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                     sin_cache: torch.Tensor) -> None:
    """Rotate-half rotary embedding, in place, computed in fp32.

    x: [T, heads, D] (any token and head strides, e.g. the query and key heads of a fused qkv; D
    contiguous); positions: [T] integer; cos_cache, sin_cache: [max_position, D // 2] (rows contiguous).
    Each head [x1 | x2] becomes [x1 * cos - x2 * sin | x2 * cos + x1 * sin] at its token's position.
    Positions past the cache are not caught (that check would sync with the host): they read out of bounds.
    """
    if x.dim() != 3 or x.stride(2) != 1 or x.shape[2] % 2:
        raise ValueError(f"rotary_embedding: x must be [T, heads, D] with D even and contiguous, "
                         f"got shape {tuple(x.shape)} and strides {x.stride()}")
    tokens, heads, dim = x.shape
    half = dim // 2
    if positions.shape != (tokens,) or (tokens > 1 and positions.stride(0) != 1):
        raise ValueError(f"rotary_embedding: positions must be contiguous [{tokens}], got shape "
                         f"{tuple(positions.shape)} and strides {positions.stride()}")
    for name, cache in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if cache.dim() != 2 or cache.shape[1] != half or cache.stride(1) != 1:
            raise ValueError(f"rotary_embedding: {name} must be [max_position, {half}] with rows contiguous, "
                             f"got shape {tuple(cache.shape)} and strides {cache.stride()}")
    if cos_cache.stride(0) != sin_cache.stride(0):
        raise ValueError("rotary_embedding: cos_cache and sin_cache must have the same row stride")
    if tokens == 0 or heads == 0:
        return
    block_half = triton.next_power_of_2(half)
    block_heads = min(triton.next_power_of_2(heads), max(1, ROTARY_PAIRS_PER_PROGRAM // block_half))
    grid = (tokens, triton.cdiv(heads, block_heads))
    _rotary_kernel[grid](x, positions, cos_cache, sin_cache, x.stride(0), x.stride(1), cos_cache.stride(0), heads,
                         half, BLOCK_HEADS=block_heads, BLOCK_HALF=block_half, num_warps=ROTARY_WARPS)


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """out = silu(gate) * up, computed in fp32.

    x: [T, 2 * I] laid out as [gate | up] (rows may be strided; the last dim contiguous); out: [T, I].
    """
    _check_rows("silu_and_mul", x, "x")
    _check_rows("silu_and_mul", out, "out")
    tokens, width = x.shape
    if width % 2 or out.shape != (tokens, width // 2):
        raise ValueError(f"silu_and_mul: want x [T, 2 * I] and out [T, I], got x {tuple(x.shape)} "
                         f"and out {tuple(out.shape)}")
    inner = width // 2
    if tokens == 0 or inner == 0:
        return
    block = min(ACT_BLOCK, triton.next_power_of_2(inner))
    grid = (tokens, triton.cdiv(inner, block))
    _silu_and_mul_kernel[grid](out, x, out.stride(0), x.stride(0), inner, BLOCK=block, num_warps=ACT_WARPS)

"""Code-block GEMM for CUDA, in Triton: y = x @ W^T (+ bias) for a weight kept as GGUF code blocks
(kvloom/ops/q4.py), W[n, k] = q[n, k] d[n, k / 32] + m[n, k / 32], dequantized in registers.

Each program computes a [BLOCK_M, BLOCK_N] tile of y, one block of 32 k per step: it loads 16 bytes of each of
BLOCK_N columns (``pack_q4_columns``: byte i of block b holds k = 32 b + i in its low nibble and 32 b + 16 + i
in its high one, GGUF's own order), splits the nibbles, widens them with the block's d and m to x's dtype and
takes two ``tl.dot``s of 16. 5- and 6-bit codes (Q5_1, Q5_K, Q6_K) are packed one a byte instead
(``pack_code_columns``, two loads of 16 bytes per block, ``BYTE_CODES``). Q6_K's scale and offset per 16 k
(``GROUP16``: d and m [K / 16, N]) fit the same two halves of a block, each widened with its own pair. The weight
crosses memory at 4 bits (plus its fp32 d and m per block); the activations stay as they are (no int8
quantization: on the GPU the product is the dequantized weight's).
Sums are fp32 ("ieee" for fp32 activations, not TF32); bias added once; the tile rounded once to x's dtype.
Like the other kernels here it takes a preallocated output and never syncs the host (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 32
BLOCK_N = 64
NUM_WARPS = 4


def _block_m(rows: int) -> int:
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def pack_q4_columns(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] -> uint8 [K / 2, N]: row 16 b + i holds (codes[:, 32 b + i], codes[:, 32 b + 16 + i])
    as (low, high) nibbles; each row a contiguous run of the N columns."""
    n, k = codes.shape
    blocks = codes.view(n, k // BLOCK, 2, BLOCK // 2)
    packed = blocks[:, :, 0] | (blocks[:, :, 1] << 4)  # [N, blocks, 16]
    return packed.reshape(n, k // 2).t().contiguous()


def pack_code_columns(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (any up to 8 bits) -> uint8 [K, N], one a byte: row k a contiguous run of the N
    columns."""
    return codes.t().contiguous()


@triton.jit
def _q4_linear_kernel(y_ptr, x_ptr, w_ptr, d_ptr, m_ptr, bias_ptr, M, N, K, x_row_stride, y_row_stride,
                      HAS_BIAS: tl.constexpr, IS_FP32: tl.constexpr, BYTE_CODES: tl.constexpr,
                      GROUP16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, 16)
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * x_row_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, K // 32):
        k_low = b * 32 + half
        x_low = tl.load(x_rows + k_low[None, :], mask=row_mask[:, None], other=0.0)
        x_high = tl.load(x_rows + (k_low + 16)[None, :], mask=row_mask[:, None], other=0.0)
        if BYTE_CODES:  # one code a byte: rows 32 b + i and 32 b + 16 + i
            q_low = tl.load(w_ptr + k_low[:, None].to(tl.int64) * N + cols[None, :], mask=col_mask[None, :],
                            other=0)  # [16, BLOCK_N]
            q_high = tl.load(w_ptr + (k_low + 16)[:, None].to(tl.int64) * N + cols[None, :],
                             mask=col_mask[None, :], other=0)
        else:
            packed = tl.load(w_ptr + (b * 16 + half)[:, None].to(tl.int64) * N + cols[None, :],
                             mask=col_mask[None, :], other=0)  # [16, BLOCK_N]
            q_low = packed & 0x0F
            q_high = packed >> 4
        if GROUP16:  # rows 2 b (k 32 b .. + 15) and 2 b + 1 (the block's second half) of d and m
            d_low = tl.load(d_ptr + (2 * b) * N + cols, mask=col_mask, other=0.0)[None, :]
            m_low = tl.load(m_ptr + (2 * b) * N + cols, mask=col_mask, other=0.0)[None, :]
            d_high = tl.load(d_ptr + (2 * b + 1) * N + cols, mask=col_mask, other=0.0)[None, :]
            m_high = tl.load(m_ptr + (2 * b + 1) * N + cols, mask=col_mask, other=0.0)[None, :]
        else:
            d_low = tl.load(d_ptr + b * N + cols, mask=col_mask, other=0.0)[None, :]
            m_low = tl.load(m_ptr + b * N + cols, mask=col_mask, other=0.0)[None, :]
            d_high = d_low
            m_high = m_low
        w_low = q_low.to(tl.float32) * d_low + m_low
        w_high = q_high.to(tl.float32) * d_high + m_high
        if IS_FP32:
            acc = tl.dot(x_low, w_low, acc, input_precision="ieee")
            acc = tl.dot(x_high, w_high, acc, input_precision="ieee")
        else:
            acc = tl.dot(x_low, w_low.to(x_low.dtype), acc)
            acc = tl.dot(x_high, w_high.to(x_high.dtype), acc)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_mask, other=0.0)[None, :]
    y = y_ptr + rows[:, None].to(tl.int64) * y_row_stride + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def q4_linear(out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
              bias: torch.Tensor | None) -> None:
    """out [M, N] = x [M, K] @ W^T (+ bias [N]) in x's dtype; packed: pack_q4_columns' uint8 [K / 2, N], or
    pack_code_columns' [K, N] (one code a byte); d, m: fp32 [K / 32, N] (each block's scale and offset per
    column), or [K / 16, N] (per 16 k: Q6_K) with one code a byte. x and out: the last dim contiguous."""
    if x.dim() != 2 or out.dim() != 2 or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"q4_linear: x [M, K] and out [M, N] must be 2-D with a contiguous last dim, got x "
                         f"{tuple(x.shape)} and out {tuple(out.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or out.dtype != x.dtype:
        raise ValueError(f"q4_linear: x must be float32, float16 or bfloat16 and out of the same dtype, got "
                         f"{x.dtype} and {out.dtype}")
    rows, k = x.shape
    n = out.shape[1]
    byte_codes = tuple(packed.shape) == (k, n)
    if k % BLOCK or packed.dtype != torch.uint8 or packed.shape not in ((k // 2, n), (k, n)) \
            or not packed.is_contiguous():
        raise ValueError(f"q4_linear: packed must be a contiguous uint8 [K / 2, N] = [{k // 2}, {n}] (two codes a "
                         f"byte) or [K, N] = [{k}, {n}] (one) with K a multiple of {BLOCK}, got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    group16 = byte_codes and d.dim() == 2 and d.shape[0] == k // 16 and k > 0
    groups = k // 16 if group16 else k // BLOCK
    for name, t in (("d", d), ("m", m)):
        if t.dtype != torch.float32 or t.shape != (groups, n) or not t.is_contiguous():
            raise ValueError(f"q4_linear: {name} must be a contiguous float32 [K / 32, N] = [{k // BLOCK}, {n}] (or "
                             f"[K / 16, N] = [{k // 16}, {n}] with one code a byte), got {t.dtype} {tuple(t.shape)}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"q4_linear: bias must be a contiguous float32 [{n}], got {bias.dtype} {tuple(bias.shape)}")
    if out.shape[0] != rows:
        raise ValueError(f"q4_linear: out has {out.shape[0]} rows, x has {rows}")
    if rows == 0 or n == 0:
        return
    block_m = _block_m(rows)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, BLOCK_N))
    _q4_linear_kernel[grid](out, x, packed, d, m, d if bias is None else bias, rows, n, k, x.stride(0),
                            out.stride(0), HAS_BIAS=bias is not None, IS_FP32=x.dtype == torch.float32,
                            BYTE_CODES=byte_codes, GROUP16=group16, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
                            num_warps=NUM_WARPS)

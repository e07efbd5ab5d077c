"""Weight-only int8 GEMM for CUDA, in Triton: y = (x @ q^T) * scale (+ bias), as int8_linear_reference.

Each program computes a [BLOCK_M, BLOCK_N] tile of y: it walks K in BLOCK_K steps, loading an x tile in
x's dtype and an int8 weight tile that it widens to x's dtype (exact: |q| <= 127) right before
``tl.dot``, so the weight crosses memory as int8 (half of bf16's bytes). Sums are fp32; the
per-channel scale and the bias are applied once at the end and the tile is rounded once to x's dtype.
fp32 activations take the exact ("ieee") fp32 dot, not TF32, to stay on the reference's sums.

The weight is stored transposed, [K, N] (``Int8Linear`` in cuda.py does that once), so a tile's rows
are contiguous runs of N. Like the other kernels here it takes a preallocated output and never syncs
the host, so a decode step that calls it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 4


def _block_m(rows: int) -> int:
    """Rows per tile: tl.dot wants at least 16; decode batches are small, prefill chunks large."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


@triton.jit
def _int8_linear_kernel(y_ptr, x_ptr, w_ptr, scale_ptr, bias_ptr, M, N, K, x_row_stride, y_row_stride,
                        HAS_BIAS: tl.constexpr, IS_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * x_row_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_mask = k < K
        x = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        # [BLOCK_K, BLOCK_N] of the [K, N] weight: each row a contiguous run of columns.
        w = tl.load(w_ptr + k[:, None].to(tl.int64) * N + cols[None, :], mask=k_mask[:, None] & col_mask[None, :],
                    other=0)
        if IS_FP32:
            acc = tl.dot(x, w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    acc = acc * tl.load(scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_mask, other=0.0)[None, :]
    y = y_ptr + rows[:, None].to(tl.int64) * y_row_stride + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def int8_linear(out: torch.Tensor, x: torch.Tensor, weight_t: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None) -> None:
    """out [M, N] = (x [M, K] @ weight_t [K, N] int8) * scale [N] (+ bias [N]), in x's dtype.

    x and out: rows may be strided, the last dim contiguous; weight_t contiguous; scale and bias fp32.
    """
    if x.dim() != 2 or out.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1) or out.stride(1) != 1:
        raise ValueError(f"int8_linear: x [M, K] and out [M, N] must be 2-D with a contiguous last dim, got x "
                         f"{tuple(x.shape)} strides {x.stride()} and out {tuple(out.shape)} strides {out.stride()}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or out.dtype != x.dtype:
        raise ValueError(f"int8_linear: x must be float32, float16 or bfloat16 and out of the same dtype, got "
                         f"{x.dtype} and {out.dtype}")
    rows, k = x.shape
    n = out.shape[1]
    if weight_t.dtype != torch.int8 or weight_t.shape != (k, n) or not weight_t.is_contiguous():
        raise ValueError(f"int8_linear: weight_t must be a contiguous int8 [K, N] = [{k}, {n}], got "
                         f"{weight_t.dtype} {tuple(weight_t.shape)}")
    for name, t in (("scale", scale), ("bias", bias)):
        if t is not None and (t.dtype != torch.float32 or t.shape != (n,) or not t.is_contiguous()):
            raise ValueError(f"int8_linear: {name} must be a contiguous float32 [{n}], got {t.dtype} {tuple(t.shape)}")
    if out.shape[0] != rows:
        raise ValueError(f"int8_linear: out has {out.shape[0]} rows, x has {rows}")
    if rows == 0 or n == 0:
        return
    block_m = _block_m(rows)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, BLOCK_N))
    _int8_linear_kernel[grid](out, x, weight_t, scale, scale if bias is None else bias, rows, n, k, x.stride(0),
                              out.stride(0), HAS_BIAS=bias is not None, IS_FP32=x.dtype == torch.float32,
                              BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)

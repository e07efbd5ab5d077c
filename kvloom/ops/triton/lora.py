"""The LoRA delta on CUDA in Triton: BGMV (Punica's batched gather matrix-vector product), two launches.

    shrink: program (t, r-block):  v[t, r] = sum_k A[slot_t, r, k] x[t, k]       v: [T, R] fp32
    expand: program (t, n-block):  y[t, n] += sum_r B[slot_t, n, r] v[t, r]

Each program reads its token's slot and does nothing for -1 (the base model), so one launch serves a batch
mixing adapters and the base with no host sync (CUDA-graph safe). Products are sums of fp32 elementwise
products (not tl.dot): at decode sizes the kernel is bound by reading A and B, and this keeps the
interpreter's results exact (the tests run it under TRITON_INTERPRET=1 against ops/lora.py's reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 16    # rank rows a shrink program holds (a rank-16 shard in one)
BLOCK_K = 128   # input columns per shrink iteration
BLOCK_N = 64    # output columns per expand program


@triton.jit
def _shrink_kernel(v_ptr, x_ptr, a_ptr, slots_ptr, x_stride, a_slot_stride, a_row_stride, v_stride, K, R,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * x_stride + k, mask=k < K, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * a_slot_stride + r[:, None] * a_row_stride + k[None, :],
                    mask=(r[:, None] < R) & (k[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(v_ptr + t * v_stride + r, acc, mask=r < R)


@triton.jit
def _expand_kernel(y_ptr, v_ptr, b_ptr, slots_ptr, y_stride, v_stride, b_slot_stride, b_row_stride, N, R,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        v = tl.load(v_ptr + t * v_stride + r, mask=r < R, other=0.0)
        b = tl.load(b_ptr + slot * b_slot_stride + n[:, None] * b_row_stride + r[None, :],
                    mask=(n[:, None] < N) & (r[None, :] < R), other=0.0).to(tl.float32)
        acc += tl.sum(b * v[None, :], axis=1)
    y = tl.load(y_ptr + t * y_stride + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * y_stride + n, (y + acc).to(y_ptr.dtype.element_ty), mask=n < N)


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    token_slots: torch.Tensor) -> None:
    """y [T, out] += B[slot] A[slot] x for each token (kvloom/ops/lora.py's shapes); token_slots [T] int64."""
    tokens, in_features = x.shape
    _, rank, _ = lora_a.shape
    out_features = lora_b.shape[1]
    if tokens == 0:
        return
    for name, tensor in (("x", x), ("y", y), ("lora_a", lora_a), ("lora_b", lora_b)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"add_lora_triton: {name} needs a contiguous last dimension")
    shrunk = torch.empty(tokens, rank, dtype=torch.float32, device=x.device)
    _shrink_kernel[(tokens, triton.cdiv(rank, BLOCK_R))](
        shrunk, x, lora_a, token_slots, x.stride(0), lora_a.stride(0), lora_a.stride(1), shrunk.stride(0),
        in_features, rank, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K)
    _expand_kernel[(tokens, triton.cdiv(out_features, BLOCK_N))](
        y, shrunk, lora_b, token_slots, y.stride(0), shrunk.stride(0), lora_b.stride(0), lora_b.stride(1),
        out_features, rank, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R)

"""A mixture of experts' MLPs on CUDA, in Triton: one grouped GEMM launch per projection for every expert.

The T * k (token, expert) assignments are sorted by expert and each expert's run padded up to a multiple of
BLOCK_M (``align_by_expert``, torch ops with no host sync), so every BLOCK_M-row tile belongs to one expert:

    sorted_ids   [A + E * (BLOCK_M - 1)]  assignment index (t * k + j) of each sorted row; A (= T * k) pads
    block_expert [that / BLOCK_M]          the expert of each tile, -1 past the last one

A tile's program gathers its rows (the tokens' hidden states, or the assignments' activations), multiplies
them by its expert's weight tile by tile over K and writes each row back at its assignment index: each
expert's weights are read once per tile of its tokens, and no program loops over tokens. The sizes are
bounded without reading the counts back, so the launch needs no host sync (a CUDA graph can hold it).

    gate_up [A, 2I] = x[token] @ w13[e]^T          (grouped GEMM 1)
    act     [A, I]  = silu(gate) * up
    out     [A, H]  = weight * (act @ w2[e]^T)      (grouped GEMM 2, the routing weight on the way out)
    result  [T, H]  = out summed over each token's k assignments
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 32
NUM_WARPS = 4


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_ids, block_expert) as the module docstring lays them out."""
    flat = topk_ids.reshape(-1)
    assignments = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)  # [E] where each expert's padded run ends
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order]
    rank = torch.arange(assignments, device=flat.device) - (torch.cumsum(counts, 0) - counts)[experts_sorted]
    capacity = assignments + num_experts * (block_m - 1)
    capacity = (capacity + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((capacity,), assignments, dtype=torch.long, device=flat.device)
    sorted_ids[(padded_end - padded)[experts_sorted] + rank] = order
    block_start = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_start < padded_end[-1], block_expert, torch.full_like(block_expert, -1))
    return sorted_ids, block_expert


@triton.jit
def _grouped_gemm_kernel(c_ptr, a_ptr, b_ptr, sorted_ids_ptr, block_expert_ptr, weight_ptr, N, K,
                         num_assignments, a_row_stride, b_expert_stride, c_row_stride,
                         TOP_K: tl.constexpr, ROWS_BY_TOKEN: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         IS_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """c[assignment] = a[row] @ b[expert]^T for one [BLOCK_M, BLOCK_N] tile; b [E, N, K] contiguous."""
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    ids = tl.load(sorted_ids_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    ids = tl.where(expert >= 0, ids, num_assignments)  # a tile past the last expert's: all padding
    row_mask = ids < num_assignments
    a_rows = ids // TOP_K if ROWS_BY_TOKEN else ids
    a_rows = tl.where(row_mask, a_rows, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    b_base = b_ptr + tl.maximum(expert, 0).to(tl.int64) * b_expert_stride
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_mask = k < K
        a = tl.load(a_ptr + a_rows[:, None].to(tl.int64) * a_row_stride + k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        # [BLOCK_K, BLOCK_N] of b[expert]^T: b's rows are the output columns.
        b = tl.load(b_base + cols[None, :].to(tl.int64) * K + k[:, None], mask=k_mask[:, None] & col_mask[None, :],
                    other=0.0)
        if IS_FP32:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + ids, mask=row_mask, other=0.0)[:, None]
    c = c_ptr + tl.where(row_mask, ids, 0)[:, None].to(tl.int64) * c_row_stride + cols[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _grouped_gemm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, sorted_ids: torch.Tensor,
                  block_expert: torch.Tensor, weights: torch.Tensor, top_k: int, rows_by_token: bool,
                  mul_weight: bool) -> None:
    n, k = b.shape[1], b.shape[2]
    grid = (block_expert.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](out, a, b, sorted_ids, block_expert, weights, n, k, out.shape[0], a.stride(0),
                               b.stride(0), out.stride(0), TOP_K=top_k, ROWS_BY_TOKEN=rows_by_token,
                               MUL_WEIGHT=mul_weight, IS_FP32=a.dtype == torch.float32, BLOCK_M=BLOCK_M,
                               BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """As ops/reference.py fused_experts_reference: hidden [T, H], w13 [E, 2I, H], w2 [E, H, I],
    topk_weights [T, k], topk_ids [T, k] -> [T, H] in hidden's dtype (fp32 sums)."""
    if hidden.dim() != 2 or hidden.stride(1) != 1 or not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("fused_experts: hidden must be [T, H] with a contiguous last dim and w13, w2 contiguous")
    tokens, top_k = topk_ids.shape
    assignments = tokens * top_k
    sorted_ids, block_expert = align_by_expert(topk_ids, w13.shape[0])
    weights = topk_weights.reshape(-1).float().contiguous()
    gate_up = torch.empty(assignments, w13.shape[1], dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(gate_up, hidden, w13, sorted_ids, block_expert, weights, top_k, True, False)
    gate, up = gate_up.chunk(2, dim=-1)
    act = (F.silu(gate) * up).contiguous()
    out = torch.empty(assignments, w2.shape[1], dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(out, act, w2, sorted_ids, block_expert, weights, top_k, False, True)
    return out.view(tokens, top_k, -1).sum(dim=1)


class TritonExperts:
    """The experts' stacked weights (made contiguous once) for fused_experts: (hidden, topk_weights, topk_ids)
    -> [T, H]."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.w13, self.w2 = w13.contiguous(), w2.contiguous()

    def __call__(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(hidden, self.w13, self.w2, topk_weights, topk_ids)

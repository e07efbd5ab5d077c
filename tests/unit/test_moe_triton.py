"""The Triton grouped-GEMM experts (ops/triton/moe.py) against the plain-torch reference; on a machine
without CUDA in Triton's interpreter (TRITON_INTERPRET=1), so the shapes stay small."""

from __future__ import annotations

import os

import pytest
import torch

# Triton reads the variable when a kernel is decorated (tests/conftest.py may have set it already).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from kvloom.layers.moe import route  # noqa: E402
from kvloom.ops.reference import fused_experts_reference  # noqa: E402
from kvloom.ops.triton import moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_align_by_expert_gives_each_tile_one_expert_and_every_assignment_once() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 0]])
    sorted_ids, block_expert = moe.align_by_expert(ids, 4, block_m=4)
    assignments = ids.numel()
    real = sorted_ids[sorted_ids < assignments]
    assert sorted(real.tolist()) == list(range(assignments))
    for tile, expert in enumerate(block_expert.tolist()):
        rows = sorted_ids[tile * 4:(tile + 1) * 4]
        rows = rows[rows < assignments]
        if expert < 0:
            assert rows.numel() == 0
        else:
            assert (ids.reshape(-1)[rows] == expert).all() and rows.tolist() == sorted(rows.tolist())
    assert block_expert.tolist()[:3] == [0, 1, 2]  # expert 3 has no tokens and no tile


@pytest.mark.parametrize(("tokens", "experts", "top_k", "dtype"), [
    (1, 4, 2, torch.float32), (19, 8, 2, torch.float32), (7, 16, 3, torch.float32), (12, 6, 2, torch.float16),
    pytest.param(12, 6, 2, torch.bfloat16, marks=pytest.mark.skipif(
        DEVICE == "cpu", reason="Triton's interpreter (numpy, no bfloat16) gets bf16 tl.dot wrong; checked on CUDA"))])
def test_triton_fused_experts_equal_the_reference(tokens: int, experts: int, top_k: int, dtype: torch.dtype) -> None:
    """A decode, uneven groups past one tile, experts without tokens, hidden and intermediate sizes that are not
    multiples of the tiles; 16-bit floats within their rounding."""
    generator = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, 40, generator=generator).to(DEVICE, dtype)
    w13 = (torch.randn(experts, 2 * 36, 40, generator=generator) * 0.2).to(DEVICE, dtype)
    w2 = (torch.randn(experts, 40, 36, generator=generator) * 0.2).to(DEVICE, dtype)
    weights, ids = route(torch.randn(tokens, experts, generator=generator).to(DEVICE), top_k, renormalize=True)
    expected = fused_experts_reference(hidden.float(), w13.float(), w2.float(), weights, ids)
    got = moe.fused_experts(hidden, w13, w2, weights, ids)
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2 if dtype == torch.float16 else 3e-2
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)


def test_select_ops_on_cuda_runs_experts_in_triton() -> None:
    from kvloom.ops.table import _cuda_ops

    assert _cuda_ops().pack_experts is moe.TritonExperts

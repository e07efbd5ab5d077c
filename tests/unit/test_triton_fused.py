"""The Triton fused ops (kvloom/ops/triton/fused.py) against their plain-torch references.

On CUDA the kernels are compiled; without it they run in Triton's interpreter on CPU tensors
(TRITON_INTERPRET=1, set below if tests/conftest.py has not), so the shapes of the unmarked tests stay small;
the `gpu` tests take the models' real sizes.
"""

from __future__ import annotations

import os

import pytest
import torch

# Triton reads the variable when a kernel is decorated, so it is set before the kernels' module is
# imported (tests/conftest.py may have set it already).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvloom.ops.reference import apply_rotary_reference, rms_norm_reference  # noqa: E402
from kvloom.ops.reference import silu_and_mul as silu_and_mul_reference  # noqa: E402
from kvloom.ops.triton import fused  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_NAMES = ["fp32", "bf16", "fp16"]
EPS = 1e-5
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def tolerance(dtype: torch.dtype, ulps: int) -> dict[str, float]:
    """fp32: ~1e-5. bf16/fp16: about `ulps` units in the last place (rtol = ulps * eps allows `ulps` to
    2 * `ulps` of them, as the value sits high or low in its binade), plus a small atol for values near zero,
    where the kernel's fp32 rounding differences (FMA contraction, sum order) exceed the dtype's spacing."""
    if dtype == torch.float32:
        return dict(atol=1e-5, rtol=1e-5)
    return dict(atol=1e-5, rtol=ulps * torch.finfo(dtype).eps)


def sum_tolerance(dtype: torch.dtype) -> dict[str, float]:
    """For x + residual, which the kernel rounds to the dtype as torch does: exactly. But Triton's interpreter
    truncates fp32 -> bf16 where the GPU (cvt.rn) rounds to nearest even, so there a bf16 sum may be one ulp
    short; its fp16 conversions round as the GPU's do, so fp16 still pins the rounding on CPU."""
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        return dict(atol=0, rtol=torch.finfo(dtype).eps)
    return dict(atol=0, rtol=0)


def strided_rows(rows: int, width: int, dtype: torch.dtype, pad: int = 0, scale: float = 1.0) -> torch.Tensor:
    """[rows, width] random values whose rows sit `width + pad` apart in memory."""
    return (torch.randn(rows, width + pad, device=DEVICE) * scale).to(dtype)[:, :width]


def rms_norm_cases(dtype: torch.dtype, rows: int, hidden: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = strided_rows(rows, hidden, dtype, pad, scale=3.0)
    weight = (torch.randn(hidden, device=DEVICE) + 1.0).to(dtype)
    return x, weight


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES)
@pytest.mark.parametrize("rows, hidden, pad", [(0, 48, 0), (1, 576, 0), (5, 100, 0), (7, 96, 40), (3, 1, 0)])
def test_rms_norm_matches_reference(dtype: torch.dtype, rows: int, hidden: int, pad: int) -> None:
    """Non-power-of-2 widths, one row, no rows, and rows with a stride larger than their width."""
    torch.manual_seed(0)
    x, weight = rms_norm_cases(dtype, rows, hidden, pad)
    out = strided_rows(rows, hidden, dtype, pad=3).fill_(float("nan"))
    fused.rms_norm(out, x, weight, EPS)
    torch.testing.assert_close(out, rms_norm_reference(x, weight, EPS), **tolerance(dtype, 2))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES)
@pytest.mark.parametrize("rows, hidden, pad", [(0, 48, 0), (1, 576, 0), (6, 100, 0), (7, 96, 40)])
def test_fused_add_rms_norm_matches_reference_in_place(dtype: torch.dtype, rows: int, hidden: int, pad: int) -> None:
    """The residual becomes x + residual exactly as torch rounds it; x becomes the norm of that sum."""
    torch.manual_seed(0)
    x, weight = rms_norm_cases(dtype, rows, hidden, pad)
    residual = strided_rows(rows, hidden, dtype, pad=pad + 5, scale=3.0)
    expected_sum = x + residual
    fused.fused_add_rms_norm(x, residual, weight, EPS)
    torch.testing.assert_close(residual, expected_sum, **sum_tolerance(dtype))
    # The norm of the sum as stored: the same sum on a GPU (checked exactly above), but not always in the interpreter.
    torch.testing.assert_close(x, rms_norm_reference(residual, weight, EPS), **tolerance(dtype, 2))


def test_rms_norm_leaves_padding_between_rows_untouched() -> None:
    torch.manual_seed(0)
    storage = torch.randn(4, 80, device=DEVICE)
    before = storage.clone()
    out = storage[:, :50]
    fused.rms_norm(out, torch.randn(4, 50, device=DEVICE), torch.ones(50, device=DEVICE), EPS)
    assert torch.equal(storage[:, 50:], before[:, 50:])


def rotary_case(dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, head_dim: int, max_position: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused qkv [T, heads + 2 * kv_heads, D], positions [T], and cos and sin caches [max_position, D // 2]."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    angles = torch.outer(torch.arange(max_position, device=DEVICE, dtype=torch.float32), inv_freq)
    positions = torch.randint(0, max_position, (tokens,), device=DEVICE)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, device=DEVICE).to(dtype)
    return qkv, positions, angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES)
@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim", [(0, 3, 1, 64), (1, 3, 1, 64), (9, 9, 3, 64),
                                                                (5, 4, 2, 24), (4, 2, 1, 128)])
def test_rotary_embedding_matches_reference_on_a_slice_of_qkv(dtype: torch.dtype, tokens: int, heads: int,
                                                               kv_heads: int, head_dim: int) -> None:
    """Queries and keys rotate in place inside the fused qkv; the values next to them are left alone.
    Head dims whose half is not a power of 2 (24: halves of 12), and 9 + 3 heads (SmolLM2-135M)."""
    torch.manual_seed(0)
    qkv, positions, cos, sin = rotary_case(dtype, tokens, heads, kv_heads, head_dim, max_position=256)
    qk = qkv[:, :heads + kv_heads]
    expected = apply_rotary_reference(qk, cos[positions], sin[positions])
    values = qkv[:, heads + kv_heads:].clone()
    fused.rotary_embedding(qk, positions, cos, sin)
    torch.testing.assert_close(qkv[:, :heads + kv_heads], expected, **tolerance(dtype, 1))
    assert torch.equal(qkv[:, heads + kv_heads:], values)


def test_rotary_embedding_takes_each_tokens_own_position() -> None:
    """Positions out of order and repeated, at both ends of the cache."""
    torch.manual_seed(0)
    qkv, _, cos, sin = rotary_case(torch.float32, 6, 2, 1, 16, max_position=32)
    positions = torch.tensor([31, 0, 5, 5, 0, 31], device=DEVICE)
    expected = apply_rotary_reference(qkv, cos[positions], sin[positions])
    fused.rotary_embedding(qkv, positions, cos, sin)
    torch.testing.assert_close(qkv, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES)
@pytest.mark.parametrize("rows, inner, pad", [(0, 48, 0), (1, 1536, 0), (5, 100, 0), (3, 96, 24)])
def test_silu_and_mul_matches_reference(dtype: torch.dtype, rows: int, inner: int, pad: int) -> None:
    """Against the reference computed in fp32 and rounded once; 1536 spans two of the kernel's tiles."""
    torch.manual_seed(0)
    x = strided_rows(rows, 2 * inner, dtype, pad, scale=3.0)
    out = torch.full((rows, inner), float("nan"), device=DEVICE, dtype=dtype)
    fused.silu_and_mul(out, x)
    expected = silu_and_mul_reference(x.float()).to(dtype)
    torch.testing.assert_close(out, expected, **tolerance(dtype, 1))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # numpy, in the interpreter
def test_silu_and_mul_at_large_gates() -> None:
    """exp(-g) overflows or vanishes at the ends: silu(-100) is -0 (torch: a subnormal -4e-42), silu(100)
    is 100."""
    x = torch.tensor([[-100.0, -20.0, 0.0, 20.0, 100.0, 2.0, 2.0, 2.0, 2.0, 2.0]], device=DEVICE)
    out = torch.empty(1, 5, device=DEVICE)
    fused.silu_and_mul(out, x)
    torch.testing.assert_close(out, silu_and_mul_reference(x), atol=1e-6, rtol=1e-6)


def assert_mostly_bit_equal(got: torch.Tensor, expected: torch.Tensor, least: float = 0.99) -> None:
    """Nearly every value equal to the reference's: the fp32 noise of sum order, FMA contraction and the GPU's
    approximate rsqrt and exp flips a rounding once in thousands of values; rounding at a different step (or
    not at all) changes a tenth to a quarter of them, yet stays within the ulp tolerances above."""
    equal = (got == expected).float().mean().item()
    assert equal >= least, f"only {equal:.1%} of the values equal the reference's"


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(
    torch.bfloat16, id="bf16", marks=pytest.mark.skipif(
        DEVICE == "cpu", reason="Triton's interpreter truncates fp32 -> bf16; the GPU rounds to nearest even"))])
def test_ops_round_where_the_references_round(dtype: torch.dtype) -> None:
    """The norms round the residual sum and the normalized value to the dtype before the weight multiply (as
    HF does); rotary and silu_and_mul compute in fp32 and round once."""
    torch.manual_seed(0)
    x, weight = rms_norm_cases(dtype, 8, 1000, pad=0)
    out = torch.empty_like(x)
    fused.rms_norm(out, x, weight, EPS)
    assert_mostly_bit_equal(out, rms_norm_reference(x, weight, EPS))
    residual = strided_rows(8, 1000, dtype, scale=3.0)
    expected = rms_norm_reference(x + residual, weight, EPS)
    fused.fused_add_rms_norm(x, residual, weight, EPS)
    assert_mostly_bit_equal(x, expected)

    qkv, positions, cos, sin = rotary_case(dtype, 8, 9, 3, 64, max_position=4096)
    expected = apply_rotary_reference(qkv[:, :12], cos[positions], sin[positions])
    fused.rotary_embedding(qkv[:, :12], positions, cos, sin)
    assert_mostly_bit_equal(qkv[:, :12], expected)

    gate_up = strided_rows(8, 2 * 1000, dtype, scale=3.0)
    out = torch.empty(8, 1000, device=DEVICE, dtype=dtype)
    fused.silu_and_mul(out, gate_up)
    assert_mostly_bit_equal(out, silu_and_mul_reference(gate_up.float()).to(dtype))


def test_shape_mismatches_raise_value_error() -> None:
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        fused.rms_norm(torch.empty_like(x), x, torch.ones(7, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="contiguous last dim"):
        fused.rms_norm(torch.empty_like(x), x.t(), torch.ones(3, device=DEVICE), EPS)
    wide = torch.randn(1, fused.MAX_NORM_BLOCK + 1, device=DEVICE)
    with pytest.raises(ValueError, match="wider"):
        fused.rms_norm(torch.empty_like(wide), wide, torch.ones(wide.shape[1], device=DEVICE), EPS)
    with pytest.raises(ValueError, match="residual"):
        fused.fused_add_rms_norm(x, torch.randn(2, 8, device=DEVICE), torch.ones(8, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="out"):
        fused.silu_and_mul(torch.empty(3, 8, device=DEVICE), x)
    with pytest.raises(ValueError, match="cos_cache"):
        fused.rotary_embedding(x.view(3, 1, 8), torch.zeros(3, dtype=torch.long, device=DEVICE),
                               torch.ones(16, 8, device=DEVICE), torch.ones(16, 4, device=DEVICE))


# Realistic sizes, bf16, compiled for the GPU: SmolLM2-135M (576 / 1536, 9 + 3 heads) and Llama-3.2-1B
# (2048 / 8192, 32 + 8 heads), from a decode step to a long prefill.
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [1, 257, 8192])
@pytest.mark.parametrize("hidden", [576, 2048])
def test_gpu_norms_at_model_sizes(rows: int, hidden: int) -> None:
    torch.manual_seed(0)
    dtype = torch.bfloat16
    x, weight = rms_norm_cases(dtype, rows, hidden, pad=0)
    out = torch.empty_like(x)
    fused.rms_norm(out, x, weight, EPS)
    torch.testing.assert_close(out, rms_norm_reference(x, weight, EPS), **tolerance(dtype, 2))
    residual = strided_rows(rows, hidden, dtype, scale=3.0)
    expected_sum = x + residual
    expected = rms_norm_reference(expected_sum, weight, EPS)
    fused.fused_add_rms_norm(x, residual, weight, EPS)
    torch.testing.assert_close(residual, expected_sum, atol=0, rtol=0)
    torch.testing.assert_close(x, expected, **tolerance(dtype, 2))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [1, 257, 8192])
@pytest.mark.parametrize("inner", [1536, 8192])
def test_gpu_silu_and_mul_at_model_sizes(rows: int, inner: int) -> None:
    torch.manual_seed(0)
    x = strided_rows(rows, 2 * inner, torch.bfloat16, scale=3.0)
    out = torch.empty(rows, inner, device=DEVICE, dtype=torch.bfloat16)
    fused.silu_and_mul(out, x)
    expected = silu_and_mul_reference(x.float()).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, **tolerance(torch.bfloat16, 1))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [1, 257, 8192])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (32, 8)])
def test_gpu_rotary_embedding_at_model_sizes(rows: int, heads: int, kv_heads: int) -> None:
    torch.manual_seed(0)
    qkv, positions, cos, sin = rotary_case(torch.bfloat16, rows, heads, kv_heads, 64, max_position=131072)
    qk = qkv[:, :heads + kv_heads]
    expected = apply_rotary_reference(qk, cos[positions], sin[positions])
    values = qkv[:, heads + kv_heads:].clone()
    fused.rotary_embedding(qk, positions, cos, sin)
    torch.testing.assert_close(qkv[:, :heads + kv_heads], expected, **tolerance(torch.bfloat16, 1))
    assert torch.equal(qkv[:, heads + kv_heads:], values)


@pytest.mark.gpu
@gpu
def test_gpu_ops_capture_in_a_cuda_graph() -> None:
    """No host syncs: all four replay from a CUDA graph, reading their inputs at replay time."""
    torch.manual_seed(0)
    dtype, rows, hidden, inner = torch.bfloat16, 16, 2048, 8192
    x = torch.randn(rows, hidden, device=DEVICE, dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device=DEVICE, dtype=dtype)
    gate_up = torch.randn(rows, 2 * inner, device=DEVICE, dtype=dtype)
    qkv, positions, cos, sin = rotary_case(dtype, rows, 32, 8, 64, max_position=4096)
    normed, act = torch.empty_like(x), torch.empty(rows, inner, device=DEVICE, dtype=dtype)

    def step() -> None:
        fused.rms_norm(normed, x, weight, EPS)
        fused.fused_add_rms_norm(x, residual, weight, EPS)
        fused.silu_and_mul(act, gate_up)
        fused.rotary_embedding(qkv[:, :40], positions, cos, sin)

    inputs = [t.clone() for t in (x, residual, qkv)]
    step()  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t, fresh in zip((x, residual, qkv), inputs):
        t.copy_(fresh)
    gate_up.copy_(torch.randn_like(gate_up))
    positions.copy_(torch.randint(0, 4096, (rows,), device=DEVICE))
    expected_normed = rms_norm_reference(x, weight, EPS)
    expected_sum = x + residual
    expected_x = rms_norm_reference(expected_sum, weight, EPS)
    expected_qk = apply_rotary_reference(qkv[:, :40], cos[positions], sin[positions])
    graph.replay()
    torch.cuda.synchronize()
    tol = tolerance(dtype, 2)
    torch.testing.assert_close(normed, expected_normed, **tol)
    torch.testing.assert_close(residual, expected_sum, atol=0, rtol=0)
    torch.testing.assert_close(x, expected_x, **tol)
    torch.testing.assert_close(act, silu_and_mul_reference(gate_up.float()).to(dtype), **tol)
    torch.testing.assert_close(qkv[:, :40], expected_qk, **tol)

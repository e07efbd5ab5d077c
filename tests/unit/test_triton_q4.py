"""The Triton 4-bit GEMM (kvloom/ops/triton/q4.py) against the dequantized weight's product.

Without CUDA it runs in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set below), on small shapes;
fp32 and fp16 only there (the interpreter's bf16 dots sum wrongly); the `gpu` test takes a model's size.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvloom.ops.q4 import Q4Blocks  # noqa: E402
from kvloom.ops.triton import q4 as q4_kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def random_q4(n: int, k: int, seed: int) -> Q4Blocks:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = torch.rand(n, k // 32, generator=g) * 0.05 + 1e-3
    m = -torch.rand(n, k // 32, generator=g) * 0.3
    return Q4Blocks(codes, d, m)


def test_packing_puts_gguf_halves_in_the_nibbles() -> None:
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = q4_kernels.pack_q4_columns(codes)
    assert packed.shape == (32, 3)
    for b, i, n in [(0, 0, 0), (0, 15, 2), (1, 3, 1), (1, 15, 0)]:
        byte = int(packed[16 * b + i, n])
        assert byte & 0x0F == codes[n, 32 * b + i] and byte >> 4 == codes[n, 32 * b + 16 + i]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 80), (5, 96, 64), (20, 32, 130)])
def test_q4_linear_equals_the_dequantized_product(dtype: torch.dtype, m: int, k: int, n: int) -> None:
    from kvloom.ops import cuda

    weight = random_q4(n, k, seed=m + k + n)
    bias = torch.randn(n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    linear = cuda.Q4Linear(Q4Blocks(*(t.to(DEVICE) for t in weight)), bias.to(DEVICE))
    out = linear(x.to(DEVICE)).cpu()
    dense = weight.dequantize()
    expected = x.float() @ (dense.to(dtype).float() if dtype != torch.float32 else dense).t() + bias
    tolerance = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-3)
    torch.testing.assert_close(out.float(), expected, **tolerance)
    assert out.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 80), (20, 32, 130)])
def test_5bit_codes_one_a_byte_equal_the_dequantized_product(dtype: torch.dtype, m: int, k: int, n: int) -> None:
    """Q5_1 / Q5_K codes (0..31) do not fit a nibble: packed one a byte [K, N], the same kernel reads them."""
    from kvloom.ops import cuda

    g = torch.Generator().manual_seed(k + n)
    weight = random_q4(n, k, seed=n)
    weight = Q4Blocks(torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8), weight.d, weight.m)
    linear = cuda.Q4Linear(Q4Blocks(*(t.to(DEVICE) for t in weight)), None)
    assert linear.packed.shape == (k, n)
    x = torch.randn(m, k, generator=g).to(dtype)
    out = linear(x.to(DEVICE)).cpu()
    dense = weight.dequantize()
    expected = x.float() @ (dense.to(dtype).float() if dtype != torch.float32 else dense).t()
    tolerance = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-2, rtol=2e-3)
    torch.testing.assert_close(out.float(), expected, **tolerance)


def test_q4_linear_names_what_does_not_fit() -> None:
    weight = random_q4(8, 64, seed=0)
    packed = q4_kernels.pack_q4_columns(weight.codes)
    d, m = weight.d.t().contiguous(), weight.m.t().contiguous()
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="packed must be"):
        q4_kernels.q4_linear(torch.empty(2, 8), torch.randn(2, 96), packed, d, m, None)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        q4_kernels.q4_linear(torch.empty(2, 8, dtype=torch.int32), x.int(), packed, d, m, None)
    with pytest.raises(ValueError, match="d must be"):
        q4_kernels.q4_linear(torch.empty(2, 8), x, packed, d.double(), m, None)


@gpu
def test_gpu_q4_linear_at_model_size() -> None:
    from kvloom.ops import cuda

    weight = random_q4(1536, 576, seed=1)
    x = torch.randn(64, 576, device="cuda", dtype=torch.bfloat16)
    out = cuda.Q4Linear(Q4Blocks(*(t.cuda() for t in weight)), None)(x)
    expected = x.float() @ weight.dequantize().cuda().to(torch.bfloat16).float().t()
    torch.testing.assert_close(out.float(), expected, atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 80), (20, 32, 130)])
def test_q6_k_groups_of_16_equal_the_dequantized_product(dtype: torch.dtype, m: int, k: int, n: int) -> None:
    """Q6_K: 6-bit codes with a scale and an offset per 16 inputs, one code a byte, d and m [K / 16, N]: each half
    of a block widened with its own pair (a kernel reading one pair per block would be off in every second half)."""
    from kvloom.ops import cuda

    g = torch.Generator().manual_seed(k + n + 1)
    codes = torch.randint(0, 64, (n, k), generator=g, dtype=torch.uint8)
    d = torch.rand(n, k // 16, generator=g) * 0.01 + 1e-3
    weight = Q4Blocks(codes, d, -32 * d * torch.rand(n, k // 16, generator=g))
    assert weight.group == 16
    bias = torch.randn(n, generator=g)
    linear = cuda.Q4Linear(Q4Blocks(*(t.to(DEVICE) for t in weight)), bias.to(DEVICE))
    assert linear.packed.shape == (k, n) and linear.d.shape == (k // 16, n)
    x = torch.randn(m, k, generator=g).to(dtype)
    out = linear(x.to(DEVICE)).cpu()
    dense = weight.dequantize()
    expected = x.float() @ (dense.to(dtype).float() if dtype != torch.float32 else dense).t() + bias
    tolerance = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-2, rtol=2e-3)
    torch.testing.assert_close(out.float(), expected, **tolerance)
    # Against the weight with each block's first pair for both halves: the kernel must tell the halves apart.
    wrong = Q4Blocks(codes, d[:, 0::2].repeat_interleave(2, dim=1), weight.m[:, 0::2].repeat_interleave(2, dim=1))
    assert (out.float() - (x.float() @ wrong.dequantize().t() + bias)).abs().max() > 1e-2


@gpu
def test_gpu_q6_k_at_model_size() -> None:
    from kvloom.ops import cuda

    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 64, (1536, 576), generator=g, dtype=torch.uint8)
    d = torch.rand(1536, 36, generator=g) * 0.002
    weight = Q4Blocks(codes, d, -32 * d)
    x = torch.randn(64, 576, device="cuda", dtype=torch.bfloat16)
    out = cuda.Q4Linear(Q4Blocks(*(t.cuda() for t in weight)), None)(x)
    expected = x.float() @ weight.dequantize().cuda().to(torch.bfloat16).float().t()
    torch.testing.assert_close(out.float(), expected, atol=5e-2, rtol=2e-2)

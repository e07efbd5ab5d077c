"""The vision tower's CPU ops: dense attention (csrc/dense_attention.cpp) against torch's SDPA in fp32, and the
tanh-approximated gelu (csrc/fused_ops.cpp) against torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvloom.cpu_capability import cpu_capability
from kvloom.models.vision_encoder import VisionAttention, VisionConfig, VisionMLP
from kvloom.ops import cpu
from kvloom.ops.table import select_ops

# Largest |kernel - fp32 SDPA| allowed. The outputs are averages of N(0, 1) values (|out| < 1): bf16 rounds the output
# (half an ulp: 2^-9 at 1) and the probabilities before P V (vdpbf16ps, as torch's bf16 flash attention does);
# torch's own bf16 SDPA lands at 2-5e-3 on these shapes. fp16 rounds the output (2^-12) only, fp32 nothing but the
# order of its sums.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5}

# (batch, heads, query rows, keys, head_dim): one key; fewer rows than a query block; lengths that are not multiples
# of the 64-key tile (AVX-512; 32 on AVX2) or of the 48-row query block; an odd number of keys (a pair with no
# partner); head_dim 64 (SigLIP, CLIP), 32, 80, 72 (SigLIP so400m: not a multiple of 16), 128, 16 (the tests' tiny
# towers), 7 (odd: the float kernel) and 256 (the largest).
SHAPES = [(2, 3, 1, 1, 64), (2, 3, 17, 17, 64), (1, 2, 100, 77, 64), (2, 2, 130, 130, 32), (1, 2, 65, 200, 80),
          (1, 1, 50, 51, 72), (1, 2, 129, 129, 128), (3, 2, 16, 16, 16), (1, 1, 33, 40, 7), (1, 1, 97, 65, 256)]


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    error = cpu.load_cpu_kernel()
    if error is not None:
        pytest.skip(f"the CPU kernels cannot be built here: {error}")


def _reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(query.float(), key.float(), value.float())


def _kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(query)
    torch.ops.kvloom.dense_attention(out, query, key, value, query.shape[-1] ** -0.5)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_sdpa(dtype: torch.dtype, shape: tuple[int, int, int, int, int]) -> None:
    """The op itself (both kernels at every ISA level, whether or not the tower routes to it there)."""
    batch, heads, rows, keys, head_dim = shape
    torch.manual_seed(rows * 1000 + keys + head_dim)
    query = torch.randn(batch, heads, rows, head_dim, dtype=dtype)
    key, value = (torch.randn(batch, heads, keys, head_dim, dtype=dtype) for _ in range(2))
    error = (_kernel(query, key, value).float() - _reference(query, key, value)).abs().max().item()
    assert error <= TOLERANCE[dtype], f"{dtype} {shape}: max error {error:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_growing_maxima_rescale_earlier_tiles(dtype: torch.dtype) -> None:
    """Scores that grow key by key, each tile's max above the last, by over 2^128 in all (fp32's range: a row whose
    output is not rescaled as its max grows overflows): the online softmax rescales what the rows summed before, and
    the sharp softmax (a few keys take all) shows any mistake in it. Its outputs are single values of V, up to ~4:
    the tolerance scales with them."""
    torch.manual_seed(0)
    head_dim, keys = 64, 600
    query = torch.randn(1, 2, 70, head_dim).abs().to(dtype)
    key = (torch.randn(1, 2, keys, head_dim).abs() * torch.linspace(0.1, 30.0, keys)[:, None]).to(dtype)
    value = torch.randn(1, 2, keys, head_dim, dtype=dtype)
    reference = _reference(query, key, value)
    error = (_kernel(query, key, value).float() - reference).abs().max().item()
    assert error <= TOLERANCE[dtype] * max(1.0, reference.abs().max().item())


def test_strided_views_of_a_fused_projection() -> None:
    """The tower's call: q, k, v are views of one [N, P, 3, H, D] projection, the result lies [N, P, H, D]."""
    torch.manual_seed(1)
    tiles, patches, heads, head_dim = 3, 196, 4, 64
    qkv = torch.randn(tiles, patches, 3, heads, head_dim, dtype=torch.bfloat16).permute(2, 0, 3, 1, 4)
    out = torch.full((tiles, patches, heads, head_dim), 7.0, dtype=torch.bfloat16).transpose(1, 2)
    torch.ops.kvloom.dense_attention(out, qkv[0], qkv[1], qkv[2], head_dim ** -0.5)
    assert (out.float() - _reference(qkv[0], qkv[1], qkv[2])).abs().max().item() <= TOLERANCE[torch.bfloat16]
    wrapped = cpu.dense_attention(qkv[0], qkv[1], qkv[2])
    torch.testing.assert_close(wrapped.float(), F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2]).float(),
                               atol=TOLERANCE[torch.bfloat16], rtol=0)
    if cpu.dense_attention_kernel(torch.bfloat16, head_dim) is not None:
        assert wrapped.transpose(1, 2).is_contiguous()  # the tower's reshape to [N, P, H * D] copies nothing


def test_unsupported_calls_fall_back_to_sdpa() -> None:
    torch.manual_seed(2)
    for dtype, head_dim in ((torch.float64, 64), (torch.bfloat16, 384)):
        query, key, value = (torch.randn(1, 2, 20, head_dim, dtype=dtype) for _ in range(3))
        assert cpu.dense_attention_kernel(dtype, head_dim) is None
        assert torch.equal(cpu.dense_attention(query, key, value), F.scaled_dot_product_attention(query, key, value))


def test_bad_operands_raise() -> None:
    query = torch.randn(1, 2, 8, 64)
    with pytest.raises(RuntimeError, match="batch, heads and head_dim must agree"):
        torch.ops.kvloom.dense_attention(torch.empty_like(query), query, torch.randn(1, 3, 8, 64),
                                         torch.randn(1, 3, 8, 64), 0.125)
    with pytest.raises(RuntimeError, match="share one dtype"):
        torch.ops.kvloom.dense_attention(torch.empty_like(query), query, query.bfloat16(), query, 0.125)
    with pytest.raises(RuntimeError, match="head_dim must be"):
        big = torch.randn(1, 1, 4, 512)
        torch.ops.kvloom.dense_attention(torch.empty_like(big), big, big, big, 0.05)


def test_kernels_by_isa() -> None:
    """bf16 takes vdpbf16ps where the build has AVX512-BF16; the float kernel runs on AVX-512 only (on AVX2 torch's
    SDPA measured faster)."""
    level = cpu_capability()
    pairs = level.level == "avx512" and level.has("avx512_bf16")
    assert cpu.dense_attention_kernel(torch.bfloat16, 64) == ("pairs" if pairs else
                                                             "float" if level.level == "avx512" else None)
    assert cpu.dense_attention_kernel(torch.float32, 64) == ("float" if level.level == "avx512" else None)


def test_the_tower_attends_through_the_op_table() -> None:
    """VisionAttention takes the table's dense attention when its weights are processed, and gives SDPA's answer."""
    config = VisionConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                          image_size=224, patch_size=16)
    ops = select_ops(torch.device("cpu"), torch.bfloat16)
    assert ops.dense_attention is cpu.dense_attention
    torch.manual_seed(3)
    attention = VisionAttention(config).to(torch.bfloat16)
    for linear in (attention.qkv_proj, attention.out_proj):
        linear.weight.data.normal_(std=0.1)
        linear.bias.data.normal_(std=0.1)
    hidden = torch.randn(2, 196, 128, dtype=torch.bfloat16)
    expected = attention(hidden).float()  # SDPA, before processing
    attention.qkv_proj.process_weights_after_loading(ops)
    attention.out_proj.process_weights_after_loading(ops)
    packed_sdpa = attention(hidden).float()
    attention.process_weights_after_loading(ops)
    assert attention.attend is cpu.dense_attention
    # The same packed projections around either attention: only the attention's rounding differs.
    torch.testing.assert_close(attention(hidden).float(), packed_sdpa, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(packed_sdpa, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7,), (3, 45), (2, 1024, 96), (100003,)])
def test_gelu_tanh_matches_torch(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Against the function in fp64: fp32 within exp's polynomial's error, bf16 / fp16 within one rounding (half an ulp
    each side, and that error). torch's own rounds the same where |x| is small; for x below about -4 its 1 + tanh(u)
    cancels (-0.0 where gelu is -1.5e-10 at -5.9), which x / (1 + exp(-2u)) does not."""
    torch.manual_seed(len(shape))
    x = (torch.randn(shape) * 3).to(dtype)
    x.view(-1)[:3] = torch.tensor([-30.0, 30.0, 0.0], dtype=dtype)  # exp's under- and overflow; gelu(0) = 0
    ours = cpu.gelu_tanh(x.clone())
    assert ours.dtype == dtype and ours.shape == x.shape
    exact = F.gelu(x.double(), approximate="tanh")
    ulp = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -8 + 1e-5, torch.float16: 2.0 ** -11 + 1e-5}[dtype]
    assert ((ours.double() - exact).abs() <= ulp * exact.abs() + 1e-7).all()
    small = x.abs() <= 3
    if dtype != torch.float32:  # the same rounding but where torch's fp32 value lies within that error of an edge
        assert (ours[small] != F.gelu(x, approximate="tanh")[small]).float().mean().item() <= 0.01


def test_gelu_tanh_writes_over_its_input() -> None:
    x = torch.randn(4, 33, dtype=torch.bfloat16)
    expected = F.gelu(x, approximate="tanh")
    out = cpu.gelu_tanh(x)
    assert out.data_ptr() == x.data_ptr()
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
    strided = torch.randn(33, 4, dtype=torch.bfloat16).t()  # not contiguous: a contiguous copy is computed on
    torch.testing.assert_close(cpu.gelu_tanh(strided), F.gelu(strided, approximate="tanh"), atol=1e-2, rtol=1e-2)


def test_the_tower_mlp_takes_the_table_gelu() -> None:
    config = VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                          image_size=32, patch_size=16)
    mlp = VisionMLP(config).to(torch.bfloat16)
    for linear in (mlp.fc1, mlp.fc2):
        linear.weight.data.normal_(std=0.2)
    hidden = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    expected = mlp(hidden).float()
    mlp.process_weights_after_loading(select_ops(torch.device("cpu"), torch.bfloat16))
    assert mlp.gelu_tanh is cpu.gelu_tanh
    torch.testing.assert_close(mlp(hidden).float(), expected, atol=2e-2, rtol=2e-2)

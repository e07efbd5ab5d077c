"""The int8 products (csrc/gemm_int8.cpp, triton/int8.py) against the references in kvloom/ops/int8.py.

W8A8 sums are exact integers, so the C++ kernel must land within one unit in the last place of the
reference (which applies the scales in float64 and rounds once); its vector and plain-loop versions
must agree bit for bit. W8A8 on blocks sums each block exactly too, then adds the scaled blocks in fp32:
within one ulp plus a few fp32 roundings per block, vector and plain loops bit for bit. Weight-only sums
are fp32 in another order: within one ulp plus a sliver of the sum of |terms|.
"""

from __future__ import annotations

import os

import pytest
import torch

# Triton reads the variable when a kernel is decorated (tests/conftest.py may have set it already).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvloom.ops import cpu  # noqa: E402
from kvloom.ops.int8 import (  # noqa: E402
    BLOCK,
    Int8Blocks,
    Int8Rows,
    NativeInt8BlocksLinear,
    NativeInt8Linear,
    Q8_0Blocks,
    dequantize,
    dequantize_blocks,
    int8_linear_reference,
    quantize_per_block,
    quantize_per_channel,
    quantize_per_token,
    w8a8_blocks_dequantized_reference,
    w8a8_blocks_linear_reference,
    w8a8_linear_reference,
)
from kvloom.ops.table import select_ops  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_NAMES = ["fp32", "bf16"]
# (M, K, N): M = 1 and odd M, K not a multiple of 4 or of 64, N not a multiple of the 48-column panel.
SHAPES = [(1, 576, 960), (1, 37, 50), (3, 95, 7), (8, 64, 48), (9, 1536, 100), (17, 6, 1), (33, 130, 97),
          (300, 40, 49)]
# Block-scaled weights: K a multiple of 32 (SmolLM2's 576 and 1536), M from 1 to 70 (whole micro-kernels of
# 4 rows and a remainder), odd N (a part-filled last panel).
BLOCK_SHAPES = [(1, 576, 961), (2, 1536, 577), (5, 576, 97), (17, 1536, 49), (33, 32, 3), (64, 576, 95),
                (70, 1536, 1)]


def ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` values at each of t's magnitudes (the smallest normal's at zero)."""
    tiny = torch.finfo(dtype).tiny
    _, exponent = torch.frexp(t.double().abs().clamp_min(tiny))
    return torch.ldexp(torch.full_like(t, torch.finfo(dtype).eps, dtype=torch.float64), exponent - 1)


def assert_within(actual: torch.Tensor, expected: torch.Tensor, ulps: float, slack: torch.Tensor | float = 0.0
                  ) -> None:
    """|actual - expected| <= ulps units in the last place of expected (in actual's dtype) + slack."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    error = (actual.double() - expected.double()).abs()
    allowed = ulps * ulp(expected, actual.dtype) + slack
    worst = (error - allowed).argmax()
    assert (error <= allowed).all(), (f"{int((error > allowed).sum())} values off; worst at {worst.item()}: "
                                      f"{actual.flatten()[worst].item()} vs {expected.flatten()[worst].item()}")


def problem(m: int, k: int, n: int, dtype: torch.dtype, seed: int, bias: bool = True, blocks: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [m, k] in dtype, an int8 weight [n, k] with its scale (per row, or with ``blocks`` per row and
    block of 32 k: Q8_0's), and a bias (or None)."""
    torch.manual_seed(seed)
    x = (torch.randn(m, k) * 2).to(dtype)
    quantize = quantize_per_block if blocks else quantize_per_channel
    qweight, scale = quantize(torch.randn(n, k) * 0.05)
    return x, qweight, scale, (torch.randn(n) if bias else None)


def w8a8_slack(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
               ) -> torch.Tensor:
    """fp32 epilogue vs the float64 reference: a few fp32 roundings of the product term and the bias."""
    qx, x_scale = quantize_per_token(x.reshape(-1, x.shape[-1]))
    term = (qx.double() @ qweight.double().t()).abs() * x_scale.double()[:, None] * scale.double()
    return 4 * 2.0 ** -24 * (term + (0 if bias is None else bias.double().abs()))


def weight_only_slack(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
                      ) -> torch.Tensor:
    """fp32 sums in another order (and, for fp32 x, its bf16 hi + lo split): a sliver of sum |terms|."""
    terms = x.double().abs() @ qweight.double().abs().t() * scale.double()
    return 2.0 ** -16 * (terms + (0 if bias is None else bias.double().abs()))


def w8a8_blocks_slack(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
                      ) -> torch.Tensor:
    """Exact block sums; per block the fp32 product of the scales and one FMA: (blocks + 2) fp32 roundings
    of the sum of |scaled block sums| (and the bias)."""
    qx, x_scale = quantize_per_block(x.reshape(-1, x.shape[-1]))
    m, k = qx.shape
    blocks = k // BLOCK
    sums = torch.einsum("mbk,nbk->mnb", qx.view(m, blocks, BLOCK).double(),
                        qweight.view(-1, blocks, BLOCK).double()).abs()
    terms = (sums * x_scale.double()[:, None, :] * scale.double()[None, :, :]).sum(dim=-1)
    return (blocks + 2) * 2.0 ** -24 * (terms + (0 if bias is None else bias.double().abs()))


@pytest.fixture(scope="module")
def int8_kernels() -> None:
    if not cpu.cpu_kernel_available():
        pytest.skip("the CPU kernels could not be built here")


def run_w8a8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
             portable: bool) -> torch.Tensor:
    m, n = x.shape[0], qweight.shape[0]
    # A tail of sentinels after y shows that the masked stores of the last panel stay inside it.
    buffer = torch.full((m * n + 64,), 7.0, dtype=x.dtype)
    compensation = (qweight.to(torch.int32).sum(dim=1) * 128).to(torch.int32)
    torch.ops.kvloom.gemm_w8a8(buffer[:m * n].view(m, n), x, cpu.pack_int8_weight(qweight), compensation, scale,
                               None if bias is None else bias.float(), portable, bf16_tiles=False)
    assert (buffer[m * n:] == 7.0).all()
    return buffer[:m * n].view(m, n)


def run_weight_only(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    portable: bool) -> torch.Tensor:
    m, n = x.shape[0], qweight.shape[0]
    buffer = torch.full((m * n + 64,), 7.0, dtype=x.dtype)
    torch.ops.kvloom.gemm_int8_weight_only(buffer[:m * n].view(m, n), x, cpu.pack_int8_weight(qweight), scale,
                                           None if bias is None else bias.float(), portable, bf16_tiles=False)
    assert (buffer[m * n:] == 7.0).all()
    return buffer[:m * n].view(m, n)


def run_w8a8_blocks(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    portable: bool) -> torch.Tensor:
    m, n = x.shape[0], qweight.shape[0]
    buffer = torch.full((m * n + 64,), 7.0, dtype=x.dtype)
    packed = cpu.PackedInt8BlocksWeight(qweight, scale, bias)
    torch.ops.kvloom.gemm_w8a8_blocks(buffer[:m * n].view(m, n), x, packed.data, packed.scale, packed.bias, portable,
                                      bf16_tiles=False)
    assert (buffer[m * n:] == 7.0).all()
    return buffer[:m * n].view(m, n)


# product -> (the C++ op, its reference, its slack, whether its sums are exact integers)
PRODUCTS = {"w8a8": (run_w8a8, w8a8_linear_reference, w8a8_slack, True),
            "weight_only": (run_weight_only, int8_linear_reference, weight_only_slack, False),
            "w8a8_blocks": (run_w8a8_blocks, w8a8_blocks_linear_reference, w8a8_blocks_slack, True)}


# ---- quantization ---------------------------------------------------------------------------------
def test_quantize_per_channel_round_trip() -> None:
    torch.manual_seed(0)
    weight = torch.randn(40, 70) * torch.logspace(-3, 2, 40)[:, None]
    weight[5] = 0.0
    qweight, scale = quantize_per_channel(weight)
    assert qweight.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (40,)
    # Each row's largest value maps to +-127 and every value is within half a step of its original.
    nonzero = torch.arange(40) != 5
    assert (qweight[nonzero].abs().amax(dim=1) == 127).all()
    assert ((dequantize(qweight, scale) - weight).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()
    assert scale[5] == 1.0 and (qweight[5] == 0).all()  # a zero row keeps scale 1
    # Quantizing the dequantized weight again changes nothing.
    again, again_scale = quantize_per_channel(dequantize(qweight, scale))
    assert torch.equal(again, qweight)
    torch.testing.assert_close(again_scale, scale, rtol=1e-6, atol=0)


def test_quantize_per_channel_names_a_weight_of_the_wrong_rank() -> None:
    with pytest.raises(ValueError, match=r"2-D weight \[out, in\], got shape \(3, 4, 5\)"):
        quantize_per_channel(torch.zeros(3, 4, 5))


def test_pack_layout() -> None:
    qweight = (torch.arange(50 * 6) % 251 - 125).to(torch.int8).view(50, 6)
    packed = cpu.pack_int8_weight(qweight)
    assert packed.shape == (2, 2, 48, 4)
    assert packed[0, 1, 7, :2].tolist() == qweight[7, 4:6].tolist()
    assert packed[0, 1, 7, 2:].tolist() == [0, 0]  # K = 6: the last group's pad is zero
    assert packed[1, 0, 1].tolist() == qweight[49, 0:4].tolist()
    assert packed[1, :, 2:].abs().sum().item() == 0  # columns past N are zero


# ---- the C++ kernels ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES)
@pytest.mark.parametrize(("product", "m", "k", "n"),
                         [("w8a8", *shape) for shape in SHAPES] + [("weight_only", *shape) for shape in SHAPES]
                         + [("w8a8_blocks", *shape) for shape in BLOCK_SHAPES])
def test_cpu_int8_product_matches_its_reference(int8_kernels: None, product: str, dtype: torch.dtype, m: int,
                                                k: int, n: int) -> None:
    run, reference, slack_of, exact_sums = PRODUCTS[product]
    for bias in (True, False):
        x, qweight, scale, b = problem(m, k, n, dtype, seed=m * 7 + k + n, bias=bias, blocks=product == "w8a8_blocks")
        expected = reference(x, qweight, scale, b)
        slack = slack_of(x, qweight, scale, b)
        fast = run(x, qweight, scale, b, portable=False)
        if product == "w8a8" and dtype == torch.bfloat16:
            assert_within(fast, expected, ulps=1)  # exact sums; only the final rounding may differ
        else:
            assert_within(fast, expected, ulps=1, slack=slack)
        portable = run(x, qweight, scale, b, portable=True)
        if exact_sums:  # the plain loops compute the same integers and the same fp32 operations
            assert torch.equal(portable, fast)
        else:
            assert_within(portable, expected, ulps=1, slack=slack)


def q8_0_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [n, k] and block scales [n, k / 32] as a GGUF Q8_0 stores them: each d an fp16 value."""
    torch.manual_seed(seed)
    w = (torch.randn(n, k) * 0.05).view(n, k // BLOCK, BLOCK)
    d = (w.abs().amax(dim=-1) / 127).half().float()
    return torch.round(w / d[..., None]).clamp_(-127, 127).to(torch.int8).view(n, k), d


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES)
@pytest.mark.parametrize(("m", "k", "n"), BLOCK_SHAPES)
def test_q8_0_block_scales_stream_as_fp16_with_the_same_product(int8_kernels: None, dtype: torch.dtype, m: int,
                                                                 k: int, n: int) -> None:
    """A Q8_0 weight's scales are packed as the file's fp16 (2 bytes a block, not 4) and widened exactly in the
    kernel: the product is w8a8_blocks_linear_reference's within its slack, and bit for bit what the same scales
    in fp32 give, on the vector and the plain-loop kernels; scales that are not fp16 values stay fp32."""
    qweight, scale = q8_0_weight(n, k, seed=m + k + n)
    torch.manual_seed(m)
    x, bias = (torch.randn(m, k) * 2).to(dtype), torch.randn(n)
    packed = cpu.PackedInt8BlocksWeight(qweight, scale, bias)
    assert packed.scale.dtype == torch.float16
    expected = w8a8_blocks_linear_reference(x, qweight, scale, bias)
    results = []
    for portable in (False, True):
        for scales in (packed.scale, packed.scale.float()):
            y = torch.empty(m, n, dtype=dtype)
            torch.ops.kvloom.gemm_w8a8_blocks(y, x, packed.data, scales, packed.bias, portable, bf16_tiles=False)
            results.append(y)
    assert_within(results[0], expected, ulps=1, slack=w8a8_blocks_slack(x, qweight, scale, bias))
    for other in results[1:]:
        assert torch.equal(other, results[0])
    assert cpu.PackedInt8BlocksWeight(qweight, scale * 1.0001, None).scale.dtype == torch.float32


def q8_0_file_bytes(qweight: torch.Tensor, scale: torch.Tensor) -> Q8_0Blocks:
    """A weight as a GGUF Q8_0 stores it: per row, blocks of fp16 d and 32 int8 codes."""
    n, k = qweight.shape
    d = scale.half().view(torch.uint8).view(n, k // BLOCK, 2)
    codes = qweight.view(torch.uint8).view(n, k // BLOCK, BLOCK)
    return Q8_0Blocks(torch.cat((d, codes), dim=2).reshape(n, -1))


@pytest.mark.parametrize("sizes", [[96], [5], [64, 16, 16], [50, 47, 1]], ids=str)
@pytest.mark.parametrize("k", [32, 576])
def test_q8_0_bytes_pack_in_one_pass_as_the_decoded_blocks_do(int8_kernels: None, sizes: list[int], k: int) -> None:
    """PackedInt8BlocksWeight.from_q8_0 packs a projection's shards from the file's bytes (rows read in place, some
    strided) into the very panels and scales that decoding, joining and packing the int8 blocks give, and the same
    product; the bytes decode to the codes and scales they hold."""
    weights = [q8_0_weight(n, k, seed=n + k + i) for i, n in enumerate(sizes)]
    parts = [q8_0_file_bytes(q, s) for q, s in weights]
    for (q, s), part in zip(weights, parts, strict=True):
        decoded = part.to_int8_blocks()
        assert torch.equal(decoded.qweight, q) and torch.equal(decoded.scale, s)
        assert part.shape == q.shape
    qweight, scale = torch.cat([q for q, _ in weights]), torch.cat([s for _, s in weights])
    bias = torch.randn(qweight.shape[0])
    joined = cpu.PackedInt8BlocksWeight(qweight, scale, bias)
    strided = [Q8_0Blocks(torch.cat((p.data, p.data), dim=1)[:, :p.data.shape[1]]) for p in parts]  # rows apart
    for given in (parts, strided):
        packed = cpu.PackedInt8BlocksWeight.from_q8_0(given, bias)
        assert torch.equal(packed.data, joined.data) and torch.equal(packed.scale, joined.scale)
        assert (packed.out_features, packed.in_features) == tuple(qweight.shape)
        x = torch.randn(3, k)
        assert torch.equal(packed(x), joined(x))
    with pytest.raises(ValueError, match="one or more Q8_0 parts of one in_features"):
        cpu.PackedInt8BlocksWeight.from_q8_0([parts[0], q8_0_file_bytes(*q8_0_weight(2, k + 32, seed=1))], None)
    with pytest.raises(ValueError, match="do not hold a Q8_0 weight"):
        Q8_0Blocks.from_gguf(torch.zeros(33, dtype=torch.uint8), (1, 32))


@pytest.mark.parametrize(("m", "k", "n"), [(48, 576, 961), (49, 32, 3), (64, 576, 95), (70, 1536, 1), (300, 64, 200),
                                            (1000, 1536, 49)])
def test_w8a8_blocks_bf16_tiles_match_their_reference(int8_kernels: None, m: int, k: int, n: int) -> None:
    """On an AMX-BF16 CPU, bf16 activations of bf16_tiles_min_rows("int8_blocks") rows or more: the block-scaled
    weight dequantized to bf16 times x with fp32 sums (w8a8_blocks_dequantized_reference), within an ulp and K
    fp32 roundings of the sum of |terms| (llama.cpp's product, 8-bit activations per block, is ~1% off that and
    would fail). Rows past whole tiles and several passes over them, units of 96 columns and a part-filled last one,
    x with a row stride of its own; float32 x keeps llama.cpp's product."""
    min_rows = cpu.bf16_tiles_min_rows("int8_blocks")
    if not min_rows:
        pytest.skip("no AMX-BF16 tiles here: bf16 activations take llama.cpp's product at every size")
    assert m >= min_rows
    torch.manual_seed(m + k + n)
    qweight, scale = quantize_per_block(torch.randn(n, k) * 0.05)
    x = (torch.randn(m, k + 64) * 2).to(torch.bfloat16)[:, 32:32 + k]
    for bias in (torch.randn(n), None):
        expected = w8a8_blocks_dequantized_reference(x, qweight, scale, bias)
        w = dequantize_blocks(qweight, scale).to(torch.bfloat16).double().abs()
        slack = (k + 1) * 2.0 ** -24 * (x.double().abs() @ w.t() + (0 if bias is None else bias.double().abs()))
        assert_within(cpu.PackedInt8BlocksWeight(qweight, scale, bias)(x), expected, ulps=1, slack=slack)
    x32 = x.float()
    assert_within(cpu.PackedInt8BlocksWeight(qweight, scale, None)(x32),
                  w8a8_blocks_linear_reference(x32, qweight, scale), ulps=1,
                  slack=w8a8_blocks_slack(x32, qweight, scale, None))


@pytest.mark.parametrize(("m", "k", "n"), [(128, 576, 961), (129, 32, 3), (300, 1536, 97), (1000, 64, 200)])
def test_int8_rows_bf16_tiles_match_the_weight_only_reference(int8_kernels: None, m: int, k: int, n: int) -> None:
    """On an AMX-BF16 CPU, bf16 activations of bf16_tiles_min_rows("int8_rows") rows or more (K whole blocks of 32):
    the per-row int8 weight's codes (exact in bf16) times x with fp32 sums, scaled per column at the end: the
    weight-only product's arithmetic (int8_linear_reference) in another order, whichever product (W8A8 or
    weight-only) the rows would otherwise take; W8A8 (8-bit activations) is ~1% off that and would fail here."""
    min_rows = cpu.bf16_tiles_min_rows("int8_rows")
    if not min_rows:
        pytest.skip("no AMX-BF16 tiles here: bf16 activations take the VNNI products at every size")
    assert m >= min_rows
    x, qweight, scale, bias = problem(m, k + 32, n, torch.bfloat16, seed=m + k + n)
    x = x[:, 16:16 + k]  # rows k + 32 apart
    qweight = qweight[:, :k].contiguous()
    for b in (bias, None):
        expected = int8_linear_reference(x, qweight, scale, b)
        terms = x.double().abs() @ qweight.double().abs().t() * scale.double()
        slack = (k + 1) * 2.0 ** -24 * (terms + (0 if b is None else b.double().abs()))  # fp32 sums over K
        for w8a8_rows in (1, 10**9):  # through the W8A8 op and through the weight-only op
            packed = cpu.PackedInt8Weight(qweight, scale, b, w8a8_min_rows=w8a8_rows)
            assert_within(packed(x), expected, ulps=1, slack=slack)
    assert_within(cpu.PackedInt8Weight(qweight, scale, bias, w8a8_min_rows=1)(x.float()),
                  w8a8_linear_reference(x.float(), qweight, scale, bias), ulps=1,
                  slack=w8a8_slack(x.float(), qweight, scale, bias))  # fp32 x: W8A8 as before


def test_w8a8_quantizes_each_row_as_the_reference(int8_kernels: None) -> None:
    """A zero row (scale 1), a row with one outlier, exact .5 ties (rounded to even) and the clamp."""
    x = torch.randn(4, 70)
    x[0] = 0.0
    x[1, 3] = 1e4
    x[2] = torch.arange(70) - 35.0  # amax 35: many values sit on x / scale = k + 0.5
    x[3, :] = 127.0
    x[3, 1::2] = -127.0
    qweight, scale = quantize_per_channel(torch.randn(30, 70))
    for dtype in DTYPES:
        xd = x.to(dtype)
        expected = w8a8_linear_reference(xd, qweight, scale)
        for portable in (False, True):
            actual = run_w8a8(xd, qweight, scale, None, portable)
            assert_within(actual, expected, ulps=1, slack=w8a8_slack(xd, qweight, scale, None))
        assert (actual[0] == 0).all()


def test_w8a8_blocks_quantizes_each_block_as_the_reference(int8_kernels: None) -> None:
    """Per block: a zero block (scale 1) beside a block with an outlier, exact .5 ties and the clamp; an
    outlier moves only its own block's scale."""
    x = torch.randn(3, 4 * BLOCK)
    x[0, :BLOCK] = 0.0
    x[0, BLOCK + 3] = 1e4
    x[1, :BLOCK] = torch.arange(BLOCK) - 15.0  # amax 16: many values sit on x / scale = k + 0.5
    x[2, 2 * BLOCK:] = 127.0
    x[2, 2 * BLOCK + 1::2] = -127.0
    qx, x_scale = quantize_per_block(x)
    assert x_scale[0, 0] == 1.0 and x_scale[0, 2] == x[0, 2 * BLOCK:3 * BLOCK].abs().max() / 127
    qweight, scale = quantize_per_block(torch.randn(50, 4 * BLOCK))
    for dtype in DTYPES:
        xd = x.to(dtype)
        expected = w8a8_blocks_linear_reference(xd, qweight, scale)
        slack = w8a8_blocks_slack(xd, qweight, scale, None)
        for portable in (False, True):
            assert_within(run_w8a8_blocks(xd, qweight, scale, None, portable), expected, ulps=1, slack=slack)


def test_block_scales_hold_row_scales_exactly() -> None:
    """Int8Blocks.from_rows repeats a row's scale over its blocks: the same weight, the same product in
    float (the block product then quantizes the activations per block, more finely than per token)."""
    torch.manual_seed(0)
    rows = Int8Rows.quantize(torch.randn(9, 3 * BLOCK))
    blocks = Int8Blocks.from_rows(rows)
    assert blocks.scale.shape == (9, 3) and torch.equal(blocks.dequantize(), dequantize(*rows))
    assert torch.equal(blocks.to_rows().qweight, rows.qweight)
    with pytest.raises(ValueError, match="in_features must be a multiple of 32"):
        Int8Blocks.from_rows(Int8Rows.quantize(torch.randn(2, 40)))


@pytest.mark.parametrize("k", [33, 64])
def test_kernels_read_strided_rows_and_nothing_past_k(int8_kernels: None, k: int) -> None:
    torch.manual_seed(k)
    for dtype in DTYPES:
        wide = torch.randn(10, 80).to(dtype)
        wide[:, k:] = float("inf")  # past K: must reach neither the sums nor the row's scale
        x = wide[:, :k]
        qweight, scale = quantize_per_channel(torch.randn(20, k))
        assert_within(run_w8a8(x, qweight, scale, None, False), w8a8_linear_reference(x, qweight, scale), ulps=1,
                      slack=w8a8_slack(x, qweight, scale, None))
        assert_within(run_weight_only(x, qweight, scale, None, False), int8_linear_reference(x, qweight, scale),
                      ulps=1, slack=weight_only_slack(x, qweight, scale, None))
        if k % BLOCK == 0:
            qweight, scale = quantize_per_block(torch.randn(20, k))
            assert_within(run_w8a8_blocks(x, qweight, scale, None, False),
                          w8a8_blocks_linear_reference(x, qweight, scale), ulps=1,
                          slack=w8a8_blocks_slack(x, qweight, scale, None))


def test_kernels_reject_a_weight_of_another_shape(int8_kernels: None) -> None:
    x = torch.randn(4, 64)
    packed = cpu.pack_int8_weight(torch.zeros(96, 32, dtype=torch.int8))
    scale = torch.ones(96)
    with pytest.raises(RuntimeError, match="packed weight does not match"):
        torch.ops.kvloom.gemm_int8_weight_only(torch.empty(4, 96), x, packed, scale, None)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        torch.ops.kvloom.gemm_w8a8(torch.empty(4, 96, dtype=torch.half), x.half(),
                                   cpu.pack_int8_weight(torch.zeros(96, 64, dtype=torch.int8)),
                                   torch.zeros(96, dtype=torch.int32), scale, None)
    blocks = cpu.PackedInt8BlocksWeight(torch.zeros(96, 64, dtype=torch.int8), torch.ones(96, 2), None)
    with pytest.raises(RuntimeError, match="block scales packed"):
        torch.ops.kvloom.gemm_w8a8_blocks(torch.empty(4, 96), x, blocks.data, scale, None)
    narrow = cpu.pack_int8_weight(torch.zeros(96, 40, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="K = 40 must be a multiple of 32"):
        torch.ops.kvloom.gemm_w8a8_blocks(torch.empty(4, 96), torch.randn(4, 40), narrow, blocks.scale, None)


def test_kernels_have_shape_only_versions_for_tracing(int8_kernels: None) -> None:
    """torch.compile traces the ops on tensors without data (fake / meta): they must run there."""
    qweight, scale = quantize_per_channel(torch.randn(20, 33))
    meta = {name: t.to("meta") for name, t in vars(cpu.PackedInt8Weight(qweight, scale, None)).items()
            if isinstance(t, torch.Tensor)}
    x = torch.empty(3, 33, dtype=torch.bfloat16, device="meta")
    y = torch.empty(3, 20, dtype=torch.bfloat16, device="meta")
    torch.ops.kvloom.gemm_w8a8(y, x, meta["data"], meta["compensation"], meta["scale"], None)
    torch.ops.kvloom.gemm_int8_weight_only(y, x, meta["data"], meta["scale"], None)
    qweight, scale = quantize_per_block(torch.randn(20, 64))
    meta = {name: t.to("meta") for name, t in vars(cpu.PackedInt8BlocksWeight(qweight, scale, None)).items()
            if isinstance(t, torch.Tensor)}
    x = torch.empty(3, 64, dtype=torch.bfloat16, device="meta")
    torch.ops.kvloom.gemm_w8a8_blocks(y, x, meta["data"], meta["scale"], None)


# ---- PackedInt8Weight and the op table ------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES)
def test_packed_int8_weight_picks_the_product_by_rows(int8_kernels: None, dtype: torch.dtype) -> None:
    x, qweight, scale, bias = problem(4, 100, 70, dtype, seed=3)
    packed = cpu.PackedInt8Weight(qweight, scale, bias, w8a8_min_rows=4)
    assert_within(packed(x[:3]), int8_linear_reference(x[:3], qweight, scale, bias), ulps=1,
                  slack=weight_only_slack(x[:3], qweight, scale, bias))
    assert_within(packed(x), w8a8_linear_reference(x, qweight, scale, bias), ulps=1,
                  slack=w8a8_slack(x, qweight, scale, bias))
    # Leading dimensions pass through; so do rows that are not contiguous.
    assert packed(x.view(2, 2, 100)).shape == (2, 2, 70)
    torch.testing.assert_close(packed(x.t().contiguous().t()), packed(x), rtol=0, atol=0)


def test_a_k_too_wide_for_int32_sums_takes_the_weight_only_product(int8_kernels: None) -> None:
    k = cpu.W8A8_MAX_IN_FEATURES + 1
    x, qweight, scale, _ = problem(2, k, 3, torch.bfloat16, seed=4, bias=False)
    compensation = (qweight.to(torch.int32).sum(dim=1) * 128).to(torch.int32)
    with pytest.raises(RuntimeError, match=f"K = {k} is more than the {k - 1} whose int32 sums cannot overflow"):
        torch.ops.kvloom.gemm_w8a8(torch.empty(2, 3, dtype=torch.bfloat16), x, cpu.pack_int8_weight(qweight),
                                   compensation, scale, None)
    assert_within(cpu.PackedInt8Weight(qweight, scale, None)(x), int8_linear_reference(x, qweight, scale), ulps=1,
                  slack=weight_only_slack(x, qweight, scale, None))


def test_packed_int8_weight_names_what_it_cannot_take(int8_kernels: None) -> None:
    qweight, scale = quantize_per_channel(torch.randn(8, 16))
    with pytest.raises(ValueError, match="float32 or bfloat16 activations, got torch.float16"):
        cpu.PackedInt8Weight(qweight, scale, None)(torch.zeros(2, 16, dtype=torch.half))
    with pytest.raises(ValueError, match=r"int8 \[out, in\] weight, got torch.float32"):
        cpu.PackedInt8Weight(qweight.float(), scale, None)
    with pytest.raises(ValueError, match=r"scale must have shape \(8,\), got \(9,\)"):
        cpu.PackedInt8Weight(qweight, torch.ones(9), None)
    with pytest.raises(ValueError, match=r"block scales of an int8 \[8, 64\] weight must have shape \(8, 2\), "
                                         r"got \(8,\)"):
        cpu.PackedInt8BlocksWeight(torch.zeros(8, 64, dtype=torch.int8), torch.ones(8), None)
    with pytest.raises(ValueError, match="in_features a multiple of 32"):
        NativeInt8BlocksLinear(torch.zeros(8, 48, dtype=torch.int8), torch.ones(8, 1), None)
    with pytest.raises(ValueError, match="float32 or bfloat16 activations"):
        cpu.PackedInt8BlocksWeight(*quantize_per_block(torch.randn(8, 64)), None)(torch.zeros(1, 64).half())


def test_packed_int8_rows_give_back_the_table(int8_kernels: None) -> None:
    """A tied embedding reads its rows from the head's packing (panels of 48 columns, K padded to groups of 4)."""
    ids = torch.tensor([0, 49, 47, 48, 3, 3])
    qweight, scale = quantize_per_channel(torch.randn(50, 70))
    rows = cpu.PackedInt8Weight(qweight, scale, None).rows(ids)
    assert torch.equal(rows.qweight, qweight[ids]) and torch.equal(rows.scale, scale[ids])
    for qweight, scale in (quantize_per_block(torch.randn(50, 96)), q8_0_weight(50, 96, seed=1)):  # fp32, fp16
        rows = cpu.PackedInt8BlocksWeight(qweight, scale, None).rows(ids)
        assert torch.equal(rows.qweight, qweight[ids]) and torch.equal(rows.scale, scale[ids])
        assert rows.scale.dtype == torch.float32


def test_block_scales_pack_beside_their_panels() -> None:
    values = torch.arange(50 * 3, dtype=torch.float32).view(50, 3)
    packed = cpu.pack_block_columns(values)
    assert packed.shape == (2, 3, 48)
    assert packed[0, 2, 7] == values[7, 2] and packed[1, 1, 1] == values[49, 1]
    assert packed[1, :, 2:].abs().sum() == 0  # columns past N are zero


@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES)
def test_select_ops_packs_int8_weights_for_the_cpu_kernels(dtype: torch.dtype, int8_activations: bool) -> None:
    """Weight-only by default (the accurate product); W8A8 for batches only when int8_activations asks."""
    ops = select_ops(torch.device("cpu"), dtype, int8_activations=int8_activations)
    assert select_ops(torch.device("cpu"), dtype, "reference").pack_linear_int8 is NativeInt8Linear
    x, qweight, scale, bias = problem(3, 40, 20, dtype, seed=1)
    layer = ops.pack_linear_int8(qweight, scale, bias)
    # AVX-512 and AVX2 builds hold both kernels; the generic level keeps torch's ops.
    fast = cpu.int8_kernels_available()
    assert isinstance(layer, cpu.PackedInt8Weight if fast else NativeInt8Linear)
    if cpu.int8_kernels_available() and int8_activations:
        assert_within(layer(x), w8a8_linear_reference(x, qweight, scale, bias), ulps=1,
                      slack=w8a8_slack(x, qweight, scale, bias))
    else:
        assert_within(layer(x), int8_linear_reference(x, qweight, scale, bias), ulps=1,
                      slack=weight_only_slack(x, qweight, scale, bias))


# ---- the Triton weight-only kernel (Triton's interpreter without CUDA) ----------------------------
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def triton_int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
                       ) -> torch.Tensor:
    from kvloom.ops.cuda import Int8Linear

    layer = Int8Linear(qweight.to(DEVICE), scale.to(DEVICE), None if bias is None else bias.to(DEVICE))
    return layer(x.to(DEVICE)).cpu()


# The interpreter's tl.dot gives wrong sums for bf16 operands, so it is tested with fp32 and fp16 here and
# with bf16 on a GPU below.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 37, 50), (5, 64, 33), (20, 130, 70), (40, 16, 64)])
def test_triton_int8_linear_matches_reference(dtype: torch.dtype, m: int, k: int, n: int) -> None:
    x, qweight, scale, bias = problem(m, k, n, dtype, seed=m + k + n)
    for b in (bias, None):
        expected = int8_linear_reference(x, qweight, scale, b)
        assert_within(triton_int8_linear(x, qweight, scale, b), expected, ulps=1,
                      slack=weight_only_slack(x, qweight, scale, b))


def test_triton_int8_linear_reads_strided_rows_and_keeps_leading_dims() -> None:
    from kvloom.ops.cuda import Int8Linear

    torch.manual_seed(0)
    wide = torch.randn(6, 50, device=DEVICE)
    wide[:, 40:] = float("inf")  # past K: must not reach the sums
    qweight, scale = quantize_per_channel(torch.randn(24, 40))
    layer = Int8Linear(qweight.to(DEVICE), scale.to(DEVICE), None)
    x = wide[:, :40]
    assert_within(layer(x).cpu(), int8_linear_reference(x.cpu(), qweight, scale), ulps=1,
                  slack=weight_only_slack(x.cpu(), qweight, scale, None))
    assert layer(x.reshape(2, 3, 40)).shape == (2, 3, 24)


def test_triton_int8_linear_names_what_it_cannot_take() -> None:
    from kvloom.ops.triton.int8 import int8_linear

    x = torch.zeros(2, 8, device=DEVICE)
    weight_t = torch.zeros(8, 4, dtype=torch.int8, device=DEVICE)
    scale = torch.ones(4, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight_t must be a contiguous int8 \[K, N\] = \[8, 5\]"):
        int8_linear(torch.empty(2, 5, device=DEVICE), x, weight_t, torch.ones(5, device=DEVICE), None)
    with pytest.raises(ValueError, match="x must be float32, float16 or bfloat16"):
        int8_linear(torch.empty(2, 4, device=DEVICE, dtype=torch.float64), x.double(), weight_t, scale, None)
    with pytest.raises(ValueError, match=r"bias must be a contiguous float32 \[4\]"):
        int8_linear(torch.empty(2, 4, device=DEVICE), x, weight_t, scale, torch.ones(3, device=DEVICE))


@gpu
@pytest.mark.parametrize("rows", [1, 7, 64, 2048])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (1536, 576), (576, 49152), (130, 70)])
def test_gpu_triton_int8_linear_bf16_at_model_sizes(rows: int, k: int, n: int) -> None:
    x, qweight, scale, bias = problem(rows, k, n, torch.bfloat16, seed=rows + k + n)
    expected = int8_linear_reference(x, qweight, scale, bias)
    assert_within(triton_int8_linear(x, qweight, scale, bias), expected, ulps=1,
                  slack=weight_only_slack(x, qweight, scale, bias))


def test_select_ops_on_cuda_packs_int8_weights_for_triton() -> None:
    pytest.importorskip("triton")
    from kvloom.ops import cuda
    from kvloom.ops.table import _cuda_ops

    assert _cuda_ops().pack_linear_int8 is cuda.Int8Linear


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES)
def test_select_ops_packs_block_scaled_weights(dtype: torch.dtype) -> None:
    """The CPU kernel where it is built, torch ops under the reference backend: both the blocks' product."""
    x, qweight, scale, bias = problem(5, 96, 20, dtype, seed=2, blocks=True)
    expected = w8a8_blocks_linear_reference(x, qweight, scale, bias)
    slack = w8a8_blocks_slack(x, qweight, scale, bias)
    native = select_ops(torch.device("cpu"), dtype, "reference").pack_linear_int8_blocks(qweight, scale, bias)
    assert isinstance(native, NativeInt8BlocksLinear)
    # torch's GEMM on the dequantized blocks: the same function, summed in fp32 in another order.
    assert_within(native(x), expected, ulps=1, slack=slack + weight_only_slack(x, qweight, scale.amax(1), bias))
    layer = select_ops(torch.device("cpu"), dtype).pack_linear_int8_blocks(qweight, scale, bias)
    if cpu.int8_kernels_available():
        assert isinstance(layer, cpu.PackedInt8BlocksWeight)
        assert_within(layer(x.view(5, 1, 96)).view(5, 20), expected, ulps=1, slack=slack)


def test_cuda_packs_block_scaled_weights_per_row() -> None:
    """No block-scaled kernel on CUDA: the blocks re-quantized per row once, for the weight-only GEMM."""
    pytest.importorskip("triton")
    from kvloom.ops.table import _cuda_ops

    x, qweight, scale, bias = problem(3, 64, 10, torch.float32, seed=5, blocks=True)
    rows = Int8Blocks(qweight, scale).to_rows()
    layer = _cuda_ops().pack_linear_int8_blocks(qweight.to(DEVICE), scale.to(DEVICE), bias.to(DEVICE))
    assert_within(layer(x.to(DEVICE)).cpu(), int8_linear_reference(x, rows.qweight, rows.scale, bias), ulps=1,
                  slack=weight_only_slack(x, rows.qweight, rows.scale, bias))


def test_smoothing_moves_outlier_channels_into_the_weights_and_lowers_the_w8a8_error() -> None:
    """SmoothQuant's factors on a layer whose activations have a few huge channels (as LLMs' do): the
    product is unchanged in float, and W8A8's error drops well below the unsmoothed one."""
    from kvloom.layers import smoothing

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=generator, dtype=torch.float64)
    x[:, [3, 77, 200]] *= 60
    w = torch.randn(128, 256, generator=generator, dtype=torch.float64) * 0.05
    exact = x @ w.t()

    def w8a8_error(xs: torch.Tensor, ws: torch.Tensor) -> float:
        out = w8a8_linear_reference(xs.float(), *quantize_per_channel(ws.float())).double()
        return ((out - exact).norm() / exact.norm()).item()

    s = smoothing.factors(x.abs().amax(0).float(), w.abs().amax(0).float(), 0.5).double()
    torch.testing.assert_close((x / s) @ (w * s).t(), exact)
    assert w8a8_error(x / s, w * s) < 0.5 * w8a8_error(x, w)


def test_smoothing_factors_leave_a_dead_channel_alone() -> None:
    from kvloom.layers import smoothing

    s = smoothing.factors(torch.tensor([4.0, 0.0, 1.0]), torch.tensor([1.0, 2.0, 0.0]), 0.5)
    assert torch.equal(s, torch.tensor([2.0, 1.0, 1.0]))


@pytest.mark.parametrize("flip", [False, True])
def test_the_c_plus_plus_int8_packing_equals_torchs(flip: bool) -> None:
    """pack_int8_weight's one C++ pass (pack_int8_panels) gives the torch reference's bytes: whole and partial panels
    of 48 columns and groups of 4 inputs, padding included (0x80 once flipped), rows any stride apart."""
    if not cpu.cpu_kernel_available():
        pytest.skip("the CPU kernels could not be built here")
    g = torch.Generator().manual_seed(3)
    for n, k in ((1, 4), (47, 33), (48, 64), (97, 3), (130, 258)):
        wide = torch.randint(-128, 128, (n, k + 5), generator=g, dtype=torch.int8)
        for q in (wide[:, :k].contiguous(), wide[:, 2:k + 2]):
            packed = torch.ops.kvloom.pack_int8_panels(q, flip)
            assert torch.equal(packed, cpu.pack_int8_weight_reference(q, flip)), (n, k, flip)
            assert torch.equal(cpu.pack_int8_weight(q, flip), packed)

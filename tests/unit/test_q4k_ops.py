"""The k-quant product on the file's super-blocks (csrc/gemm_q4k.cpp, kvloom/ops/q4k.py) against its references.

The packing is the file's bytes rearranged (no decoding): its rows read back as the file's bytes, and decoded equal
gguf's own dequantization. The product takes the same fp32 steps in the same order as the code-block product
(csrc/gemm_q4.cpp) on the decoded weight, so on a weight all Q4_K or all Q6_K it equals PackedQ4Weight's result bit
for bit, and q4_linear_reference's within an ulp and a few fp32 roundings per group; Q4_K rows beside Q6_K ones give
each part's own result; its AVX2 and plain-loop versions agree bit for bit, and a row's result does not depend on
the rows beside it. Run with KVLOOM_CPU_ISA=generic too: the library's generic build is the plain loops alone.
"""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
import torch

from kvloom.ops import cpu
from kvloom.ops.q4 import NativeQ4Linear, PackedQ4Weight, Q4Blocks
from kvloom.ops.q4k import (
    PANEL_SUPER_BYTES,
    Q6_K_PANEL_SUPER_BYTES,
    Q6_K_SUPER_BYTES,
    SUPER_BYTES,
    KQuantRows,
    PackedKQuantWeight,
    Q4KBlocks,
    Q6KBlocks,
    pack_code_blocks,
    q4k_linear_reference,
)
from kvloom.worker import packed_cache
from unit.test_int8_ops import DTYPE_NAMES, DTYPES, assert_within
from unit.test_q4_ops import q4_slack

# (M, K, N): one row, whole and partial 4-row kernels, one and several super-blocks, N past a panel of 8.
SHAPES = [(1, 256, 37), (2, 512, 64), (5, 768, 19), (17, 256, 8), (33, 1024, 97)]


@pytest.fixture(scope="module")
def kernels() -> None:
    if not cpu.cpu_kernel_available():
        pytest.skip("the CPU kernels could not be built here")


def random_q4_k(n: int, k: int, seed: int, llama_cpp: bool = False) -> Q4KBlocks:
    """Random Q4_K super-blocks: every scale, min and code byte random (all 6 and 4 bits taken), d and dmin positive
    fp16 values; ``llama_cpp``: block 0's scale and min 63, the largest, as llama.cpp's quantizer makes them (then
    PackedQ4Weight holds the scales in two levels, else one level of fp32)."""
    rng = np.random.default_rng(seed)
    count = n * k // 256
    raw = rng.integers(0, 256, size=(count, SUPER_BYTES), dtype=np.uint8)
    for offset, top in ((0, 0.002), (2, 0.004)):
        raw[:, offset:offset + 2] = rng.uniform(1e-4, top, count).astype(np.float16).view(np.uint8).reshape(count, 2)
    if llama_cpp:
        raw[:, 4] |= 63
        raw[:, 8] |= 63
    return Q4KBlocks.from_gguf(torch.from_numpy(raw.reshape(-1).copy()), (n, k))


def random_q6_k(n: int, k: int, seed: int, llama_cpp: bool = False) -> Q6KBlocks:
    """Random Q6_K super-blocks: every code and int8 scale byte random, d a positive fp16 value; ``llama_cpp``: group
    0's scale -128, the largest magnitude, as llama.cpp's quantizer makes it (PackedQ4Weight's two levels)."""
    rng = np.random.default_rng(seed)
    count = n * k // 256
    raw = rng.integers(0, 256, size=(count, Q6_K_SUPER_BYTES), dtype=np.uint8)
    raw[:, 208:210] = rng.uniform(1e-5, 2e-4, count).astype(np.float16).view(np.uint8).reshape(count, 2)
    if llama_cpp:
        raw[:, 192] = 0x80
    return Q6KBlocks.from_gguf(torch.from_numpy(raw.reshape(-1).copy()), (n, k))


def random_weight(kind: str, n: int, k: int, seed: int) -> Q4KBlocks | Q6KBlocks | KQuantRows:
    """``kind``: "q4_k", "q6_k" (with "_llama": llama.cpp's largest sub-scales), or "mixed" (the first 8 * (n // 16)
    rows Q4_K, the rest Q6_K)."""
    if kind.startswith("q4_k"):
        return random_q4_k(n, k, seed, llama_cpp=kind.endswith("_llama"))
    if kind.startswith("q6_k"):
        return random_q6_k(n, k, seed, llama_cpp=kind.endswith("_llama"))
    head = 8 * max(1, n // 16)  # n = 8: Q4_K rows alone
    return KQuantRows.of(random_q4_k(head, k, seed), random_q6_k(n - head, k, seed + 1) if n > head else None)


def test_q6_k_super_blocks_decode_as_the_gguf_package_dequantizes() -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    weight = random_q6_k(3, 512, seed=12)
    expected = dequantize(weight.data.numpy(), GGMLQuantizationType.Q6_K)
    assert torch.equal(weight.dequantize(), torch.from_numpy(expected))
    assert weight.to_blocks().group == 16
    with pytest.raises(ValueError, match="multiple of 256"):
        Q6KBlocks.from_gguf(torch.zeros(2 * Q6_K_SUPER_BYTES, dtype=torch.uint8), (2, 320))


def test_super_blocks_decode_as_the_gguf_package_dequantizes() -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    weight = random_q4_k(5, 512, seed=1)
    expected = dequantize(weight.data.numpy(), GGMLQuantizationType.Q4_K)
    assert torch.equal(weight.dequantize(), torch.from_numpy(expected))
    blocks = weight.to_blocks()
    assert blocks.group == 32 and int(blocks.codes.max()) == 15
    with pytest.raises(ValueError, match="multiple of 256"):
        Q4KBlocks.from_gguf(torch.zeros(2 * SUPER_BYTES, dtype=torch.uint8), (2, 320))
    with pytest.raises(ValueError, match="do not hold a Q4_K weight"):
        Q4KBlocks.from_gguf(torch.zeros(3 * SUPER_BYTES, dtype=torch.uint8), (2, 256))


def test_packed_bytes_are_the_files_and_read_back_as_its_rows(kernels: None) -> None:
    """Packed at the file's size (to whole panels of 8 rows), and rows() gives back the decoded rows exactly."""
    n, k = 21, 768
    weight = random_q4_k(n, k, seed=2)
    packed = PackedKQuantWeight(weight, None)
    assert packed.q4_k.shape == (3, 3, PANEL_SUPER_BYTES) and packed.q6_k.numel() == 0
    assert packed.q4_k.numel() == 24 * weight.data.shape[1]  # the file's bytes for 24 rows: 4.5 bits a weight
    ids = torch.tensor([0, 7, 8, 20, 13, 20])
    assert torch.equal(q4k_rows(packed, ids), weight.data[ids])
    rows, expected = packed.rows(ids), weight.take(ids).to_blocks()
    assert all(torch.equal(a, b) for a, b in zip(rows, expected))
    six = random_q6_k(n, k, seed=3)
    packed = PackedKQuantWeight(six, None)
    assert packed.q6_k.shape == (3, 3, Q6_K_PANEL_SUPER_BYTES) and packed.q4_k.numel() == 0
    assert torch.equal(q6k_rows(packed, ids), six.data[ids])
    assert all(torch.equal(a, b) for a, b in zip(packed.rows(ids), six.take(ids).to_blocks()))
    mixed = KQuantRows.of(random_q4_k(16, k, seed=4), six)
    packed = PackedKQuantWeight(mixed, None)
    ids = torch.tensor([0, 15, 16, 36, 3, 20])
    assert all(torch.equal(a, b) for a, b in zip(packed.rows(ids), mixed.to_blocks().take(ids)))


def q4k_rows(packed: PackedKQuantWeight, ids: torch.Tensor) -> torch.Tensor:
    from kvloom.ops.q4k import packed_q4k_rows

    return packed_q4k_rows(packed.q4_k, ids, packed.in_features).data


def q6k_rows(packed: PackedKQuantWeight, ids: torch.Tensor) -> torch.Tensor:
    from kvloom.ops.q4k import packed_q6k_rows

    return packed_q6k_rows(packed.q6_k, ids, packed.in_features).data


def test_pack_rejects_what_is_no_q4_k_weight(kernels: None) -> None:
    with pytest.raises(RuntimeError, match="multiple of 256"):
        torch.ops.kvloom.pack_q4k(torch.zeros(144, dtype=torch.uint8), 1, 320)
    with pytest.raises(RuntimeError, match="contiguous uint8 bytes of a Q4_K"):
        torch.ops.kvloom.pack_q4k(torch.zeros(100, dtype=torch.uint8), 1, 256)
    with pytest.raises(RuntimeError, match="contiguous uint8 bytes of a Q6_K"):
        torch.ops.kvloom.pack_q6k(torch.zeros(100, dtype=torch.uint8), 1, 256)
    with pytest.raises(ValueError, match="whole panels of 8"):
        PackedKQuantWeight(KQuantRows.of(random_q4_k(12, 256, seed=1), random_q6_k(4, 256, seed=1)), None)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES)
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("kind", ["q4_k", "q4_k_llama", "q6_k", "q6_k_llama", "mixed"])
def test_k_quant_product_equals_the_code_block_product_bit_for_bit(kernels: None, kind: str, dtype: torch.dtype,
                                                                   m: int, k: int, n: int) -> None:
    """All Q4_K or all Q6_K: PackedQ4Weight's result on the decoded blocks, bit for bit; Q4_K rows then Q6_K ones:
    each part's own. Within fp32 roundings of the reference, and the plain loops equal to the vector kernel."""
    weight = random_weight(kind, n, k, seed=m + k + n)
    blocks = weight.to_blocks()
    for with_bias in (True, False):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * k)).to(dtype)
        bias = torch.randn(n) if with_bias else None
        fast = PackedKQuantWeight(weight, bias)(x)
        assert fast.dtype == dtype and fast.shape == (m, n)
        assert torch.equal(PackedKQuantWeight(weight, bias, portable=True)(x), fast)
        if kind == "mixed" and weight.q6_k:
            (four,), (six,) = weight.q4_k, weight.q6_k
            head = four.shape[0]
            for part, columns in ((four, slice(0, head)), (six, slice(head, n))):
                part_bias = None if bias is None else bias[columns].contiguous()
                assert torch.equal(PackedQ4Weight(part.to_blocks(), part_bias, bf16_tiles=False)(x), fast[:, columns])
        else:
            old = PackedQ4Weight(blocks, bias, bf16_tiles=False)
            # the code blocks' scales in two levels (fp16 per 256, int8 per group) from llama.cpp's sub-scales
            assert (old.scales.dtype == torch.uint8) == kind.endswith("_llama")
            assert torch.equal(old(x), fast)
        expected = q4k_linear_reference(x, weight, bias)
        assert_within(fast, expected, ulps=1, slack=q4_slack(x, blocks, bias))
        assert_within(NativeQ4Linear(weight, bias)(x), expected, ulps=1, slack=q4_slack(x, blocks, bias) * 64)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES)
@pytest.mark.parametrize("kind", ["q4_k_llama", "q6_k", "mixed"])
def test_the_panels_unpacked_for_the_code_block_kernels_give_the_same_product(kernels: None, kind: str,
                                                                              dtype: torch.dtype) -> None:
    """From a few rows a call unpacks each panel into the code-block layout and takes those kernels (VNNI's, and from
    16 rows AMX-INT8 tiles where the CPU has them): the same integers and fp32 steps, so the same bits as the k-quant
    kernels, at row counts below, at and past each kernel's rows, forced both ways on every CPU."""
    k, n = 512, 45
    weight = random_weight(kind, n, k, seed=11)
    packed = PackedKQuantWeight(weight, torch.randn(n))
    for m in (1, 3, 8, 16, 21, 40):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        outs = []
        for unpacked_from in (0, 1, -1):
            y = torch.empty(m, n, dtype=dtype)
            torch.ops.kvloom.gemm_kquant(y, x, packed.q4_k, packed.q6_k, packed.bias, False, unpacked_from)
            outs.append(y)
        assert torch.equal(outs[1], outs[0]), (kind, m)
        assert torch.equal(outs[2], outs[0]), (kind, m)


@pytest.mark.parametrize("kind", ["q4_k_llama", "q6_k_llama"])
def test_with_bf16_tiles_the_unpacked_panels_take_the_code_blocks_dequantizing_product(kernels: None,
                                                                                        kind: str) -> None:
    """Where batch-dependent products are allowed (``bf16_tiles``): bf16 rows take what PackedQ4Weight's dequantizing
    AMX-BF16 product gives the decoded blocks, bit for bit, at every row count (on a CPU without those tiles both
    keep the int8 product)."""
    k, n = 512, 40
    weight = random_weight(kind, n, k, seed=12)
    bias = torch.randn(n)
    tiled = PackedKQuantWeight(weight, bias, bf16_tiles=True)
    code_blocks = PackedQ4Weight(weight.to_blocks(), bias, bf16_tiles=True)
    for m in (1, 15, 16, 37):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        assert torch.equal(tiled(x), code_blocks(x)), m


def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernels: None) -> None:
    """One formula at every row count: each row of a 13-row product equals that row's product alone."""
    weight = KQuantRows.of(random_q4_k(32, 512, seed=5), random_q6_k(13, 512, seed=5))
    packed = PackedKQuantWeight(weight, torch.randn(45))
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(5))
    together = packed(x)
    for i in range(13):
        assert torch.equal(packed(x[i:i + 1]), together[i:i + 1])


def test_activations_are_checked(kernels: None) -> None:
    packed = PackedKQuantWeight(random_q4_k(8, 256, seed=6), None)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        packed(torch.zeros(1, 256, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="do not match"):
        torch.ops.kvloom.gemm_kquant(torch.empty(1, 8), torch.zeros(1, 512), packed.q4_k, packed.q6_k, None)
    with pytest.raises(ValueError, match="bias must have shape"):
        PackedKQuantWeight(random_q4_k(8, 256, seed=6), torch.zeros(3))


def test_the_cpu_table_packs_q4_k_super_blocks_and_other_code_blocks_apart(kernels: None) -> None:
    weight = random_q4_k(16, 256, seed=7)
    assert isinstance(pack_code_blocks(weight, None), PackedKQuantWeight)
    assert isinstance(pack_code_blocks(KQuantRows.of(None, random_q6_k(8, 256, seed=7)), None), PackedKQuantWeight)
    assert isinstance(pack_code_blocks(weight.to_blocks(), None), PackedQ4Weight)
    assert isinstance(NativeQ4Linear(weight, None).weight, Q4Blocks)


def test_the_packed_weight_pickles_as_the_packed_cache_saves_it(kernels: None) -> None:
    weight = random_q4_k(19, 512, seed=8)
    packed = PackedKQuantWeight(weight, torch.randn(19))
    buffer = io.BytesIO()
    torch.save({"w": packed}, buffer, pickle_module=packed_cache._PickleModule)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False, pickle_module=pickle)["w"]
    x = torch.randn(3, 512)
    assert torch.equal(loaded(x), packed(x))
    assert loaded.stack_args()[0] == packed.stack_args()[0]


def test_a_layer_keeps_super_block_shards_and_decodes_them_beside_other_kinds() -> None:
    """Q4_K shards, then Q6_K ones (the Q4_K rows whole panels): held as the file's bytes and packed so; a shard of
    another kind before or after them, or Q4_K rows short of a panel before Q6_K ones: every shard decoded into the
    code blocks, exactly."""
    from kvloom.layers.linear import Linear
    from kvloom.ops.table import REFERENCE_OPS

    q, k, v = random_q4_k(16, 256, seed=9), random_q4_k(8, 256, seed=10), random_q6_k(8, 256, seed=13)
    layer = Linear(256, [16, 8, 8])
    for shard, tensor in enumerate((q, k, v)):
        layer.load_shard("weight", shard, tensor)
    assert layer.q4 is None and set(layer.super_blocks) == {0, 1, 2}
    x = torch.randn(3, 256)
    whole = KQuantRows.of(Q4KBlocks(torch.cat((q.data, k.data))), v)
    assert torch.equal(layer(x), q4k_linear_reference(x, whole))
    layer.process_weights_after_loading(REFERENCE_OPS)
    assert not layer.super_blocks and layer.weight.numel() == 0
    assert all(torch.equal(a, b) for a, b in zip(layer.packed.weight, whole.to_blocks()))
    other = Q4Blocks.quantize(torch.randn(8, 256))
    for order in ((0, 1), (1, 0)):
        mixed = Linear(256, [16, 8])
        for shard in order:
            mixed.load_shard("weight", shard, (q, other)[shard])
        assert not mixed.super_blocks and mixed.q4_shards == {0, 1}
        expected = [torch.cat(parts) for parts in zip(q.to_blocks(), other)]
        assert all(torch.equal(a, b) for a, b in zip(mixed.q4, expected))
    short = Linear(256, [4, 8])  # 4 Q4_K rows before Q6_K ones: no whole panel
    short.load_shard("weight", 0, q.take(torch.arange(4)))
    short.load_shard("weight", 1, v)
    short.process_weights_after_loading(REFERENCE_OPS)
    assert short.packed.weight.group == 16 and not short.super_blocks
    with pytest.raises(ValueError, match="only fill a weight"):
        Linear(256, [16], bias=True).load_shard("bias", 0, q)


def test_tensor_parallel_cuts_super_block_rows_and_whole_super_blocks() -> None:
    from kvloom.layers import tensor_parallel
    from kvloom.layers.linear import Linear

    weight, six = random_q4_k(16, 512, seed=11), random_q6_k(8, 512, seed=14)
    out = Linear(512, [8, 8, 8])
    out.load_shard("weight", 0, weight.take(torch.arange(8)))
    out.load_shard("weight", 1, weight.take(torch.arange(8, 16)))
    out.load_shard("weight", 2, six)
    tensor_parallel._shard_columns_out(out, 1, 2)  # rank 1 keeps rows 4-7 of each shard
    assert torch.equal(out.super_blocks[1].data, weight.data[12:16])
    assert torch.equal(out.super_blocks[2].data, six.data[4:8])
    cut = Linear(512, [16, 8])
    cut.load_shard("weight", 0, weight)
    cut.load_shard("weight", 1, six)
    tensor_parallel._shard_rows_in(cut, 1, 2, None)  # rank 1: inputs 256-511, each row's second super-block
    assert torch.equal(cut.super_blocks[0].data, weight.data[:, 144:])
    assert torch.equal(cut.super_blocks[1].data, six.data[:, 210:])
    odd = Linear(512, [16])
    odd.load_shard("weight", 0, weight)
    tensor_parallel._shard_rows_in(odd, 1, 4, None)  # 128 inputs a rank: decoded, then cut per block of 32
    assert not odd.super_blocks and torch.equal(odd.q4.codes, weight.to_blocks().codes[:, 128:256])

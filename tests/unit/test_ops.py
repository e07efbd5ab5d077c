"""Every fast op against its plain-torch reference."""

from __future__ import annotations

import pytest
import torch
from paged_batch import place_requests

from kvloom.ops import native
from kvloom.ops.metadata import AttentionMetadata
from kvloom.ops.native import attention as attention_native
from kvloom.ops.reference import apply_rotary_reference, attention_reference, rms_norm_reference, silu_and_mul


def build_batch(query_lens: list[int], context_lens: list[int], block_size: int, num_blocks: int,
                sliding_window: int | None, seed: int = 0):
    """A random paged cache holding each request's context, and this step's new tokens."""
    placed = place_requests(query_lens, context_lens, block_size, num_blocks, seed)
    num_decodes = placed.num_decodes
    decode_blocks = len(placed.block_tables[0]) if num_decodes else 0
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(placed.slot_mapping), block_table=torch.tensor(placed.block_tables),
        seq_lens=torch.tensor(placed.seq_lens), query_start_loc=placed.query_start_loc,
        seq_lens_host=placed.seq_lens, num_decodes=num_decodes, block_size=block_size,
        sliding_window=sliding_window, decode_num_blocks=decode_blocks)
    if num_decodes:
        key_pos = torch.arange(decode_blocks * block_size)[None, :]
        lens = metadata.seq_lens[:num_decodes, None]
        mask = key_pos < lens
        if sliding_window is not None:
            mask &= key_pos > lens - 1 - sliding_window
        metadata.decode_mask = mask[:, None, None, :]
    return metadata


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_native_attention_matches_reference(dtype: torch.dtype, sliding_window: int | None) -> None:
    torch.manual_seed(0)
    block_size, num_blocks, heads, kv_heads, dim = 4, 64, 4, 2, 16
    # Decodes first (one new token), then a fresh prefill and a chunk that continues a context.
    query_lens = [1, 1, 1, 7, 6]
    context_lens = [3, 12, 0, 0, 9]
    metadata = build_batch(query_lens, context_lens, block_size, num_blocks, sliding_window)
    total = sum(query_lens)
    cache_shape = (num_blocks, block_size, kv_heads, dim)
    key_cache = torch.randn(cache_shape, dtype=dtype)
    value_cache = torch.randn(cache_shape, dtype=dtype)
    key_cache[0] = 0
    value_cache[0] = 0
    q = torch.randn(total, heads, dim, dtype=dtype)
    k = torch.randn(total, kv_heads, dim, dtype=dtype)
    v = torch.randn(total, kv_heads, dim, dtype=dtype)
    ref_caches = (key_cache.clone(), value_cache.clone())
    expected = attention_reference(q, k, v, *ref_caches, metadata, dim ** -0.5)
    got = attention_native(q, k, v, key_cache, value_cache, metadata, dim ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(key_cache, ref_caches[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_native_matches_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(7, 64, dtype=dtype) * 3
    weight = torch.randn(64, dtype=dtype)
    # bf16: the fast kernel rounds once, the reference twice; they differ by about one ulp (2^-7).
    torch.testing.assert_close(native.rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5),
                               atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 1.6e-2)


def test_rotary_native_matches_reference_in_bf16() -> None:
    from kvloom.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    rotary = RotaryEmbedding(64, 512, 10000.0)
    positions = torch.randint(0, 512, (11,))
    x = torch.randn(11, 6, 64, dtype=torch.bfloat16)
    cos, sin = rotary.cos_cache[positions], rotary.sin_cache[positions]
    expected = apply_rotary_reference(x, cos, sin)
    torch.testing.assert_close(rotary(positions, x), expected, atol=3e-2, rtol=2e-2)
    # fp32 takes the reference path exactly.
    x32 = x.float()
    torch.testing.assert_close(rotary(positions, x32), apply_rotary_reference(x32, cos, sin), atol=0, rtol=0)


@pytest.fixture(scope="module")
def fused_ops() -> None:
    from kvloom.ops.cpu import cpu_kernel_available, load_cpu_kernel

    if not cpu_kernel_available():
        pytest.skip(f"the CPU kernels could not be built: {load_cpu_kernel()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cpu_norm_rotary_activation_match_references(fused_ops, dtype: torch.dtype) -> None:
    from kvloom.layers.activation import SiluAndMul
    from kvloom.layers.norm import RMSNorm
    from kvloom.layers.rotary import RotaryEmbedding
    from kvloom.ops.table import select_ops

    ops = select_ops(torch.device("cpu"), dtype)
    assert ops.name == "cpu"
    torch.manual_seed(0)
    exact = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1.6e-2)
    norm = RMSNorm(96, 1e-5, ops).to(dtype)
    norm.weight.data.normal_()
    x, residual = torch.randn(13, 96, dtype=dtype), torch.randn(13, 96, dtype=dtype)
    expected_sum = x + residual
    expected = rms_norm_reference(expected_sum, norm.weight, 1e-5)
    torch.testing.assert_close(norm(x.clone()), rms_norm_reference(x, norm.weight, 1e-5), **exact)
    got, got_sum = norm(x.clone(), residual.clone())
    torch.testing.assert_close(got_sum, expected_sum, atol=0, rtol=0)
    torch.testing.assert_close(got, expected, **exact)

    rotary = RotaryEmbedding(32, 256, 10000.0, ops=ops)
    positions = torch.randint(0, 256, (13,))
    qkv = torch.randn(13, 7, 32, dtype=dtype)
    expected = apply_rotary_reference(qkv[:, :5], rotary.cos_cache[positions], rotary.sin_cache[positions])
    got = rotary(positions, qkv[:, :5])  # a strided view, rotated in place
    torch.testing.assert_close(got, expected, **exact)
    torch.testing.assert_close(qkv[:, :5], expected, **exact)

    act = SiluAndMul(ops)
    x = torch.randn(13, 2 * 48, dtype=dtype)
    torch.testing.assert_close(act(x), silu_and_mul(x), **exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cpu_argmax_matches_torch(fused_ops, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = torch.randn(9, 1000).to(dtype)
    logits[3, 10] = logits[3, 500] = 50.0  # ties go to the first index, as in torch
    out = torch.empty(9, dtype=torch.long)
    torch.ops.kvloom.argmax_rows(out, logits)
    assert torch.equal(out, logits.float().argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_cpu_argmax_nan_infinities_and_ties_match_torch(fused_ops, dtype: torch.dtype) -> None:
    """torch.argmax takes NaN for the largest value (the first NaN wins) and the first of equal maxima,
    wherever they are: in the kernel's vector body, across its blocks, or in the tail after them."""
    torch.manual_seed(0)
    nan, inf = float("nan"), float("inf")
    cols = 3 * 1024 + 37  # a few of the kernel's blocks, then a tail shorter than a vector
    logits = torch.randn(13, cols).to(dtype)
    logits[0, 2000] = nan  # after the block holding the largest number
    logits[1, 5] = logits[1, 2500] = nan
    logits[2, cols - 1] = nan  # in the tail
    logits[3, 700] = -torch.tensor(nan)  # a NaN with its sign bit set, as 0 * inf gives on x86
    logits[4].fill_(-inf)
    logits[5].fill_(nan)
    logits[6, 3000] = logits[6, 10] = inf
    logits[7].zero_()
    logits[7, :50] = -0.0  # -0 == +0: the first zero
    logits[8, cols - 2] = 100.0  # the largest in the tail
    logits[9, 1023] = logits[9, 1024] = 100.0  # a tie across a block boundary
    logits[10, 2048] = logits[10, cols - 3] = 100.0  # a tie between the vector body and the tail
    logits[11, 0] = -inf
    logits[11, 1:] = -1e4  # the largest finite value comes after -inf
    out = torch.empty(13, dtype=torch.long)
    torch.ops.kvloom.argmax_rows(out, logits)
    assert out.tolist() == logits.argmax(dim=-1).tolist()

    for width in (1, 5, 16, 17, 33, 1024, 1025):  # shorter than a vector, one, one and a tail, ...
        logits = torch.randint(-3, 4, (6, width)).to(dtype)  # small integers: many ties
        logits[0, width // 2] = nan
        out = torch.empty(6, dtype=torch.long)
        torch.ops.kvloom.argmax_rows(out, logits)
        assert out.tolist() == logits.argmax(dim=-1).tolist(), width


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, width", [(1, 7), (3, 100), (64, 576), (200, 48)])
def test_fused_cpu_ops_match_references_at_any_width(fused_ops, dtype: torch.dtype, rows: int, width: int) -> None:
    """Widths that are no multiple of the vector (a scalar tail after the vector body), a single row,
    and enough rows for the ops to split them between threads."""
    torch.manual_seed(0)
    tol = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
           torch.float16: dict(atol=1e-3, rtol=2e-3)}[dtype]
    weight = torch.randn(width, dtype=dtype)
    x, residual = torch.randn(rows, width, dtype=dtype) * 3, torch.randn(rows, width, dtype=dtype)
    out = torch.empty_like(x)
    torch.ops.kvloom.rms_norm(out, x, weight, 1e-5)
    torch.testing.assert_close(out, rms_norm_reference(x, weight, 1e-5), **tol)
    got, got_sum = x.clone(), residual.clone()
    torch.ops.kvloom.fused_add_rms_norm(got, got_sum, weight, 1e-5)
    torch.testing.assert_close(got_sum, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(got, rms_norm_reference(x + residual, weight, 1e-5), **tol)

    gate_up = torch.randn(rows, 2 * width, dtype=dtype) * 3
    out = torch.empty(rows, width, dtype=dtype)
    torch.ops.kvloom.silu_and_mul(out, gate_up)
    torch.testing.assert_close(out, silu_and_mul(gate_up), **tol)

    # Rotary over heads of 2 * width values (halves of `width`): a strided view of 3 of 4 heads.
    angles = torch.outer(torch.arange(64, dtype=torch.float32), torch.rand(width))
    positions = torch.randint(0, 64, (rows,))
    qkv = torch.randn(rows, 4, 2 * width, dtype=dtype)
    expected = apply_rotary_reference(qkv[:, :3], angles.cos()[positions], angles.sin()[positions])
    untouched = qkv[:, 3].clone()
    torch.ops.kvloom.rotary_embedding(qkv[:, :3], positions, angles.cos(), angles.sin())
    torch.testing.assert_close(qkv[:, :3], expected, **tol)
    assert torch.equal(qkv[:, 3], untouched)

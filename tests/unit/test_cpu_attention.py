"""The C++ CPU attention kernel against the reference, over mixed flat batches of the paged cache."""

from __future__ import annotations

import logging

import pytest
import torch
from paged_batch import place_requests

from kvloom.ops import cpu
from kvloom.ops.cpu import attention as attention_cpu
from kvloom.ops.metadata import AttentionMetadata
from kvloom.ops.native import attention as attention_native
from kvloom.ops.reference import attention_reference
from kvloom.ops.table import select_ops

# (new tokens, context already cached): decodes first (one new token), then a fresh prompt, a chunk
# that continues a cached context, and a prompt longer than one query tile of the kernel.
MIXED_BATCH = [(1, 0), (1, 16), (1, 37), (1, 63), (7, 0), (20, 13), (45, 0)]


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    """Builds the kernel once for the module (cold: about a minute; then loaded from the cache)."""
    error = cpu.load_cpu_kernel()
    if error is not None:
        pytest.skip(f"the CPU attention kernel cannot be built here: {error}")


def build_batch(batch: list[tuple[int, int]], block_size: int, sliding_window: int | None,
                seed: int = 0) -> tuple[AttentionMetadata, int]:
    """Metadata for requests placed in shuffled blocks; returns it and the cache's block count."""
    placed = place_requests([q for q, _ in batch], [c for _, c in batch], block_size, seed=seed)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(placed.slot_mapping), block_table=torch.tensor(placed.block_tables),
        seq_lens=torch.tensor(placed.seq_lens), query_start_loc=placed.query_start_loc,
        seq_lens_host=placed.seq_lens, num_decodes=placed.num_decodes, block_size=block_size,
        sliding_window=sliding_window)
    return metadata, placed.num_blocks


def in_pairs(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows caches [num_blocks, block_size, Hkv, D] in the pairs layout (ops/reference.py allocate_kv_cache)."""
    blocks, block_size, kv_heads, head_dim = key_cache.shape
    keys = key_cache.view(blocks, block_size, kv_heads, head_dim // 2, 2).permute(0, 2, 3, 1, 4)
    values = value_cache.view(blocks, block_size // 2, 2, kv_heads, head_dim).permute(0, 3, 1, 4, 2)
    return keys.contiguous(), values.contiguous()


def random_step(batch: list[tuple[int, int]], block_size: int, sliding_window: int | None, heads: int,
                kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """Metadata, this step's q/k/v and a cache whose contexts hold random keys and values."""
    torch.manual_seed(seed)
    metadata, num_blocks = build_batch(batch, block_size, sliding_window, seed)
    tokens = metadata.query_start_loc[-1]
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    key_cache[0] = 0
    value_cache[0] = 0
    qkv = (torch.randn(tokens, heads, head_dim, dtype=dtype), torch.randn(tokens, kv_heads, head_dim, dtype=dtype),
           torch.randn(tokens, kv_heads, head_dim, dtype=dtype))
    return metadata, qkv, key_cache, value_cache


def assert_matches_reference(metadata, qkv, key_cache, value_cache, logit_softcap: float | None = None,
                             **tolerance) -> None:
    head_dim = qkv[0].shape[-1]
    ref_caches = (key_cache.clone(), value_cache.clone())
    expected = attention_reference(*qkv, *ref_caches, metadata, head_dim ** -0.5, logit_softcap=logit_softcap)
    got = attention_cpu(*qkv, key_cache, value_cache, metadata, head_dim ** -0.5, logit_softcap=logit_softcap)
    torch.testing.assert_close(got, expected, **tolerance)
    torch.testing.assert_close(key_cache, ref_caches[0], atol=0, rtol=0)
    torch.testing.assert_close(value_cache, ref_caches[1], atol=0, rtol=0)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 6, 40])
@pytest.mark.parametrize("block_size", [1, 16, 64])  # 64: every request fits one block
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (3, 3), (2, 4)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch_matches_reference(dtype: torch.dtype, sliding_window: int | None, block_size: int,
                                       kv_heads: int, group: int, head_dim: int) -> None:
    step = random_step(MIXED_BATCH, block_size, sliding_window, kv_heads * group, kv_heads, head_dim, dtype)
    assert_matches_reference(*step, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 20])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("num_decodes", [1, 2, 5])
def test_decodes_over_one_two_or_all_kv_heads_per_item(dtype: torch.dtype, sliding_window: int | None,
                                                        block_size: int, num_decodes: int) -> None:
    """With one thread, 1, 2 and 5 decodes over 4 kv heads make items of 1, 2 and 4 heads (whole slots)."""
    batch = [(1, 11 + 29 * i) for i in range(num_decodes)] + [(9, 30)]
    step = random_step(batch, block_size, sliding_window, 8, 4, 64, dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert_matches_reference(*step, **tolerance(dtype))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 72, 80, 96, 256])
def test_other_head_sizes(dtype: torch.dtype, head_dim: int) -> None:
    """Sizes off the vector width (a scalar tail) and, in bf16, off the pair kernel's multiple of 32."""
    step = random_step(MIXED_BATCH, 16, None, 4, 2, head_dim, dtype)
    assert_matches_reference(*step, **tolerance(dtype))


def test_only_decodes_and_only_prefills() -> None:
    for batch in ([(1, c) for c in range(0, 90, 7)], [(q, 0) for q in (1, 2, 33, 64, 100)]):
        step = random_step(batch, 16, None, 9, 3, 64, torch.bfloat16)
        assert_matches_reference(*step, **tolerance(torch.bfloat16))


def test_float16() -> None:
    step = random_step(MIXED_BATCH, 16, 24, 6, 2, 64, torch.float16)
    assert_matches_reference(*step, atol=2e-3, rtol=2e-3)


def test_strided_query_and_cache_views() -> None:
    """A query sliced out of a fused qkv output and caches that are views of one bigger tensor."""
    metadata, (q, k, v), key_cache, value_cache = random_step(MIXED_BATCH, 16, None, 6, 2, 64, torch.float32)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    query = qkv[:, :6 * 64].view(-1, 6, 64)
    assert not query.is_contiguous()
    both = torch.stack([key_cache, value_cache], dim=2)  # [blocks, block_size, 2, Hkv, D]
    got = attention_cpu(query, k, v, both[:, :, 0], both[:, :, 1], metadata, 0.125)
    expected = attention_reference(q, k, v, key_cache, value_cache, metadata, 0.125)
    torch.testing.assert_close(got, expected, **tolerance(torch.float32))


def test_same_result_on_one_thread() -> None:
    """Each output row is computed by one thread in a fixed order, so the thread count cannot change it."""
    metadata, qkv, key_cache, value_cache = random_step(MIXED_BATCH, 16, 6, 9, 3, 64, torch.bfloat16)
    many = attention_cpu(*qkv, key_cache, value_cache, metadata, 0.125)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = attention_cpu(*qkv, key_cache, value_cache, metadata, 0.125)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, many, atol=0, rtol=0)


def test_query_start_loc_tensor_is_built_once_per_step() -> None:
    metadata, qkv, key_cache, value_cache = random_step(MIXED_BATCH, 16, None, 4, 2, 64, torch.float32)
    attention_cpu(*qkv, key_cache, value_cache, metadata, 0.125)
    built = metadata.query_start_loc_tensor
    assert built is not None and built.tolist() == metadata.query_start_loc
    attention_cpu(*qkv, key_cache, value_cache, metadata, 0.125)
    assert metadata.query_start_loc_tensor is built


needs_pairs = pytest.mark.skipif(
    not cpu.cpu_kernel_available() or not torch.ops.kvloom.pairs_layout_supported(64, 16),
    reason="this build has no pairs-layout kernel (AVX512-BF16)")


@needs_pairs
@pytest.mark.parametrize("sliding_window", [None, 6, 40])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (3, 3), (2, 4)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_pairs_layout_matches_reference(sliding_window: int | None, block_size: int, kv_heads: int,
                                       group: int, head_dim: int) -> None:
    """Caches in the pairs layout: the reference's outputs, and the step's keys and values written as it writes them."""
    metadata, qkv, key_cache, value_cache = random_step(MIXED_BATCH, block_size, sliding_window, kv_heads * group,
                                                        kv_heads, head_dim, torch.bfloat16)
    assert_matches_reference(metadata, qkv, *in_pairs(key_cache, value_cache), **tolerance(torch.bfloat16))


@needs_pairs
def test_pairs_layout_with_non_finite_values_in_unused_slots() -> None:
    """An odd key count leaves the last pair's partner slot unread: whatever it holds (here inf and NaN, as a
    block's earlier owner may have left) cannot reach the output."""
    batch = [(1, 20), (3, 0), (1, 44)]  # odd sequence lengths
    metadata, qkv, key_cache, value_cache = random_step(batch, 16, None, 4, 2, 64, torch.bfloat16)
    key_cache.fill_(float("inf"))
    value_cache.fill_(float("nan"))
    for i, (_, cached) in enumerate(batch):  # finite keys and values where the requests' contexts lie
        for pos in range(cached):
            block = metadata.block_table[i, pos // 16]
            key_cache[block, pos % 16] = torch.randn(2, 64).to(torch.bfloat16)
            value_cache[block, pos % 16] = torch.randn(2, 64).to(torch.bfloat16)
    expected = attention_reference(*qkv, key_cache.clone(), value_cache.clone(), metadata, 0.125)
    got = attention_cpu(*qkv, *in_pairs(key_cache, value_cache), metadata, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, **tolerance(torch.bfloat16))


def test_cpu_ops_allocate_the_pairs_layout_only_where_the_kernel_reads_it() -> None:
    ops = select_ops(torch.device("cpu"), torch.bfloat16, "cpu")
    supported = torch.ops.kvloom.pairs_layout_supported(64, 16)
    key_cache, value_cache = ops.allocate_kv_cache(5, 16, 3, 64, torch.bfloat16, "cpu")
    assert key_cache.shape == ((5, 3, 32, 16, 2) if supported else (5, 16, 3, 64))
    assert value_cache.shape == ((5, 3, 8, 64, 2) if supported else (5, 16, 3, 64))
    for args in ((5, 1, 3, 64, torch.bfloat16), (5, 16, 3, 64, torch.float32), (5, 16, 3, 72, torch.bfloat16)):
        assert ops.allocate_kv_cache(*args, "cpu")[0].dim() == 4
    native = select_ops(torch.device("cpu"), torch.bfloat16, "native")
    assert native.allocate_kv_cache(5, 16, 3, 64, torch.bfloat16, "cpu")[0].dim() == 4


def test_bad_block_table_is_an_error_not_a_crash() -> None:
    metadata, qkv, key_cache, value_cache = random_step([(1, 20)], 16, None, 4, 2, 64, torch.float32)
    metadata.block_table[0, 1] = key_cache.shape[0]  # one past the last block
    metadata.slot_mapping = torch.tensor([0])
    with pytest.raises(RuntimeError, match="block_table"):
        attention_cpu(*qkv, key_cache, value_cache, metadata, 0.125)


def test_op_table_picks_cpu_on_the_cpu_and_triton_on_cuda() -> None:
    cpu_device = torch.device("cpu")
    assert select_ops(cpu_device, torch.float32).attention is attention_cpu
    assert select_ops(cpu_device, torch.float32, "cpu").attention is attention_cpu
    assert select_ops(cpu_device, torch.float32, "native").attention is attention_native
    assert select_ops(cpu_device, torch.float32, "reference").attention is attention_reference
    assert select_ops(torch.device("cuda"), torch.bfloat16).name == "triton"
    with pytest.raises(ValueError, match="CPU only"):
        select_ops(torch.device("cuda"), torch.float32, "cpu")
    with pytest.raises(ValueError, match="CUDA only"):
        select_ops(cpu_device, torch.float32, "triton")


def test_failed_build_warns_once_and_falls_back_to_native(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu, "build_variants", lambda: (("broken", ["-fno-such-compiler-flag"]),))
    cpu.load_cpu_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kvloom"):
            assert select_ops(torch.device("cpu"), torch.float32, "cpu").attention is attention_native
            assert select_ops(torch.device("cpu"), torch.float32).attention is attention_native
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "falls back to 'native'" in warnings[0].getMessage()
    finally:
        cpu.load_cpu_kernel.cache_clear()
    monkeypatch.undo()
    assert cpu.load_cpu_kernel() is None  # the real kernel, already loaded, comes back


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_int8_cache_matches_reference(dtype: torch.dtype, sliding_window: int | None, head_dim: int) -> None:
    """kv_cache_dtype="int8": rows of codes and an fp16 scale, written by the kernel exactly as the reference
    quantizes them (assert_matches_reference compares the caches bit for bit) and read with each row's scale."""
    from kvloom.ops.reference import dequantize_kv_rows, quantize_kv_rows

    metadata, qkv, key_cache, value_cache = random_step(MIXED_BATCH, 16, sliding_window, 8, 2, head_dim, dtype)
    key_cache, value_cache = quantize_kv_rows(key_cache), quantize_kv_rows(value_cache)
    assert key_cache.dtype == torch.int8 and key_cache.shape[-1] == head_dim + 2
    assert_matches_reference(metadata, qkv, key_cache, value_cache, **tolerance(dtype))
    # The codes hold each value to half a step of its row's scale.
    rows = torch.randn(5, 3, head_dim) * 4
    stored = dequantize_kv_rows(quantize_kv_rows(rows))
    step = rows.abs().amax(dim=-1, keepdim=True) / 127
    assert ((stored - rows).abs() <= step * 0.51 + 1e-6).all()


# Gemma 2's attention logit soft-capping: cap * tanh(scale * s / cap) before the mask and softmax. Scaled scores
# of these random q/k are about N(0, 1), so caps of 0.5 and 2 bend them (the first squeezes every score).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 6, 40])
@pytest.mark.parametrize("kv_heads,group,head_dim", [(2, 1, 64), (2, 4, 64), (3, 3, 128), (1, 8, 256)])
@pytest.mark.parametrize("logit_softcap", [0.5, 2.0])
def test_logit_softcap_matches_reference(dtype: torch.dtype, sliding_window: int | None, kv_heads: int,
                                         group: int, head_dim: int, logit_softcap: float) -> None:
    metadata, qkv, key_cache, value_cache = random_step(MIXED_BATCH, 16, sliding_window, kv_heads * group,
                                                        kv_heads, head_dim, dtype)
    assert_matches_reference(metadata, qkv, key_cache, value_cache, logit_softcap=logit_softcap,
                             **tolerance(dtype))


def test_logit_softcap_binds() -> None:
    """A cap that binds changes the output (so the test above compares something the cap shapes)."""
    metadata, qkv, key_cache, value_cache = random_step(MIXED_BATCH, 16, None, 4, 2, 64, torch.float32)
    capped = attention_cpu(*qkv, key_cache.clone(), value_cache.clone(), metadata, 0.125, logit_softcap=0.5)
    plain = attention_cpu(*qkv, key_cache.clone(), value_cache.clone(), metadata, 0.125)
    assert (capped - plain).abs().max() > 1e-2


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_logit_softcap_int8_and_float16_caches(sliding_window: int | None) -> None:
    """The cap applies after an int8 key row's scale (to the true scores), and on float16 alike."""
    from kvloom.ops.reference import quantize_kv_rows

    metadata, qkv, key_cache, value_cache = random_step(MIXED_BATCH, 16, sliding_window, 8, 2, 64, torch.float32)
    assert_matches_reference(metadata, qkv, quantize_kv_rows(key_cache), quantize_kv_rows(value_cache),
                             logit_softcap=1.0, **tolerance(torch.float32))
    metadata, qkv, key_cache, value_cache = random_step(MIXED_BATCH, 16, sliding_window, 8, 2, 64, torch.float16)
    assert_matches_reference(metadata, qkv, key_cache, value_cache, logit_softcap=1.0, **tolerance(torch.float16))


@needs_pairs
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_logit_softcap_pairs_layout(sliding_window: int | None) -> None:
    metadata, qkv, key_cache, value_cache = random_step(MIXED_BATCH, 16, sliding_window, 8, 2, 64, torch.bfloat16)
    assert_matches_reference(metadata, qkv, *in_pairs(key_cache, value_cache), logit_softcap=1.0,
                             **tolerance(torch.bfloat16))


@pytest.mark.parametrize("cap", [-1.0, 0.0, float("nan")])
def test_bad_logit_softcap_is_a_value_error(cap: float) -> None:
    metadata, qkv, key_cache, value_cache = random_step([(1, 3)], 16, None, 2, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="soft-capping must be a positive number"):
        attention_cpu(*qkv, key_cache, value_cache, metadata, 0.125, logit_softcap=cap)

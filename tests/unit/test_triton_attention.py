"""The Triton paged-attention kernels against the plain-torch reference, one request at a time in fp32.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1), so these shapes stay small; the @gpu tests run realistic bf16 batches.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from paged_batch import place_requests

from kvloom.ops.reference import allocate_kv_cache, causal_mask, dequantize_kv_rows, gather_sequence
from kvloom.ops.reference import write_kv_cache as write_kv_cache_reference
from kvloom.ops.triton.attention import (
    decode_attention,
    paged_attention,
    prefill_attention,
    write_kv_cache,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# fp32 runs the fp32 dot (interpreter) or an IEEE fp32 dot (GPU); fp16 rounds p and the output once.
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
              torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def case_ids(cases: list[tuple]) -> list[str]:
    return [f"kv{kv}-group{g}-block{bs}-window{w}-{str(dt).removeprefix('torch.')}-{str(it).removeprefix('torch.')}"
            for kv, g, bs, w, dt, it in cases]


@dataclass
class Batch:
    """A step's flat batch: request i owns query tokens [query_start_loc[i], query_start_loc[i + 1])."""
    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [B, max_blocks]
    seq_lens: torch.Tensor  # [B]
    query_start_loc: torch.Tensor  # [B + 1]
    query_lens: list[int]
    num_decodes: int

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)


def build_batch(query_lens: list[int], context_lens: list[int], block_size: int, num_blocks: int,
                index_dtype: torch.dtype = torch.int64, seed: int = 0) -> Batch:
    """Random blocks for each request's context plus this step's tokens; the table is padded with block 0.

    index_dtype (int32 or int64) is the dtype of the block table, seq_lens and query_start_loc.
    """
    placed = place_requests(query_lens, context_lens, block_size, num_blocks, seed)
    return Batch(
        slot_mapping=torch.tensor(placed.slot_mapping, dtype=torch.int64, device=DEVICE),
        block_table=torch.tensor(placed.block_tables, dtype=index_dtype, device=DEVICE),
        seq_lens=torch.tensor(placed.seq_lens, dtype=index_dtype, device=DEVICE),
        query_start_loc=torch.tensor(placed.query_start_loc, dtype=index_dtype, device=DEVICE),
        query_lens=list(query_lens), num_decodes=placed.num_decodes)


def random_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random keys and values everywhere (stale data the kernels must not read), zeros in the null block."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, device=DEVICE).to(dtype)
    value_cache = torch.randn(shape, device=DEVICE).to(dtype)
    key_cache[0] = 0
    value_cache[0] = 0
    return key_cache, value_cache


def fused_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query, key, value as strided views of one [T, Hq + 2 * Hkv, D] tensor, as the model makes them."""
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, device=DEVICE).to(dtype)
    return qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]


def reference_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: Batch,
                        scale: float, sliding_window: int, logit_softcap: float | None = None) -> torch.Tensor:
    """[T, Hq, D] fp32: each request's queries against its gathered context, causal; seq_len 0 gives zeros.
    logit_softcap: scores become cap * tanh(scores / cap) first (Gemma 2)."""
    num_heads = query.shape[1]
    group = num_heads // key_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    starts = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if seq_len == 0 or start == end:
            continue
        row = batch.block_table[i].long()
        k = gather_sequence(key_cache, row, seq_len).float().repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = gather_sequence(value_cache, row, seq_len).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,shd->hqs", query[start:end].float(), k) * scale
        if logit_softcap is not None:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        mask = causal_mask(end - start, seq_len, sliding_window or None, query.device)
        probs = torch.softmax(scores.masked_fill(~mask[None], float("-inf")), dim=-1)
        out[start:end] = torch.einsum("hqs,shd->qhd", probs, v)
    return out


def setup_step(query_lens: list[int], context_lens: list[int], block_size: int, num_heads: int,
               num_kv_heads: int, head_dim: int, dtype: torch.dtype, index_dtype: torch.dtype = torch.int64,
               seed: int = 0) -> tuple[Batch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch, a strided query, and caches holding every context plus this step's keys and values."""
    torch.manual_seed(seed)
    max_blocks = sum(-(-(q + c) // block_size) for q, c in zip(query_lens, context_lens))
    num_blocks = max_blocks + 3
    batch = build_batch(query_lens, context_lens, block_size, num_blocks, index_dtype, seed)
    key_cache, value_cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    query, key, value = fused_qkv(batch.num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    write_kv_cache_reference(key, value, key_cache, value_cache, batch.slot_mapping)
    return batch, query, key_cache, value_cache


# --------------------------------------------------------------------------------------------------
# write_kv_cache
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_write_kv_cache_matches_reference_and_skips_negative_slots(cache_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_dim = 6, 4, 2, 16
    _, key, value = fused_qkv(7, 4, num_kv_heads, head_dim, torch.float32)  # strided views, fp32 -> cache dtype
    slot_mapping = torch.tensor([5, 0, -1, 23, 9, -1, 12], dtype=torch.int64, device=DEVICE)
    key_cache, value_cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype)
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    kept = slot_mapping >= 0
    write_kv_cache_reference(key[kept], value[kept], expected_key, expected_value, slot_mapping[kept])

    write_kv_cache(key, value, key_cache, value_cache, slot_mapping)

    # Exact: the same conversion to the cache dtype, and every other slot untouched.
    torch.testing.assert_close(key_cache, expected_key, atol=0, rtol=0)
    torch.testing.assert_close(value_cache, expected_value, atol=0, rtol=0)


# --------------------------------------------------------------------------------------------------
# decode_attention
# --------------------------------------------------------------------------------------------------

# (num_kv_heads, group, block_size, sliding_window, dtype, index dtype); contexts run past 64 tokens,
# so the online softmax crosses key tiles, and block_size 96 is one block for the longest request.
DECODE_CASES = [
    (2, 1, 16, 0, torch.float32, torch.int64),
    (2, 2, 4, 0, torch.float16, torch.int32),
    (1, 4, 1, 0, torch.float32, torch.int32),
    (2, 2, 96, 0, torch.float32, torch.int64),
    (1, 4, 16, 37, torch.float32, torch.int64),
    (2, 2, 4, 20, torch.float16, torch.int64),
]


@pytest.mark.parametrize("num_kv_heads,group,block_size,sliding_window,dtype,index_dtype", DECODE_CASES,
                         ids=case_ids(DECODE_CASES))
def test_decode_attention_matches_reference(num_kv_heads: int, group: int, block_size: int, sliding_window: int,
                                            dtype: torch.dtype, index_dtype: torch.dtype) -> None:
    head_dim = 16
    context_lens = [0, 4, 63, 95, 70]
    batch, query, key_cache, value_cache = setup_step([1] * len(context_lens), context_lens, block_size,
                                                      group * num_kv_heads, num_kv_heads, head_dim, dtype,
                                                      index_dtype)
    scale = head_dim ** -0.5
    out = torch.full_like(query, float("nan"))

    decode_attention(out, query, key_cache, value_cache, batch.block_table, batch.seq_lens, scale, sliding_window)

    expected = reference_attention(query, key_cache, value_cache, batch, scale, sliding_window)
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("num_splits", [1, 2, 4])
@pytest.mark.parametrize("sliding_window", [0, 50])
def test_decode_attention_split_k_and_padded_rows(num_splits: int, sliding_window: int) -> None:
    """Split-K gives the same answer; a seq_len-0 row (CUDA-graph padding) gets zeros, not NaN."""
    head_dim, num_kv_heads, group = 32, 2, 2
    context_lens = [200, 0, 9, 129, 3]
    batch, query, key_cache, value_cache = setup_step([1] * len(context_lens), context_lens, 16,
                                                      group * num_kv_heads, num_kv_heads, head_dim, torch.float32)
    batch.seq_lens[2] = 0  # padded rows: nothing to attend, table row of null blocks
    batch.block_table[2] = 0
    scale = head_dim ** -0.5
    out = torch.full_like(query, float("nan"))

    decode_attention(out, query, key_cache, value_cache, batch.block_table, batch.seq_lens, scale, sliding_window,
                     num_splits=num_splits)

    expected = reference_attention(query, key_cache, value_cache, batch, scale, sliding_window)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


# --------------------------------------------------------------------------------------------------
# prefill_attention
# --------------------------------------------------------------------------------------------------

# (num_kv_heads, group, block_size, sliding_window, dtype, index dtype)
PREFILL_CASES = [
    (2, 1, 16, 0, torch.float32, torch.int64),
    (1, 2, 1, 0, torch.float16, torch.int32),
    (1, 4, 4, 0, torch.float32, torch.int32),
    (1, 2, 160, 0, torch.float32, torch.int64),
    (1, 4, 16, 23, torch.float32, torch.int64),
    (1, 2, 4, 70, torch.float16, torch.int64),
]


@pytest.mark.parametrize("num_kv_heads,group,block_size,sliding_window,dtype,index_dtype", PREFILL_CASES,
                         ids=case_ids(PREFILL_CASES))
@pytest.mark.parametrize("chunks", ["fresh", "continuing"])
def test_prefill_attention_matches_reference(num_kv_heads: int, group: int, block_size: int, sliding_window: int,
                                             dtype: torch.dtype, index_dtype: torch.dtype, chunks: str) -> None:
    """Fresh prompts, and chunks continuing a cached context (which attend the context and themselves)."""
    head_dim = 16
    if chunks == "fresh":
        query_lens, context_lens = [70, 5, 1, 33], [0, 0, 0, 0]  # 70 rows: two query tiles
    else:
        query_lens, context_lens = [20, 66, 1, 3], [50, 10, 60, 97]
    batch, query, key_cache, value_cache = setup_step(query_lens, context_lens, block_size, group * num_kv_heads,
                                                      num_kv_heads, head_dim, dtype, index_dtype)
    scale = head_dim ** -0.5
    out = torch.full_like(query, float("nan"))

    prefill_attention(out, query, key_cache, value_cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                      batch.max_query_len, scale, sliding_window)

    expected = reference_attention(query, key_cache, value_cache, batch, scale, sliding_window)
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype])


# --------------------------------------------------------------------------------------------------
# paged_attention: the flat batch
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [32, 24])
def test_paged_attention_mixed_batch_from_fused_qkv(head_dim: int) -> None:
    """Decodes then prefill chunks, K/V written by the kernel from a fused qkv, out a strided view too."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, block_size, sliding_window = 4, 2, 4, 0
    query_lens, context_lens = [1, 1, 1, 9, 5], [3, 77, 0, 0, 40]
    num_blocks = 40
    batch = build_batch(query_lens, context_lens, block_size, num_blocks, torch.int32)
    key_cache, value_cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32)
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    query, key, value = fused_qkv(batch.num_tokens, num_heads, num_kv_heads, head_dim, torch.float32)
    out = torch.full((batch.num_tokens, num_heads + 1, head_dim), float("nan"), device=DEVICE)[:, 1:]
    scale = head_dim ** -0.5

    write_kv_cache(key, value, key_cache, value_cache, batch.slot_mapping)
    paged_attention(out, query, key_cache, value_cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                    batch.num_decodes, batch.max_query_len, scale, sliding_window)

    write_kv_cache_reference(key, value, expected_key, expected_value, batch.slot_mapping)
    torch.testing.assert_close(key_cache, expected_key, atol=0, rtol=0)
    torch.testing.assert_close(value_cache, expected_value, atol=0, rtol=0)
    expected = reference_attention(query, expected_key, expected_value, batch, scale, sliding_window)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


def test_paged_attention_sliding_window_decodes_only_and_prefills_only() -> None:
    num_heads, num_kv_heads, head_dim, block_size, sliding_window = 4, 1, 16, 16, 9
    scale = head_dim ** -0.5
    for query_lens, context_lens in [([1, 1, 1], [30, 2, 80]), ([4, 12], [17, 0])]:
        batch, query, key_cache, value_cache = setup_step(query_lens, context_lens, block_size, num_heads,
                                                          num_kv_heads, head_dim, torch.float32)
        out = torch.full_like(query, float("nan"))
        paged_attention(out, query, key_cache, value_cache, batch.block_table, batch.seq_lens,
                        batch.query_start_loc, batch.num_decodes, batch.max_query_len, scale, sliding_window)
        expected = reference_attention(query, key_cache, value_cache, batch, scale, sliding_window)
        torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


# Gemma 2's logit soft-capping: a cap of 0.5 squeezes every score (scaled scores here are about N(0, 1)).
SOFTCAP_CASES = [(1, 4, 16, 0, torch.float32), (2, 2, 4, 9, torch.float32), (1, 2, 16, 20, torch.float16)]


@pytest.mark.parametrize("num_kv_heads,group,block_size,sliding_window,dtype", SOFTCAP_CASES,
                         ids=[f"kv{kv}-group{g}-block{bs}-window{w}-{str(dt).removeprefix('torch.')}"
                              for kv, g, bs, w, dt in SOFTCAP_CASES])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_attention_logit_softcap_matches_reference(num_kv_heads: int, group: int, block_size: int,
                                                         sliding_window: int, dtype: torch.dtype,
                                                         num_splits: int) -> None:
    """Decodes (split or not) and prefill chunks, fresh and continuing, with the cap applied in both kernels."""
    head_dim, cap = 16, 0.5
    query_lens, context_lens = [1, 1, 1, 20, 5], [0, 40, 70, 0, 33]
    batch, query, key_cache, value_cache = setup_step(query_lens, context_lens, block_size, group * num_kv_heads,
                                                      num_kv_heads, head_dim, dtype)
    scale = head_dim ** -0.5
    out = torch.full_like(query, float("nan"))
    decodes = batch.num_decodes
    decode_attention(out[:decodes], query[:decodes], key_cache, value_cache, batch.block_table[:decodes],
                     batch.seq_lens[:decodes], scale, sliding_window, num_splits=num_splits, logit_softcap=cap)
    prefill_attention(out, query, key_cache, value_cache, batch.block_table[decodes:], batch.seq_lens[decodes:],
                      batch.query_start_loc[decodes:], batch.max_query_len, scale, sliding_window, logit_softcap=cap)
    expected = reference_attention(query, key_cache, value_cache, batch, scale, sliding_window, logit_softcap=cap)
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype])
    # The cap binds: without it the answer is another one.
    plain = reference_attention(query, key_cache, value_cache, batch, scale, sliding_window)
    assert (plain - expected).abs().max() > 1e-2


def test_paged_attention_logit_softcap_through_the_flat_batch_and_bad_cap() -> None:
    batch, query, key_cache, value_cache = setup_step([1, 1, 6], [5, 30, 0], 4, 4, 2, 16, torch.float32)
    out = torch.full_like(query, float("nan"))
    paged_attention(out, query, key_cache, value_cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                    batch.num_decodes, batch.max_query_len, 0.25, 0, logit_softcap=2.0)
    expected = reference_attention(query, key_cache, value_cache, batch, 0.25, 0, logit_softcap=2.0)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    with pytest.raises(ValueError, match="soft-capping must be a positive number"):
        paged_attention(out, query, key_cache, value_cache, batch.block_table, batch.seq_lens,
                        batch.query_start_loc, batch.num_decodes, batch.max_query_len, 0.25, 0, logit_softcap=0.0)


# --------------------------------------------------------------------------------------------------
# 8-bit caches: int8 rows with their scale, fp8 e4m3
# --------------------------------------------------------------------------------------------------

KV_8BIT = [torch.int8, torch.float8_e4m3fn]


def cache_values(cache: torch.Tensor) -> torch.Tensor:
    """fp32 [num_blocks, block_size, Hkv, D]: what an 8-bit cache holds (int8: codes times the row's scale)."""
    return dequantize_kv_rows(cache) if cache.dtype == torch.int8 else cache.float()


def empty_8bit_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    return allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, DEVICE)


@pytest.mark.parametrize("kv_dtype", KV_8BIT, ids=["int8", "fp8"])
@pytest.mark.parametrize("head_dim", [16, 24])
def test_write_8bit_kv_cache_equals_the_reference_bit_for_bit(kv_dtype: torch.dtype, head_dim: int) -> None:
    """Codes and scales (int8) or e4m3 values clamped at 448 (fp8) exactly as ops/reference.py writes them,
    padding slots skipped; rows of zeros (scale 0), huge values and half-way codes included."""
    torch.manual_seed(0)
    num_blocks, block_size, num_kv_heads = 6, 4, 3
    _, key, value = fused_qkv(7, 4, num_kv_heads, head_dim, torch.float32)
    key[1] = 0.0  # a zero row: scale 0, codes 0
    value[3, 0, :2] = torch.tensor([1000.0, -600.0])  # past e4m3's range: clamped
    key[4, 1] = torch.arange(head_dim) - head_dim / 2 + 0.5  # codes at .5 ties for the rounding
    key[4, 1, 0] = 127.0 * 2  # scale 2: x / s = k - 0.25 ... and exact halves
    slot_mapping = torch.tensor([5, 0, -1, 23, 9, -1, 12], dtype=torch.int64, device=DEVICE)
    key_cache, value_cache = empty_8bit_cache(num_blocks, block_size, num_kv_heads, head_dim, kv_dtype)
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    kept = slot_mapping >= 0
    write_kv_cache_reference(key[kept], value[kept], expected_key, expected_value, slot_mapping[kept])
    write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    assert torch.equal(key_cache.view(torch.uint8), expected_key.view(torch.uint8))
    assert torch.equal(value_cache.view(torch.uint8), expected_value.view(torch.uint8))
    if kv_dtype == torch.float8_e4m3fn:
        assert value_cache.float().abs().max() == 448.0


# (num_kv_heads, group, block_size, sliding_window, softcap, num_splits)
KV_8BIT_CASES = [(2, 2, 4, 0, None, 1), (1, 4, 16, 37, None, 2), (2, 1, 16, 0, 0.5, 1), (2, 2, 96, 20, 2.0, 2)]


@pytest.mark.parametrize("kv_dtype", KV_8BIT, ids=["int8", "fp8"])
@pytest.mark.parametrize("num_kv_heads,group,block_size,sliding_window,softcap,num_splits", KV_8BIT_CASES,
                         ids=[f"kv{kv}-group{g}-block{bs}-window{w}-cap{c}-splits{n}"
                              for kv, g, bs, w, c, n in KV_8BIT_CASES])
def test_paged_attention_reads_8bit_caches_in_place(kv_dtype: torch.dtype, num_kv_heads: int, group: int,
                                                    block_size: int, sliding_window: int, softcap: float | None,
                                                    num_splits: int) -> None:
    """Decodes (split or not) and prefill chunks, fresh and continuing, over an 8-bit cache the kernel wrote: the
    same answer as fp32 attention over the values the cache holds (int8: each key's scores times its scale, each
    value's probabilities times its own)."""
    torch.manual_seed(1)
    head_dim = 16
    query_lens, context_lens = [1, 1, 1, 20, 5], [0, 40, 70, 0, 33]
    num_blocks = sum(-(-(q + c) // block_size) for q, c in zip(query_lens, context_lens)) + 3
    batch = build_batch(query_lens, context_lens, block_size, num_blocks, torch.int64, seed=1)
    key_cache, value_cache = empty_8bit_cache(num_blocks, block_size, num_kv_heads, head_dim, kv_dtype)
    query, key, value = fused_qkv(batch.num_tokens, group * num_kv_heads, num_kv_heads, head_dim, torch.float32)
    # Every context position written too (the batch's slots cover only this step's tokens).
    context = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, device=DEVICE)
    everywhere = torch.arange(block_size, num_blocks * block_size, device=DEVICE)  # not the null block
    write_kv_cache(context[everywhere], context[everywhere].flip(0), key_cache, value_cache, everywhere)
    write_kv_cache(key, value, key_cache, value_cache, batch.slot_mapping)
    scale = head_dim ** -0.5
    out = torch.full_like(query, float("nan"))
    decodes = batch.num_decodes
    decode_attention(out[:decodes], query[:decodes], key_cache, value_cache, batch.block_table[:decodes],
                     batch.seq_lens[:decodes], scale, sliding_window, num_splits=num_splits, logit_softcap=softcap)
    prefill_attention(out, query, key_cache, value_cache, batch.block_table[decodes:], batch.seq_lens[decodes:],
                      batch.query_start_loc[decodes:], batch.max_query_len, scale, sliding_window,
                      logit_softcap=softcap)
    expected = reference_attention(query, cache_values(key_cache), cache_values(value_cache), batch, scale,
                                   sliding_window, logit_softcap=softcap)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    # And it is the 8-bit cache that was read: the full-precision keys give another answer.
    full_key, full_value = random_cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32)
    write_kv_cache_reference(context[everywhere], context[everywhere].flip(0), full_key, full_value, everywhere)
    write_kv_cache_reference(key, value, full_key, full_value, batch.slot_mapping)
    exact = reference_attention(query, full_key, full_value, batch, scale, sliding_window, logit_softcap=softcap)
    assert 1e-4 < (exact - expected).abs().max() < 0.2


def test_attention_rejects_bad_shapes() -> None:
    batch, query, key_cache, value_cache = setup_step([1, 1], [3, 4], 4, 4, 2, 16, torch.float32)
    out = torch.empty_like(query)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        decode_attention(out[:, :3], query[:, :3], key_cache, value_cache, batch.block_table, batch.seq_lens,
                         0.25, 0)
    with pytest.raises(ValueError, match="head_dim"):
        decode_attention(out[..., :8], query[..., :8], key_cache, value_cache, batch.block_table, batch.seq_lens,
                         0.25, 0)
    with pytest.raises(ValueError, match="query_start_loc"):
        prefill_attention(out, query, key_cache, value_cache, batch.block_table, batch.seq_lens,
                          batch.query_start_loc[:2], 1, 0.25, 0)
    with pytest.raises(ValueError, match="block_table"):
        decode_attention(out, query, key_cache, value_cache, batch.block_table.float(), batch.seq_lens, 0.25, 0)


# --------------------------------------------------------------------------------------------------
# GPU: realistic sizes in bf16
# --------------------------------------------------------------------------------------------------


def _time_ms(fn, repeats: int = 20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("num_reqs", [1, 8, 64, 256])
def test_gpu_decode_attention_bf16(num_reqs: int) -> None:
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 64, 16
    rng = random.Random(num_reqs)
    context_lens = [rng.randint(127, 1023) for _ in range(num_reqs)]
    batch, query, key_cache, value_cache = setup_step([1] * num_reqs, context_lens, block_size, num_heads,
                                                      num_kv_heads, head_dim, torch.bfloat16, torch.int32)
    scale = head_dim ** -0.5
    out = torch.empty_like(query)
    run = lambda: decode_attention(out, query, key_cache, value_cache, batch.block_table, batch.seq_lens,
                                   scale, 0)
    run()
    expected = reference_attention(query, key_cache, value_cache, batch, scale, 0)
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[torch.bfloat16])
    ms = _time_ms(run)
    kv_bytes = 2 * sum(context_lens) * num_kv_heads * head_dim * key_cache.element_size()
    print(f"\ndecode B={num_reqs}: {ms * 1e3:.1f} us, {kv_bytes / ms / 1e6:.0f} GB/s of K/V")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("sliding_window", [0, 256])
def test_gpu_paged_attention_mixed_batch_bf16(sliding_window: int) -> None:
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 64, 16
    rng = random.Random(1)
    num_decodes = 64
    query_lens = [1] * num_decodes + [512, 300, 37, 128, 1000]
    context_lens = [rng.randint(127, 1023) for _ in range(num_decodes)] + [0, 700, 1000, 0, 24]
    batch, query, key_cache, value_cache = setup_step(query_lens, context_lens, block_size, num_heads,
                                                      num_kv_heads, head_dim, torch.bfloat16, torch.int32)
    scale = head_dim ** -0.5
    out = torch.empty_like(query)
    run = lambda: paged_attention(out, query, key_cache, value_cache, batch.block_table, batch.seq_lens,
                                  batch.query_start_loc, batch.num_decodes, batch.max_query_len, scale,
                                  sliding_window)
    run()
    expected = reference_attention(query, key_cache, value_cache, batch, scale, sliding_window)
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[torch.bfloat16])
    print(f"\nmixed batch ({batch.num_tokens} tokens, window {sliding_window}): {_time_ms(run) * 1e3:.1f} us")


@gpu
@pytest.mark.gpu
def test_gpu_decode_attention_replays_in_a_cuda_graph() -> None:
    """The grid depends only on B: a captured launch reads the new seq_lens and block table on replay."""
    num_heads, num_kv_heads, head_dim, block_size, num_reqs = 32, 8, 64, 16, 16
    batch, query, key_cache, value_cache = setup_step([1] * num_reqs, [300] * num_reqs, block_size, num_heads,
                                                      num_kv_heads, head_dim, torch.bfloat16, torch.int32)
    scale = head_dim ** -0.5
    out = torch.empty_like(query)
    run = lambda: decode_attention(out, query, key_cache, value_cache, batch.block_table, batch.seq_lens,
                                   scale, 0)
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    new_lens = torch.tensor([0, 1, 17, 64, 65, 200, 301] + [150] * (num_reqs - 7), dtype=torch.int32)
    batch.seq_lens.copy_(new_lens)
    batch.block_table[0] = 0
    graph.replay()
    torch.cuda.synchronize()
    expected = reference_attention(query, key_cache, value_cache, batch, scale, 0)
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[torch.bfloat16])

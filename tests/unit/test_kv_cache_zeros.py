"""A large CPU KV cache is mapped zeroed on first touch (ops/reference.py allocate_kv_caches: all layers in one
mapping): the same tensors torch.zeros makes (shape, dtype, strides, every element zero), writable, each its own
memory, with nothing written at start-up."""

from __future__ import annotations

import os
import resource

import pytest
import torch

from kvloom.ops import huge_pages, reference
from kvloom.ops.reference import LAZY_ZEROS_MIN_BYTES, allocate_kv_cache, allocate_kv_caches


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("pairs", [False, True])
def test_a_large_cache_is_the_zeroed_cache_torch_zeros_makes(dtype: torch.dtype, pairs: bool) -> None:
    args = (128, 16, 8, 64, dtype)  # 1 MiB or more a tensor: the mapped path
    key, value = allocate_kv_cache(*args, "cpu", pairs=pairs and dtype.itemsize == 2)
    assert key.numel() * dtype.itemsize >= LAZY_ZEROS_MIN_BYTES
    with torch.device("cpu"):
        small = reference.LAZY_ZEROS_MIN_BYTES
        try:
            reference.LAZY_ZEROS_MIN_BYTES = 1 << 62  # every tensor through torch.zeros: the oracle
            want_key, want_value = allocate_kv_cache(*args, "cpu", pairs=pairs and dtype.itemsize == 2)
        finally:
            reference.LAZY_ZEROS_MIN_BYTES = small
    for got, want in ((key, want_key), (value, want_value)):
        assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())
        assert got.is_contiguous() and got.data_ptr() % 4096 == 0
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    key.view(torch.uint8)[3, 5].fill_(7)  # writable, and the value cache is not the same memory
    assert int(key.view(torch.uint8).sum()) == 7 * key.view(torch.uint8)[3, 5].numel()
    assert int(value.view(torch.uint8).sum()) == 0


def test_small_or_non_cpu_caches_take_torch_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a small or non-CPU cache was mapped")
    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    key, value = allocate_kv_cache(2, 16, 2, 64, torch.bfloat16, "cpu")
    assert key.numel() * 2 < LAZY_ZEROS_MIN_BYTES and torch.equal(key, torch.zeros_like(key))
    assert allocate_kv_cache(128, 16, 8, 64, torch.bfloat16, "meta")[0].device.type == "meta"


def test_every_layer_shares_one_mapping_without_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small layers (512 KiB each, as an 8B model at 256 tokens) still map lazily: one mapping for the model."""
    maps = []
    real_mmap = huge_pages.mmap.mmap

    def counted(*args: object, **kwargs: object) -> object:
        maps.append(args)
        return real_mmap(*args, **kwargs)

    monkeypatch.setattr(huge_pages.mmap, "mmap", counted)
    caches = allocate_kv_caches(32, 16, 16, 8, 128, torch.bfloat16, "cpu", pairs=True)
    assert len(maps) == 1 and len(caches) == 32
    tensors = [t for pair in caches for t in pair]
    ranges = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:]))  # disjoint
    want = allocate_kv_cache(16, 16, 8, 128, torch.bfloat16, "meta", pairs=True)
    for key, value in caches:
        assert key.shape == want[0].shape and value.shape == want[1].shape
        assert key.is_contiguous() and key.data_ptr() % 4096 == 0 and value.data_ptr() % 4096 == 0
    for i, t in enumerate(tensors):
        t.fill_(i + 1)
    assert all(int(t.min()) == int(t.max()) == i + 1 for i, t in enumerate(tensors))


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident pages are read from /proc")
def test_a_mapped_cache_is_not_resident_until_written() -> None:
    page = resource.getpagesize()

    def resident() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * page

    before = resident()
    key, value = allocate_kv_cache(1024, 16, 8, 128, torch.bfloat16, "cpu")  # 2 x 32 MiB
    assert resident() - before < 8 << 20
    key.fill_(1)
    assert resident() - before >= key.numel() * 2 - (1 << 20)
    del value

"""Packed weights and the KV cache on transparent huge pages (kvloom/ops/huge_pages.py): the same values in a
2 MiB-aligned anonymous mapping advised MADV_HUGEPAGE, storages exactly as large as the tensor, and plain torch
memory where huge pages are off."""

from __future__ import annotations

import mmap

import pytest
import torch

from kvloom.ops import huge_pages
from kvloom.ops.cpu import PackedWeight, linear_format
from kvloom.ops.q4 import PackedQ4Weight, Q4Blocks
from kvloom.ops.reference import allocate_kv_cache


@pytest.fixture
def advised(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Huge pages on (as on Linux with THP madvise), and the (address, length) of every MADV_HUGEPAGE advice."""
    calls: list[tuple[int, int]] = []
    real = mmap.mmap

    class Spy(real):  # type: ignore[misc, valid-type]
        def madvise(self, option: int, start: int = 0, length: int = 0) -> None:
            if option == mmap.MADV_HUGEPAGE:
                calls.append((start, len(self)))
            super().madvise(option, start, length or len(self))

    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE on this platform")
    monkeypatch.setattr(huge_pages.mmap, "mmap", Spy)
    monkeypatch.setattr(huge_pages, "available", lambda: True)
    return calls


def test_rehome_keeps_the_values_on_an_aligned_advised_mapping(advised: list[tuple[int, int]]) -> None:
    weight = torch.randn(1536, 576, dtype=torch.bfloat16)  # 1.7 MiB: below MIN_BYTES, kept as it is
    assert huge_pages.rehome(weight) is weight and not advised
    weight = torch.randn(4096, 1024)
    moved = huge_pages.rehome(weight)
    assert moved is not weight and torch.equal(moved, weight)
    assert (moved.shape, moved.dtype, moved.stride()) == (weight.shape, weight.dtype, weight.stride())
    assert moved.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert moved.untyped_storage().nbytes() == weight.numel() * 4  # torch.save writes no slack
    assert len(advised) == 1 and advised[0][1] >= weight.numel() * 4 + huge_pages.HUGE_PAGE
    moved.add_(1)  # writable, and its own memory
    assert torch.equal(moved, weight + 1)


def test_packed_weights_and_the_kv_cache_go_on_huge_pages(advised: list[tuple[int, int]]) -> None:
    if linear_format(torch.bfloat16) not in ("kvloom", "hybrid"):  # loads the CPU kernels, or says why not
        pytest.skip("the kvloom GEMM needs AVX512-BF16 or AVX2 and the built CPU kernels")
    torch.manual_seed(0)
    weight = torch.randn(4096, 2048, dtype=torch.bfloat16)
    x = torch.randn(3, 2048, dtype=torch.bfloat16)
    bf16 = PackedWeight(weight, None, "kvloom")
    assert bf16.data.data_ptr() % huge_pages.HUGE_PAGE == 0
    q4 = PackedQ4Weight(Q4Blocks.quantize(weight.float(), 6, 16), None)
    assert q4.data.data_ptr() % huge_pages.HUGE_PAGE == 0
    key, value = allocate_kv_cache(512, 16, 8, 64, torch.bfloat16, "cpu", pairs=True)
    assert key.data_ptr() % huge_pages.HUGE_PAGE == 0 and value.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert torch.equal(key, torch.zeros_like(key))
    assert len(advised) >= 4
    # The products on those pages are the ones on torch's memory, bit for bit.
    huge_pages_off = pytest.MonkeyPatch()
    huge_pages_off.setattr(huge_pages, "available", lambda: False)
    try:
        plain_bf16 = PackedWeight(weight, None, "kvloom")
        plain_q4 = PackedQ4Weight(Q4Blocks.quantize(weight.float(), 6, 16), None)
    finally:
        huge_pages_off.undo()
    assert torch.equal(bf16(x), plain_bf16(x)) and torch.equal(q4(x), plain_q4(x))


def test_the_knob_and_the_platform_turn_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    huge_pages.available.cache_clear()
    try:
        monkeypatch.setenv("KVLOOM_HUGE_PAGES", "0")
        assert not huge_pages.available()
        weight = torch.randn(4096, 1024)
        assert huge_pages.rehome(weight) is weight
        huge_pages.available.cache_clear()
        monkeypatch.setenv("KVLOOM_HUGE_PAGES", "1")
        monkeypatch.setattr(huge_pages, "THP_SETTING", huge_pages.Path("/nonexistent/thp"))
        assert not huge_pages.available()  # no THP control file: not Linux's THP, plain memory
    finally:
        huge_pages.available.cache_clear()


def test_a_stepwise_rehome_moves_every_view_of_a_storage(advised: list[tuple[int, int]], tmp_path) -> None:
    big, other, small = torch.randn(1 << 20), torch.randn(1 << 20), torch.randn(16)
    torch.save({"big": big, "rows": big[4:], "other": other, "small": small}, tmp_path / "t.pt")
    loaded = torch.load(tmp_path / "t.pt", mmap=True)
    assert loaded["rows"].untyped_storage().data_ptr() == loaded["big"].untyped_storage().data_ptr()
    rehome = huge_pages.StepwiseRehome.start(list(loaded.values()))
    assert rehome is not None and not rehome.finished
    assert rehome.step(budget=1) == 4 << 20  # one storage a step at the least: a large one first
    assert len(advised) == 1 and not rehome.finished
    rehome.finish()
    assert rehome.finished and rehome.step() == 0
    for name, want in (("big", big), ("rows", big[4:]), ("other", other), ("small", small)):
        assert torch.equal(loaded[name], want), name
    assert all(loaded[name].data_ptr() % huge_pages.HUGE_PAGE == 0 for name in ("big", "other"))
    assert loaded["rows"].untyped_storage().data_ptr() == loaded["big"].untyped_storage().data_ptr()  # moved together
    assert loaded["rows"].data_ptr() == loaded["big"].data_ptr() + 4 * big.element_size()
    assert len(advised) == 2  # the small one went to ordinary memory (the file's mapping released whole)
    assert huge_pages.StepwiseRehome.start([]) is None

"""Large CPU buffers on transparent huge pages: the packed weights and the KV cache.

A decode step streams every weight once; on 4 KiB pages that is a TLB miss every 4 KiB and a hardware
prefetcher that stops at each page's end. In 2 MiB pages the same products stream 10-11% faster (4- and 6-bit
weights at one row) and a bf16 panel pass up to 1.4x (docs/benchmarks.md, "Huge pages"). Linux gives an
anonymous mapping huge pages where it is advised (``MADV_HUGEPAGE``; the usual ``madvise`` setting of
/sys/kernel/mm/transparent_hugepage/enabled) and its 2 MiB-aligned ranges are first touched after the advice,
so a buffer is mapped, advised and aligned here before anything is written to it. Elsewhere (another OS, THP
``never``, ``KVLOOM_HUGE_PAGES=0``) the buffers are plain torch allocations.

The memory is the same bytes either way; a huge page becomes resident whole at its first touch, which is
what the lazily zeroed KV cache (ops/reference.py ``allocate_kv_caches``: all layers in one mapping) then
makes resident per 2 MiB instead of per 4 KiB.

Faulting huge pages in is not free: on a 2-core VM (AMD EPYC) a packing pass into fresh huge pages ran at 0.4-0.55
GB/s where the same pass into 4 KiB pages ran at ~1.8 GB/s. A start can therefore pack into ordinary memory
(``deferred()``: ``rehome`` and ``empty`` hand back ordinary tensors while it is in force) and move the packed weights
onto huge pages over the first steps (``StepwiseRehome``, which the model runner steps between steps): the model is
ready sooner and the move's cost is spread over the first steps instead of the start.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import mmap
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from kvloom import envs

HUGE_PAGE = 2 << 20
PAGE = 4096
# Below this a buffer keeps torch's allocation: it cannot hold a whole huge page.
MIN_BYTES = HUGE_PAGE
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# While set (deferred()), packed weights stay in ordinary memory: their move onto huge pages comes later.
_DEFERRED: contextvars.ContextVar[bool] = contextvars.ContextVar("kvloom_huge_pages_deferred", default=False)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Within: ``rehome`` and ``empty`` keep packed weights in ordinary memory (a start that moves them onto huge
    pages afterwards, step by step: ``StepwiseRehome.start(tensors, min_bytes=MIN_BYTES)``)."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


@functools.cache
def available() -> bool:
    """Whether buffers are put on huge pages: Linux with ``MADV_HUGEPAGE``, THP not ``never``, and
    KVLOOM_HUGE_PAGES not 0."""
    if not envs.get_bool("KVLOOM_HUGE_PAGES", default=True):
        return False
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def mapped_zeros(nbytes: int, huge: bool) -> torch.Tensor:
    """uint8 [nbytes] in a private anonymous mapping (zero-filled by the kernel page by page at first touch:
    nothing is written or resident up front); with ``huge``, advised ``MADV_HUGEPAGE`` and starting on a 2 MiB
    boundary. The tensor's storage is exactly ``nbytes`` (torch.save writes no slack) and keeps the mapping."""
    slack = HUGE_PAGE if huge else 0
    # MAP_PRIVATE: a forked process gets its own copy on write, never the parent's pages.
    mapping = mmap.mmap(-1, nbytes + slack, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = 0
    if huge:
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without THP: 4 KiB pages, the same bytes
            pass
        base = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
        start = (-base) % HUGE_PAGE
    return torch.frombuffer(mapping, dtype=torch.uint8, offset=start, count=nbytes)


def zeros_many(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zeroed CPU tensors carved from one mapping (see mapped_zeros), each starting on a 4 KiB page boundary: on
    huge pages where available() and the whole is MIN_BYTES or more. A model's KV cache, every layer's keys and
    values, is one region whose 2 MiB pages are zero-filled as steps first write them, however small each layer's
    tensors are (a mapping per tensor below 2 MiB would fault per 4 KiB: ~12 ms a MiB on a Zen 4 VM)."""
    sizes = [math.prod(shape) * dtype.itemsize for shape in shapes]
    starts, total = [], 0
    for nbytes in sizes:
        starts.append(total)
        total += -(-nbytes // PAGE) * PAGE
    buffer = mapped_zeros(total, available() and total >= MIN_BYTES)
    return [buffer[start:start + nbytes].view(dtype).view(shape)
            for start, nbytes, shape in zip(starts, sizes, shapes, strict=True)]


def empty(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] for a packed weight to be written into once: on huge pages where available() and it is
    MIN_BYTES or more (a mapping zero-filled as first written: packing into it costs no copy after), else an
    ordinary uninitialised tensor."""
    if nbytes >= MIN_BYTES and available() and not _DEFERRED.get():
        return mapped_zeros(nbytes, True)
    return torch.empty(nbytes, dtype=torch.uint8)


def rehome(tensor: torch.Tensor) -> torch.Tensor:
    """A packed weight moved onto huge pages (a copy: same shape, dtype, values), where available() and it is a
    CPU tensor of MIN_BYTES or more; else the tensor itself."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or nbytes < MIN_BYTES or not available() or _DEFERRED.get():
        return tensor
    return _copied(tensor.contiguous().view(-1).view(torch.uint8)).view(tensor.dtype).view(tensor.shape)


def _copied(flat: torch.Tensor) -> torch.Tensor:
    """A uint8 copy of ``flat`` (contiguous uint8 bytes): on huge pages from MIN_BYTES, in ordinary memory below."""
    nbytes = flat.numel()
    out = mapped_zeros(nbytes, True) if nbytes >= MIN_BYTES else torch.empty(nbytes, dtype=torch.uint8)
    return out.copy_(flat)


class StepwiseRehome:
    """A model mapped from a file (worker/packed_cache.py) moved onto huge pages while it already serves.

    Mapped, a model is ready at once but streams its weights from the file's 4 KiB pages; copied at load, the start
    would wait ~1 s a GB (faulting the file's pages in, zeroing and filling the huge ones). Instead the model
    runner calls ``step()`` before each step: it copies storages the model's tensors view, up to ``STEP_BYTES`` a
    call (the large ones onto huge pages, the small ones into ordinary memory, so that the file's mapping is
    released whole once all have moved), and points every tensor viewing a copied storage at its copy (``set_``:
    the same tensor objects, so the layer stack's plan and the packed products read the new memory). No step runs
    meanwhile and no thread is added (a third busy thread on a 2-core box stalls the kernels' spinning workers);
    an 8B Q4_K_M's 6 GB move over its first ~24 steps, ~30 ms each. The values are the same bytes."""

    STEP_BYTES = 256 << 20

    def __init__(self, tensors: list[torch.Tensor], min_bytes: int = 1) -> None:
        groups: dict[int, list[torch.Tensor]] = {}
        for tensor in tensors:
            if tensor.device.type == "cpu" and tensor.untyped_storage().nbytes() >= min_bytes:
                groups.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
        # Largest first: those are the weights a step streams.
        self._groups = sorted(groups.values(), key=lambda g: -g[0].untyped_storage().nbytes())
        self._next = 0

    @classmethod
    def start(cls, tensors: list[torch.Tensor], min_bytes: int = 1) -> StepwiseRehome | None:
        """The move of these tensors' storages (those of ``min_bytes`` or more: MIN_BYTES for weights packed under
        deferred(); every one for a mapped model, whose file mapping is released once all have moved) where
        available() and there is something to move; else None."""
        if not available():
            return None
        rehome = cls(tensors, min_bytes)
        return rehome if rehome._groups else None

    @property
    def finished(self) -> bool:
        """Every storage moved."""
        return self._next == len(self._groups)

    def step(self, budget: int | None = None) -> int:
        """Move storages (at least one, then while ``budget`` bytes, STEP_BYTES by default, are not used up);
        only between steps. Returns the bytes moved."""
        budget = self.STEP_BYTES if budget is None else budget
        moved = 0
        with torch.no_grad(), torch.inference_mode(False):
            while not self.finished and (moved == 0 or moved < budget):
                group = self._groups[self._next]
                source = group[0].untyped_storage()
                nbytes = source.nbytes()
                storage = _copied(torch.empty(0, dtype=torch.uint8).set_(source)).untyped_storage()
                for tensor in group:
                    tensor.set_(storage, tensor.storage_offset(), tensor.shape, tensor.stride())
                self._next += 1
                moved += nbytes
        return moved

    def finish(self) -> None:
        """Move everything now (tests, and a caller that wants the move done before timing)."""
        while not self.finished:
            self.step()

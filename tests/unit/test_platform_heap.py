"""release_freed_heap hands glibc's freed heap pages back to the OS (what a model load leaves behind)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

_CHILD = """
import ctypes
from kvloom.platform import release_freed_heap

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]


def rss_mib():
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) // 1024


def fragment():  # 125 MiB of 64 KiB blocks (from the heap, not mmap), each pinned by a small block after it, freed
    blocks = []
    for _ in range(2000):
        block = libc.malloc(64 * 1024)
        ctypes.memset(block, 1, 64 * 1024)
        blocks.append(block)
        libc.malloc(32)
    for block in blocks:
        libc.free(block)


fragment()  # the heap as a load leaves it: its pages touched, freed, still resident (more than imports left free)
held = rss_mib()
release_freed_heap()
print(held, rss_mib())
"""


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_release_freed_heap_returns_freed_pages() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True)
    held, released = map(int, out.stdout.split())
    assert held - released >= 60, (held, released)  # 125 MiB freed in the middle of the heap

"""Which device runs the model, and how the host is set up for it."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from kvloom.cpu_capability import ATEN_CAPABILITY, ONEDNN_MAX_ISA, cpu_capability

logger = logging.getLogger("kvloom")


# What configure_host reads of an EngineConfig, as protocols: the config sits above the platform (its
# resolve_config asks the platform for the device and dtype), so the platform names no config class.
class _ThreadSettings(Protocol):
    num_threads: int | None


class HostSettings(Protocol):
    tensor_parallel_size: int
    cpu_omp_threads_bind: str | None

    @property
    def backend(self) -> _ThreadSettings: ...


def resolve_device(requested: str) -> torch.device:
    """'auto' picks CUDA when torch sees a GPU, else the CPU; a device that is absent is a ValueError."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {requested!r} was requested but torch sees no CUDA GPU here; "
                             f"use device='cpu' or 'auto'")
        device = torch.device(requested)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {requested!r} does not exist: torch sees "
                             f"{torch.cuda.device_count()} GPU(s)")
        return device
    cpu_capability()  # a KVLOOM_CPU_ISA this CPU lacks is a ValueError here, before anything is built
    return torch.device("cpu")


def resolve_dtype(requested: str, stored: str | None, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 for checkpoints stored in 16 bits or quantized, float32 for float32 ones; on a CPU
    bfloat16 only where it has a fast bf16 product (kvloom's GEMM: AVX512-BF16 or AVX2; oneDNN's: AVX-512),
    float32 elsewhere (the generic level: torch's bf16 products there are several times slower than its fp32
    ones)."""
    if requested != "auto":
        dtype = getattr(torch, requested)
    elif stored == "float32":
        dtype = torch.float32
    elif stored == "float16" and device.type == "cuda":
        dtype = torch.float16
    elif device.type == "cpu" and not cpu_has_fast_bf16():
        dtype = torch.float32
    else:
        dtype = torch.bfloat16
    if dtype == torch.float16 and device.type == "cpu":
        raise ValueError("dtype float16 is slow and inexact on the CPU; use bfloat16 or float32")
    return dtype


def cpu_has_fast_bf16() -> bool:
    """Whether a bf16 linear layer runs one of the fast packed GEMMs on this CPU (ops/cpu.py linear_format)."""
    from kvloom.ops import cpu

    return cpu.linear_format(torch.bfloat16) is not None


def torch_level_mismatch() -> str | None:
    """Why torch's own kernels run above the level in force (it dispatched before kvloom set the cap), or
    None."""
    torch_level = torch.backends.cpu.get_cpu_capability().lower()
    expected = ATEN_CAPABILITY[cpu_capability().level]
    rank = {"default": 0, "avx2": 1, "avx512": 2}
    if torch_level in rank and rank[torch_level] > rank[expected]:
        return (f"torch's own kernels run at {torch_level.upper()} although KVLOOM_CPU_ISA caps the level at "
                f"{cpu_capability().level}: torch ran a CPU op before kvloom was imported; set "
                f"ATEN_CPU_CAPABILITY={expected} and ONEDNN_MAX_CPU_ISA={ONEDNN_MAX_ISA[cpu_capability().level]} "
                f"in the environment, or import kvloom first")
    return None


@functools.cache
def log_cpu_capability() -> None:
    """Once per process: what the CPU offers and what kvloom runs on it (kvloom env shows more)."""
    from kvloom.ops import cpu

    logger.info("CPU: %s; kernels: %s", cpu_capability().describe(), cpu.compiled_isa() or "none built")
    mismatch = torch_level_mismatch()
    if mismatch:
        logger.warning("%s", mismatch)


def configure_host(config: HostSettings, device: torch.device) -> None:
    """On the CPU: torch's thread count, and a one-rank engine's cores when cpu_omp_threads_bind names them
    (with several ranks the tensor-parallel executor pins each; a replica's router hands it its list)."""
    if device.type == "cpu":
        from kvloom import cpu_affinity

        log_cpu_capability()
        threads = config.backend.num_threads or os.cpu_count() or 1
        if config.tensor_parallel_size == 1:
            cpus = cpu_affinity.plan(config.cpu_omp_threads_bind, 1, cpu_affinity.usable_cpus())[0]
            if cpus is not None and cpu_affinity.bind(cpus):
                threads = config.backend.num_threads or len(cpus)
                logger.info("pinned to CPU core(s) %s, %d torch thread(s)", cpu_affinity.format_cpu_list(cpus),
                            threads)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def release_freed_heap() -> None:
    """Hand the C heap's free pages back to the OS where the C library is glibc (``malloc_trim``): loading reads,
    converts and packs weights through temporaries of tens of MB each, which glibc keeps mapped once freed (on
    SmolLM2's 4-bit load, 105 of the 530 MB resident). Elsewhere (musl, macOS) nothing to do."""
    if sys.platform != "linux":
        return
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build modules whose parameters are created in ``dtype`` (torch's default dtype, restored after)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)

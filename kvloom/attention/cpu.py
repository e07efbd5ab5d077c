"""Attention on the CPU by one C++ kernel per layer call (csrc/paged_attention.cpp).

The kernel reads each cached K/V row in place, once per group of query heads that share it,
for decodes and prefill chunks alike, so the whole flat batch is one call. It is compiled at first
use (-O3 -march=native, OpenMP; 10-60 s) into ``$KVLOOM_CACHE_DIR/extensions`` and loaded
from there by later processes without compiling. When it cannot be built, ``cpu_kernel_available()``
is False (after one warning) and the registry falls back to the native backend.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from kvloom import envs
from kvloom.attention.metadata import AttentionMetadata
from kvloom.attention.reference import write_kv_cache

logger = logging.getLogger("kvloom")

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
# Compiled into the same library: fused norm / rotary / activation ops and the small-batch bf16 GEMM
# (kvloom/layers uses them).
SOURCES = (SOURCE, Path(__file__).parent / "csrc" / "fused_ops.cpp", Path(__file__).parent / "csrc" / "gemm.cpp")
HEADER = Path(__file__).parent / "csrc" / "cpu_capability.h"  # included by both
# Tried in order: tuned for this CPU, then portable (for compilers that reject -march=native).
BUILD_VARIANTS = (("native", ["-march=native"]), ("portable", []))
BUILD_LOCK_TIMEOUT_S = 900


def extension_dir() -> Path:
    root = envs.get("KVLOOM_CACHE_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "kvloom"
    return base / "extensions"


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU model and its feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _build_key(flags: list[str]) -> str:
    """Everything the binary depends on: a change in any of them builds a new one beside the old."""
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in (*SOURCES, HEADER)))
    for part in (" ".join(flags), torch.__version__, sys.version, platform.machine(),
                 _cpu_identity() if "-march=native" in flags else ""):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


@contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch runs `ninja` from PATH, where pip's ninja package is only in an activated venv."""
    path = os.environ.get("PATH", "")
    try:
        import ninja

        os.environ["PATH"] = os.pathsep.join([path, ninja.BIN_DIR])
    except (ImportError, AttributeError):
        pass
    try:
        yield
    finally:
        os.environ["PATH"] = path


def _load_or_build(variant: str, flags: list[str]) -> None:
    """Load the variant's library into torch.ops, compiling it first unless it is cached.

    A file lock around both steps makes concurrent processes build once: the others wait, then
    load what the first one built.
    """
    from filelock import FileLock  # a torch dependency

    key = _build_key(flags)
    name = f"kvloom_paged_attention_{variant}_{key}"
    directory = extension_dir() / name
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"{name}.so"
    with FileLock(str(directory) + ".lock", timeout=BUILD_LOCK_TIMEOUT_S):
        if library.exists():
            try:
                torch.ops.load_library(str(library))
                return
            except OSError as e:  # left half-written by a build that was killed
                logger.debug("rebuilding %s: %s", library, e)
                library.unlink()
        from torch.utils import cpp_extension  # 0.3 s to import: only when compiling

        # We hold the lock, so a 'lock' file of torch's own is stale (its builder died).
        (directory / "lock").unlink(missing_ok=True)
        logger.info("Compiling the CPU attention kernel (%s), once; cached in %s", variant, directory)
        start = time.perf_counter()
        with _ninja_on_path():
            cpp_extension.load(name=name, sources=[str(source) for source in SOURCES],
                               extra_cflags=["-O3", "-fopenmp", *flags], extra_ldflags=["-fopenmp"],
                               build_directory=str(directory),
                               is_python_module=False, verbose=False)
        logger.info("Compiled the CPU attention kernel in %.1f s", time.perf_counter() - start)


@functools.cache
def load_cpu_kernel() -> str | None:
    """Loads torch.ops.kvloom.paged_attention (the first call may compile it); None, or why it failed."""
    errors = []
    for variant, flags in BUILD_VARIANTS:
        try:
            _load_or_build(variant, flags)
        except Exception as e:  # a missing compiler or ninja, a failed build, a lock timeout
            errors.append(f"{variant}: {_build_error(e)}")
            continue
        _register_fake()
        return None
    error = "; ".join(errors)
    logger.warning("The CPU attention kernel could not be built, so attention falls back to 'native' (%s)", error)
    return error


def _build_error(error: Exception) -> str:
    """The line of a failed build that says why (a compiler's error, a missing program)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if (re.search(r"\berror\b|not found|unrecognized|cannot|required", line, re.IGNORECASE)
                and not line.startswith(("Error building extension", "FAILED", "["))):
            return line
    return lines[-1] if lines else type(error).__name__


def cpu_kernel_available() -> bool:
    return load_cpu_kernel() is None


def _register_fake() -> None:
    """Shapes-only version of the op for torch.compile's tracing: it writes `out` and returns nothing."""
    try:
        torch.library.register_fake("kvloom::paged_attention")(lambda *args: None)
    except RuntimeError:  # already registered (a second variant in one process cannot happen)
        pass


def query_start_loc_tensor(metadata: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """metadata.query_start_loc as a [B + 1] int64 tensor, built once per step and kept on the metadata."""
    if metadata.query_start_loc_tensor is None:
        metadata.query_start_loc_tensor = torch.tensor(metadata.query_start_loc, dtype=torch.long, device=device)
    return metadata.query_start_loc_tensor


def attention_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  key_cache: torch.Tensor, value_cache: torch.Tensor,
                  metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """query: [T, Hq, D]; key, value: [T, Hkv, D] (this step's); returns [T, Hq, D]."""
    if key_cache.is_contiguous() and value_cache.is_contiguous():
        # The kernel copies rows with any token/head stride, but each row must be contiguous.
        key = key if key.stride(-1) == 1 else key.contiguous()
        value = value if value.stride(-1) == 1 else value.contiguous()
        torch.ops.kvloom.write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
    else:
        write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
    out = torch.empty_like(query)
    torch.ops.kvloom.paged_attention(out, query, key_cache, value_cache, metadata.block_table,
                                     metadata.seq_lens, query_start_loc_tensor(metadata, query.device),
                                     scale, metadata.sliding_window or 0)
    return out

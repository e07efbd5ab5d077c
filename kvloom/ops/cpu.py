"""The CPU ops: one C++ library (csrc/) built at first use, and thin wrappers with the ops' signatures.

- attention (csrc/paged_attention.cpp): the kernel reads each cached K/V row in place, once per
  group of query heads that share it, for decodes and prefill chunks alike, so the whole flat batch
  is one call per layer;
- the KV-cache write, add+RMSNorm, rotary, SiLU-and-mul, a SigLIP tower's tanh gelu and argmax (csrc/fused_ops.cpp,
  vectorized);
- a vision tower's attention within a tile (csrc/dense_attention.cpp, ``dense_attention``): no mask, no cache,
  flash-style tiles, vdpbf16ps for Q K^T and P V in bf16;
- the bf16 GEMM (csrc/gemm.cpp): weights packed once after loading (``pack_linear``) into panels for an
  AVX512-BF16 micro-kernel (1.05-1.2x oneDNN at batch 64, about 2x at batches of 1-8 on SmolLM2's shapes,
  ``benchmarks/gemm_micro.py``) or, on AVX2, bf16 widened to fp32 in registers for FMAs; oneDNN's
  pre-packed linear where our kernel is not built, and beside it on a CPU with AMX, whose tiles run oneDNN's
  product 1.4-12x ours from 4 rows ("hybrid", ``AMX_MIN_ROWS``). All compute F.linear's answer: fp32 sums, rounded
  once.
- the int8 GEMMs (csrc/gemm_int8.cpp) for int8 weights (``pack_linear_int8``, ``PackedInt8Weight``):
  one packing into 48-column panels of 4-k groups serves W8A8 (activations quantized per token inside
  the op, exact int32 sums: AVX512-VNNI, or AVX2's vpmaddubsw with the weight's sign moved onto the
  activations) and weight-only (int8 widened to bf16 for AVX512-BF16, or to fp32 on AVX2; fp32 sums); a
  single row takes the weight-only product (W8A8 on AVX2), batches W8A8: 1.4-2x the bf16 GEMM on SmolLM2's
  shapes (``benchmarks/int8_micro.py``; the figures and the rule are at ``W8A8_MIN_ROWS``). Plain loops read
  the same layout where those instructions are missing (the op table then keeps ``NativeInt8Linear``). A block-scaled
  weight (a GGUF Q8_0 kept as stored, ``PackedInt8BlocksWeight``) reads the same panels with its block scales
  packed beside them, and multiplies activations quantized per (row, block of 32) at every batch size.

The kernels' loops run on torch's OpenMP threads, or with KVLOOM_CPU_THREAD_POOL=1 on kvloom's own thread
pool (csrc/parallel.h: torch.get_num_threads() threads, none of which a loop waits for if it has not
started, so a busy process beside does not stall a step; off by default, see parallel.h).

The library is compiled at first use (-O3, -march for the ISA level in force: kvloom.cpu_capability; 10-60 s)
into ``$KVLOOM_CACHE_DIR/extensions``, named by that level, and loaded from there by later processes without
compiling. When it
cannot be built, ``cpu_kernel_available()`` is False (after one warning) and the op table falls back
to the native ops.
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
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from kvloom import envs
from kvloom.cpu_capability import cpu_capability
from kvloom.ops import huge_pages
from kvloom.ops.int8 import BLOCK, Int8Blocks, Int8Rows, Q8_0Blocks, check_blocks_shape, compact_block_scales
from kvloom.ops.layer_stack import LayerShape, LayerWeights, StackArgs
from kvloom.ops.metadata import AttentionMetadata
from kvloom.ops.reference import write_kv_cache

logger = logging.getLogger("kvloom")

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
# Compiled into the same library: the fused norm / rotary / activation ops, the bf16 GEMM, the int8 and
# 4-bit GEMMs, the LoRA delta (lora.cpp) and the thread pool that all of them run their loops on.
SOURCES = (SOURCE, *(Path(__file__).parent / "csrc" / name
                     for name in ("fused_ops.cpp", "gemm.cpp", "gemm_int8.cpp", "gemm_q4.cpp", "parallel.cpp",
                                  "decoder.cpp", "lora.cpp", "dense_attention.cpp", "gemm_q4k.cpp")))
# Included by them: the ISA flags (all), the thread pool's loops, the int8/4-bit GEMMs' AVX2 columns and AMX tiles.
HEADERS = tuple(Path(__file__).parent / "csrc" / name
                for name in ("cpu_capability.h", "kernels.h", "parallel.h", "avx2_columns.h", "lora.h", "amx.h",
                             "amx_bf16.h", "transpose.h", "q4_panels.h", "part_rows.h"))
# Tried in order: built for the ISA level in force (kvloom.cpu_capability: this CPU's own -march=native, or
# the capped level's baseline), then portable (for compilers that reject those flags).
PORTABLE = ("portable", [])
BUILD_LOCK_TIMEOUT_S = 900


def extension_dir() -> Path:
    return envs.cache_dir() / "extensions"


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU model and its feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def build_variants() -> tuple[tuple[str, list[str]], ...]:
    """(name, compiler flags) to try in order: the level in force, then portable."""
    capability = cpu_capability()
    return ((capability.level, capability.compiler_flags()), PORTABLE)


def _build_key(flags: list[str]) -> str:
    """Everything the binary depends on: a change in any of them builds a new one beside the old. A build
    tuned for this CPU is keyed by its model and flags too, so a cache directory shared between machines
    (a home on NFS) never hands one CPU's library to another."""
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS)))
    for part in (" ".join(flags), torch.__version__, sys.version, platform.machine(),
                 _cpu_identity() if any("native" in flag for flag in flags) else ""):
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
    name = f"kvloom_cpu_{variant}_{key}"
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
    for variant, flags in build_variants():
        try:
            _load_or_build(variant, flags)
        except Exception as e:  # a missing compiler or ninja, a failed build, a lock timeout
            errors.append(f"{variant}: {_build_error(e)}")
            continue
        if errors:  # the portable build runs without this CPU's SIMD kernels: say why, once
            logger.warning("The CPU kernels' build for ISA level %s failed, so the portable one runs, without the "
                           "bf16 GEMM, the int8 kernels and the layer stack (%s)", cpu_capability().level,
                           "; ".join(errors))
        global loaded_variant
        loaded_variant = variant
        _register_fake()
        torch.ops.kvloom.use_thread_pool(envs.get_bool("KVLOOM_CPU_THREAD_POOL"))
        return None
    error = "; ".join(errors)
    logger.warning("The CPU attention kernel could not be built, so attention falls back to 'native' (%s)", error)
    return error


# Which build_variants() entry load_cpu_kernel loaded (an ISA level, or "portable"); None before it ran or when none
# did.
loaded_variant: str | None = None


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


def compiled_isa() -> str | None:
    """What the loaded library was compiled for ("avx512 (avx512_bf16, avx512_vnni)", "avx2", "generic"), or None
    where none loaded."""
    return torch.ops.kvloom.compiled_isa() if cpu_kernel_available() else None


def _register_fake() -> None:
    """Shapes-only versions of the ops for torch.compile's tracing: each writes its output argument and
    returns nothing."""
    for op in ("kvloom::paged_attention", "kvloom::paged_attention_softcap", "kvloom::dense_attention",
               "kvloom::gemm_w8a8",
               "kvloom::gemm_int8_weight_only", "kvloom::gemm_w8a8_blocks", "kvloom::gemm_q4",
               "kvloom::gemm_kquant"):
        try:
            torch.library.register_fake(op)(lambda *args: None)
        except RuntimeError:  # already registered (a second variant in one process cannot happen)
            pass


def query_start_loc_tensor(metadata: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """metadata.query_start_loc as a [B + 1] int64 tensor, built once per step and kept on the metadata."""
    if metadata.query_start_loc_tensor is None:
        metadata.query_start_loc_tensor = torch.tensor(metadata.query_start_loc, dtype=torch.long, device=device)
    return metadata.query_start_loc_tensor


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  key_cache: torch.Tensor, value_cache: torch.Tensor,
                  metadata: AttentionMetadata, scale: float, logit_softcap: float | None = None) -> torch.Tensor:
    """query: [T, Hq, D]; key, value: [T, Hkv, D] (this step's); returns [T, Hq, D]. ``logit_softcap``
    (Gemma 2): scores become cap * tanh(scores / cap) before the mask and softmax, as in the reference."""
    if key_cache.is_contiguous() and value_cache.is_contiguous():
        # The kernel copies rows with any token/head stride, but each row must be contiguous.
        key = key if key.stride(-1) == 1 else key.contiguous()
        value = value if value.stride(-1) == 1 else value.contiguous()
        torch.ops.kvloom.write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
    else:
        write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
    out = torch.empty_like(query)
    if logit_softcap is not None:
        if not logit_softcap > 0:
            raise ValueError(f"attention logit soft-capping must be a positive number, got {logit_softcap}")
        torch.ops.kvloom.paged_attention_softcap(out, query, key_cache, value_cache, metadata.block_table,
                                                 metadata.seq_lens, query_start_loc_tensor(metadata, query.device),
                                                 scale, metadata.sliding_window or 0, logit_softcap)
        return out
    torch.ops.kvloom.paged_attention(out, query, key_cache, value_cache, metadata.block_table,
                                     metadata.seq_lens, query_start_loc_tensor(metadata, query.device),
                                     scale, metadata.sliding_window or 0)
    return out


# ---- dense attention (a vision tower's, within a tile) ----------------------------------------------
# csrc/dense_attention.cpp against torch's SDPA (its CPU flash attention) at SmolVLM-256M's tower shape, 17 tiles x
# 12 heads x 1024 patches x head_dim 64, on the 2-core Zen 4 (benchmarks/attention_micro.py --dense; alternated,
# medians): bf16 with AVX512-BF16 ("pairs", vdpbf16ps) 2.2-2.6x (321-335 vs 129-145 GFLOP/s); fp32 on AVX-512
# ("float", fp32 FMAs) 1.1x; on AVX2 ("float" for bf16 and fp32 alike) 0.75-0.8x, so there torch's SDPA runs instead.
def dense_attention_kernel(dtype: torch.dtype, head_dim: int) -> str | None:
    """The kernel csrc/dense_attention.cpp runs for ``dtype`` and ``head_dim`` where it is faster than torch's SDPA:
    "pairs" (bf16 by vdpbf16ps) or "float" (fp32 FMAs, on AVX-512); None where SDPA runs (another dtype, a head_dim
    over the kernel's maximum, an AVX2 or generic build)."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16) or not cpu_kernel_available() \
            or not hasattr(torch.ops.kvloom, "dense_attention"):
        return None
    if not 1 <= head_dim <= torch.ops.kvloom.dense_attention_max_head_dim():
        return None
    kernel = torch.ops.kvloom.dense_attention_kernel(dtype, head_dim)
    return kernel if kernel == "pairs" or compiled_isa().startswith("avx512") else None


def dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """query [B, H, Lq, D], key and value [B, H, Lk, D] (any strides, rows contiguous: views of a fused qkv) ->
    softmax(Q K^T / sqrt(D)) V [B, H, Lq, D] with no mask, F.scaled_dot_product_attention's answer, by
    csrc/dense_attention.cpp where ``dense_attention_kernel`` names a kernel, else by SDPA. The kernel's result is
    laid out [B, Lq, H, D] in memory, so ``out.transpose(1, 2).reshape(B, Lq, H * D)`` copies nothing."""
    if (query.device.type != "cpu" or query.dim() != 4 or key.shape[2] == 0
            or not query.dtype == key.dtype == value.dtype
            or dense_attention_kernel(query.dtype, query.shape[-1]) is None):
        return F.scaled_dot_product_attention(query, key, value)
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    batch, heads, length, head_dim = query.shape
    out = query.new_empty(batch, length, heads, head_dim).transpose(1, 2)
    torch.ops.kvloom.dense_attention(out, query, key, value, head_dim ** -0.5)
    return out


def pairs_layout(head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
    """Whether the kernel reads these caches in the pairs layout (bf16 with AVX512-BF16, head_dim % 32 == 0,
    block_size % 16 == 0; ops/reference.py allocate_kv_cache): then nothing is transposed at attention time."""
    return dtype == torch.bfloat16 and bool(torch.ops.kvloom.pairs_layout_supported(head_dim, block_size))


# ---- the small ops --------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] -> a new [T, H]."""
    out = torch.empty_like(x)
    torch.ops.kvloom.rms_norm(out, x, weight, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: x (a fresh projection output) becomes the normed value, residual the sum."""
    torch.ops.kvloom.fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def rotary_embedding(positions: torch.Tensor, x: torch.Tensor, cos_cache: torch.Tensor,
                     sin_cache: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, heads, D] (a view of the fused qkv) in place, in fp32; caches [max_position, D // 2]."""
    torch.ops.kvloom.rotary_embedding(x, positions, cos_cache, sin_cache)
    return x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] as [gate | up] -> [T, I]."""
    out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
    torch.ops.kvloom.silu_and_mul(out, x)
    return out


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """gelu with tanh's approximation, written over x (csrc/fused_ops.cpp: x / (1 + exp(-2u)) in fp32, vectorized):
    on SigLIP's [17, 1024, 3072] in bf16 20 ms against F.gelu's 84-114 ms, of which a new output's page faults alone
    cost ~25 ms. The caller must own x (a projection's fresh output)."""
    if not x.is_contiguous():
        x = x.contiguous()
    torch.ops.kvloom.gelu_tanh(x, x)
    return x


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits: [B, V] in any float dtype -> [B] int64, over the low-precision values (no fp32 copy)."""
    out = torch.empty(logits.shape[0], dtype=torch.long)
    torch.ops.kvloom.argmax_rows(out, logits.contiguous())
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Structured outputs: logits[rows[r], j] = -inf where bit j of bitmask[r] (int32 [R, W]) is 0, in place; a
    32-token word at a time (csrc/fused_ops.cpp). logits: contiguous [B, V], fp32 / bf16 / fp16."""
    torch.ops.kvloom.apply_token_bitmask(logits, bitmask.contiguous(), rows)


# ---- the GEMM -------------------------------------------------------------------------------------
# Output columns per packed panel of the int8 formats and of the AVX512-BF16 bf16 GEMM: 3 vectors of 16
# (csrc/gemm.cpp's kPanel there; gemm_panel() gives the loaded bf16 GEMM's).
GEMM_PANEL = 48


# On a CPU with AMX (Intel Xeon 4th gen on), oneDNN's bf16 products run on its tiles: on 2 cores of one, against
# kvloom's AVX512-BF16 GEMM at SmolLM2's shapes, 0.6-0.8x as fast at 1 row, even at 3, 1.1-1.25x at 4, 1.4-2x at 8,
# 5.6-6.3x at 64 and 5.6-12x at 512 (ad-hoc timing of PackedWeight both ways, medians of 5). A "hybrid" weight
# holds kvloom's panels and oneDNN's packing (twice the bf16 bytes) and takes oneDNN's from AMX_MIN_ROWS rows; a step
# of as many tokens runs the layers module by module (the layer stack calls kvloom's GEMM only; from 8 tokens that is
# 1.13x the stack at N=8, from 4 the same again, benchmarks/compare.py).
# A weight too large for the caches streams from memory at 1 row either way (2048 x 8192: 0.94x, 4096 x 4096:
# 1.03x), so from AMX_ONLY_ELEMENTS values it holds oneDNN's packing alone, not twice its bytes (a 7B model's
# every projection; a 1B model's MLP).
# The two products sum in different orders, so which one a row gets depends on how many rows share its step. Since
# kvloom's own GEMM takes AMX-BF16 tiles at every row count (csrc/amx_bf16.h panel_product), it is ahead of the hybrid
# there too (SmolLM2 in bf16 on a 2-core AMX Xeon: 945.7 vs 862.9 tok/s at N=64, 365.3 vs 284.6 at N=8), so the hybrid
# runs only under KVLOOM_CPU_ONEDNN=force, on any CPU: the path of oneDNN's opaque packing kept tested.
AMX_MIN_ROWS = 4
AMX_ONLY_ELEMENTS = 1 << 24


def batch_invariant() -> bool:
    """Whether every product must keep one arithmetic at every row count (KVLOOM_BATCH_INVARIANT, default on): then
    no product switches formula by the number of rows in a step, and a greedy request's tokens do not depend on
    the requests beside it."""
    return envs.get_bool("KVLOOM_BATCH_INVARIANT", default=True)


def q4_bf16_activations(choice: str | None = None) -> bool:
    """Whether bf16 activations on a 4-bit weight with fp16 scales per 32 take the table product, bf16 at every row
    count on AMX-BF16 tiles (``choice`` "bf16": the backend's q4_activations, else KVLOOM_Q4_ACTIVATIONS=bf16, on a
    CPU with them), instead of llama.cpp's int8 one."""
    raw = (choice or envs.get("KVLOOM_Q4_ACTIVATIONS") or "int8").lower()
    if raw not in ("int8", "bf16"):
        raise ValueError(f"q4_activations (KVLOOM_Q4_ACTIVATIONS) must be int8 or bf16, got {raw!r}")
    return raw == "bf16" and q4_table_product()


def q4_table_product() -> bool:
    """Whether this CPU and build run csrc/gemm_q4.cpp's table product (AMX-BF16 tiles granted, KVLOOM_CPU_AMX not
    0): bf16 x on a 4-bit weight with fp16 scales per 32, one formula at every row count."""
    return cpu_kernel_available() and bool(torch.ops.kvloom.q4_table_product())


def onednn_mode() -> str:
    """KVLOOM_CPU_ONEDNN: "auto" (the default), "force" or "off"."""
    raw = (envs.get("KVLOOM_CPU_ONEDNN") or "auto").lower()
    if raw in ("0", "off", "false", "no"):
        return "off"
    if raw not in ("auto", "force"):
        raise ValueError(f"KVLOOM_CPU_ONEDNN={raw!r}: expected auto, force or 0")
    return raw


def _onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear_format(dtype: torch.dtype) -> str | None:
    """The fastest packed GEMM this process has for ``dtype`` on the CPU, or None (F.linear): kvloom's (on AMX
    tiles where the CPU has them); with oneDNN's beside it ("hybrid") under KVLOOM_CPU_ONEDNN=force; or oneDNN's
    alone where kvloom's library is not built."""
    if dtype != torch.bfloat16:
        return None
    mode = onednn_mode()
    onednn = mode != "off" and _onednn_linear_available()
    if cpu_kernel_available() and hasattr(torch.ops.kvloom, "gemm_bf16"):
        return "hybrid" if onednn and mode == "force" else "kvloom"
    # oneDNN refuses bf16 weights where the CPU lacks AVX-512 BW/VL/DQ and AVX-NE-CONVERT (or the level is capped).
    if onednn and (cpu_capability().onednn_bf16 or mode == "force"):
        return "onednn"
    return None


def weight_format(fmt: str, weight: torch.Tensor) -> str:
    """The packing of one weight under ``linear_format``'s answer: a hybrid's large weights take oneDNN's alone."""
    return "onednn" if fmt == "hybrid" and weight.numel() >= AMX_ONLY_ELEMENTS else fmt


def gemm_panel() -> int:
    """Output columns per panel of the loaded bf16 GEMM: 48 with AVX512-BF16 (3 vectors of 16), 16 with AVX2
    (2 vectors of 8: one 64-byte line per k pair, so a panel streams from memory in order)."""
    return int(torch.ops.kvloom.gemm_panel())


def pack_gemm_weight(weight: torch.Tensor, panel: int = GEMM_PANEL) -> torch.Tensor:
    """[N, K] -> [ceil(N / panel), ceil(K / 2), panel, 2]: per panel of ``panel`` output columns and k pair,
    the columns' (W[n, 2p], W[n, 2p + 1]) words in a row. Padding is zero."""
    n, k = weight.shape
    panels, pairs = -(-n // panel), -(-k // 2)
    padded = weight.new_zeros(panels * panel, pairs * 2)
    padded[:n, :k] = weight
    return padded.view(panels, panel, pairs, 2).permute(0, 2, 1, 3).contiguous()


def packed_panel_rows(data: torch.Tensor, ids: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows ``ids`` [T] of a weight packed in panels of columns, [panels, K / group, panel, group] (pack_gemm_weight,
    pack_int8_weight), or of per-column values [panels, K / 32, panel] (pack_block_columns): [T, in_features] in the
    packing's dtype."""
    panel = data.shape[2]
    panels, column = torch.div(ids, panel, rounding_mode="floor"), ids % panel
    return data[panels, :, column].reshape(ids.shape[0], -1)[:, :in_features]


# oneDNN's packings of PackedWeights, made inside the product and held here, off the weights' attributes: an opaque
# tensor (no storage) that cannot be pickled, mapped or moved, so what the model holds stays plain tensors.
_ONEDNN_PACKINGS: weakref.WeakKeyDictionary[PackedWeight, tuple[torch.Tensor, torch.Tensor | None]] = \
    weakref.WeakKeyDictionary()


def onednn_dtype() -> torch.dtype:
    """The dtype oneDNN's packed product runs in here: bf16 where oneDNN has a bf16 product (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT), else fp32 (KVLOOM_CPU_ONEDNN=force on AVX2: the bf16 weight and activations widened, exact)."""
    return torch.bfloat16 if cpu_capability().onednn_bf16 else torch.float32


class PackedWeight:
    """A weight (and bias) repacked once for a fast GEMM; calling it gives F.linear(x, W, b).

    Its state is plain tensors on every CPU: kvloom's panels (``data``, formats "kvloom" and "hybrid") or, for
    oneDNN's product alone ("onednn"), the weight as given (``weight``; dropped once oneDNN's packing holds it, and
    read back from that packing to pickle). oneDNN's packing is made inside the product, at the first call that
    takes it (at construction for "onednn"), and held off the attributes (``_ONEDNN_PACKINGS``): the packed-model
    cache, the huge-page move and pickling see only the plain tensors."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, batch_hint: int = 64) -> None:
        if fmt not in ("kvloom", "onednn", "hybrid"):
            raise ValueError(f"unknown packed weight format {fmt!r}; expected 'kvloom', 'onednn' or 'hybrid'")
        self.format = fmt
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.batch_hint = batch_hint
        # Whether rows() can read the weight back (kvloom's panels).
        self.holds_rows = fmt in ("kvloom", "hybrid")
        self.data: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        if self.holds_rows:
            self.data = huge_pages.rehome(pack_gemm_weight(weight, gemm_panel()))
            self.bias = None if bias is None else bias.float()  # added to the fp32 sums before rounding
        # oneDNN's bias, in the weight's dtype (F.linear's).
        self.onednn_bias = bias if fmt in ("onednn", "hybrid") else None
        self.onednn_min_rows = AMX_MIN_ROWS if fmt == "hybrid" else 0
        if fmt == "onednn":
            self.weight = weight.contiguous()
            self._onednn_packing()
        elif fmt == "hybrid":
            self._onednn_packing(weight)

    def _onednn_packing(self, weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """oneDNN's packing of the weight and its bias (made once, from ``weight``, the plain weight, or kvloom's
        panels)."""
        packing = _ONEDNN_PACKINGS.get(self)
        if packing is None:
            if weight is None:
                weight = self.weight if self.weight is not None else self.rows(torch.arange(self.out_features))
            dtype = onednn_dtype()
            bias = None if self.onednn_bias is None else self.onednn_bias.to(dtype)
            packing = (torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), self.batch_hint), bias)
            _ONEDNN_PACKINGS[self] = packing
            self.weight = None  # oneDNN's packing holds it now (__getstate__ reads it back)
        return packing

    def __getstate__(self) -> dict:
        state = dict(vars(self))
        if self.format == "onednn" and self.weight is None:
            state["weight"] = _ONEDNN_PACKINGS[self][0].to_dense().to(self.dtype)
        return state

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [T] of the weight from kvloom's panels (a tied embedding reads its table here,
        layers/embedding.py; only where ``holds_rows``)."""
        return packed_panel_rows(self.data, ids, self.in_features)

    def stack_args(self) -> StackArgs | None:
        """How csrc/decoder.cpp's plan calls this product; None: oneDNN's product, which it cannot call."""
        return None if self.format == "onednn" else StackArgs(STACK_BF16, [self.data, self.bias])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.format != "kvloom" and x.numel() >= self.onednn_min_rows * self.in_features:
            weight, bias = self._onednn_packing()
            out = torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, bias, "none", [], "")
            return out.to(x.dtype)
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = x.new_empty(*x.shape[:-1], self.out_features)
        torch.ops.kvloom.gemm_bf16(out.view(-1, self.out_features), rows, self.data, self.bias)
        return out


# ---- every decoder layer in one call ----------------------------------------------------------------
# The projections' kinds in csrc/decoder.cpp's plan (its Projection::Kind).
STACK_BF16, STACK_INT8_ROWS, STACK_INT8_BLOCKS = 0, 1, 2  # and q4.STACK_Q4 = 3


class LlamaLayerStack:
    """A Llama model's decoder layers as one native call (csrc/decoder.cpp): the kernels the layers' modules
    call one by one, in the same order on the same buffers (bit-identical hidden states), without the
    ~300 trips through Python and the dispatcher a step of SmolLM2-135M makes. ``llama_layer_stack`` says
    which models qualify."""

    def __init__(self, layers: list[LayerWeights], products: list[list[StackArgs]],
                 shape: LayerShape, hidden_size: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """products: per layer, the stack_args() of its qkv, o, gate_up and down products."""
        norms: list[torch.Tensor] = []
        projections: list[torch.Tensor | None] = []
        kinds: list[int] = []
        min_rows: list[int] = []
        tiles: list[int] = []
        for layer, layer_products in zip(layers, products):
            norms += [layer.input_norm, layer.post_norm]
            for args in layer_products:
                kinds.append(args.kind)
                min_rows.append(args.w8a8_min_rows)
                tiles.append(int(args.bf16_tiles))
                projections += args.tensors + [None] * (4 - len(args.tensors))
        dims = [shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size, hidden_size]
        # What the plan is built from: kept to build it again where the stack is unpickled (loader/packed_cache.py).
        self._plan_args = (norms, projections, kinds, min_rows, tiles, cos, sin, dims, shape.eps, shape.scale)
        self._plan = torch.classes.kvloom.LlamaLayerStack(*self._plan_args)
        # LoRA (kvloom/lora/model_manager.py): each token's compute slot [T] int64 for the next calls, or None.
        self.lora_token_slots: torch.Tensor | None = None
        # Steps of more tokens run module by module, where a hybrid weight takes oneDNN's AMX product.
        hybrid = any(getattr(packed, "format", None) == "hybrid" for layer in layers
                     for packed in (layer.qkv, layer.o, layer.gate_up, layer.down))
        self.max_rows = AMX_MIN_ROWS - 1 if hybrid else sys.maxsize

    def __getstate__(self) -> dict:
        state = dict(vars(self))
        del state["_plan"]  # a native object: built again from its arguments
        return state

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self._plan = torch.classes.kvloom.LlamaLayerStack(*self._plan_args)

    def takes(self, rows: int) -> bool:
        """Whether a step of ``rows`` tokens should run here (else module by module: see AMX_MIN_ROWS)."""
        return rows <= self.max_rows

    def set_lora(self, lora_a: list[torch.Tensor], lora_b_t: list[torch.Tensor], shard_rank: int) -> None:
        """The adapters' compute slots, per layer those of qkv, o, gate_up, down (csrc/lora.h's layout: A
        [S, R, in], B^T [S, R, out]); held by reference, so slots filled in place are seen by the next step."""
        self._plan.set_lora(lora_a, lora_b_t, shard_rank)

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the embeddings [T, H], which become the residual stream (updated in place, as the layers'
        fused add + RMSNorm do) -> (the last layer's output, the residual stream) for the final norm."""
        args = (hidden, positions, [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches], metadata.slot_mapping,
                metadata.block_table, metadata.seq_lens, query_start_loc_tensor(metadata, hidden.device),
                metadata.sliding_window or 0)
        if self.lora_token_slots is not None:  # each projection's output gets its tokens' LoRA deltas
            return self._plan.forward_lora(*args, self.lora_token_slots)
        return self._plan.forward(*args)


def layer_stack_available() -> bool:
    """Whether the library holds csrc/decoder.cpp's plan (built with kvloom's bf16 GEMM: AVX512-BF16 or AVX2)."""
    try:
        return torch.classes.kvloom.LlamaLayerStack is not None
    except RuntimeError:  # torch.classes raises this, not AttributeError, for a class never registered
        return False


def llama_layer_stack(layers: list[LayerWeights], shape: LayerShape, hidden_size: int, cos: torch.Tensor,
                      sin: torch.Tensor) -> LlamaLayerStack | None:
    """The stack of these layers, or None where one does not qualify: every projection one of this module's
    packed products (kvloom's bf16 GEMM, the int8 ones; not oneDNN's), contiguous norm weights and caches,
    and the library built with the bf16 GEMM (AVX512-BF16 or AVX2). KVLOOM_CPU_LAYER_STACK=0 turns it off (every
    layer then runs module by module, the reference)."""
    if not envs.get_bool("KVLOOM_CPU_LAYER_STACK", default=True) or not layer_stack_available():
        return None
    products = []
    for layer in layers:
        # A projection the plan cannot call (F.linear, oneDNN, torch's int8 ops) has no stack_args, or gives None.
        args = [getattr(packed, "stack_args", lambda: None)()
                for packed in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if None in args or not (layer.input_norm.is_contiguous() and layer.post_norm.is_contiguous()):
            return None
        products.append(args)
    return LlamaLayerStack(layers, products, shape, hidden_size, cos, sin)


# ---- the int8 GEMMs -------------------------------------------------------------------------------
# k per group of the int8 panels (csrc/gemm_int8.cpp's kGroup: vpdpbusd sums 4 products per lane).
INT8_GROUP = 4
INT8_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)
# Rows from which PackedInt8Weight runs the W8A8 product instead of the weight-only one, from
# benchmarks/int8_micro.py on this project's CPU (AMD Zen 4, 2 cores, shared with other jobs, so one
# thread: two threads' medians were scheduler stalls; bf16 activations; medians of 7-31 alternated
# repeats; speed-up over kvloom's bf16 GEMM in two runs a few minutes apart):
#
#     rows  weights                           bf16 GEMM      W8A8            weight-only
#        1  hot, K 576 -> N 960 / 576 / 3072  21 / 15 / 56 us x1.50 - x1.83   x0.72 - x0.86
#        1  30 layers streamed (the decode)   28 - 31 ms     x2.01, x1.57    x1.70, x1.89
#        2  30 layers streamed                30 ms          x2.20           x1.68
#        8  hot, the 4 layer shapes                          x1.61 - x1.90   x0.65 - x0.80
#        8  30 layers streamed                22 - 47 ms     x1.76, x1.39    x0.91, x0.59
#       64  hot, the 4 layer shapes                          x1.73 - x1.89   x0.22 - x0.77
#       64  30 layers streamed                167 - 187 ms   x1.96, x1.85    x0.71, x0.79
#     2048  hot, the 4 layer shapes                          x1.57 - x2.61   x0.61 - x0.72
#
# W8A8 is the faster product wherever the two differ beyond the noise; at one row with the weights
# streamed from memory (a decode step: SmolLM2-135M's 106 MB of int8 layers do not fit the 32 MB L3)
# both wait on memory and swap places between runs, so the one row goes to the weight-only product,
# which is the more accurate: W8A8 rounds the activations to 8 bits per token, and on random
# [64, 576] x [576, 576] products its error is 1.4x the weight-only one's (1.1% vs 0.8% relative),
# 3.5-5x with a few outlier channels 10-50x the rest (as LLM activations have). The weight-only
# kernel loses in cache because it spends 5 instructions widening each 32 weights to bf16
# (vpmovsxbd, vcvtdq2ps, vcvtne2ps2bf16; a vpmovsxbw + shift variant measured the same). fp32
# activations order the two the same way (W8A8 1.4-3.2x the weight-only kernel at 1, 8, 64 rows).
W8A8_MIN_ROWS = 2
# On AVX2 the weight-only kernel widens every weight to fp32 (two conversions per 8 weights for the FMAs
# they feed), which makes it the slower product even at one row: benchmarks/int8_micro.py --threads 1 on
# the AVX2 EPYC, one row, against the bf16 GEMM: hot weights W8A8 x1.5-2.1, weight-only x1.2-1.4; 30 layers
# streamed W8A8 x1.13, weight-only x0.82. There W8A8 runs from one row (and a request's products then do
# not depend on the batch it lands in).
W8A8_MIN_ROWS_AVX2 = 1


def w8a8_min_rows() -> int:
    """Rows from which PackedInt8Weight takes the W8A8 product on this CPU (with int8 activations on): from one row
    where products must not depend on the batch (KVLOOM_BATCH_INVARIANT, the default) and on AVX2."""
    return W8A8_MIN_ROWS_AVX2 if compiled_isa() == "avx2" or batch_invariant() else W8A8_MIN_ROWS
# The widest K whose W8A8 int32 sums cannot overflow (csrc/gemm_int8.cpp's kMaxW8A8K): wider weights
# always take the weight-only product.
W8A8_MAX_IN_FEATURES = (2**31 - 1) // (255 * 127)


def int8_kernels_available() -> bool:
    """True where the library holds fast W8A8 and weight-only int8 kernels (AVX-512 with VNNI and BF16, or
    AVX2 with FMA: every build above the generic level)."""
    return cpu_kernel_available() and hasattr(torch.ops.kvloom, "int8_gemm_kernels") \
        and torch.ops.kvloom.int8_gemm_kernels() == 3


def pack_int8_weight(qweight: torch.Tensor, flip: bool = False) -> torch.Tensor:
    """int8 [N, K] -> [ceil(N / 48), ceil(K / 4), 48, 4]: per panel of 48 output columns and group of
    4 k, the 48 columns' (q[n, 4g], ..., q[n, 4g + 3]) in a row. Padding is zero. ``flip``: every byte's top bit
    flipped, padding included (q + 128 as u8, in int8 storage). In one C++ pass where the library is built
    (``pack_int8_panels``), else by torch (pack_int8_weight_reference)."""
    if cpu_kernel_available() and qweight.stride(-1) == 1:
        return torch.ops.kvloom.pack_int8_panels(qweight, flip)
    return pack_int8_weight_reference(qweight, flip)


def pack_int8_weight_reference(qweight: torch.Tensor, flip: bool = False) -> torch.Tensor:
    """pack_int8_weight by torch ops: pad, permute, copy (and XOR)."""
    n, k = qweight.shape
    panels, groups = -(-n // GEMM_PANEL), -(-k // INT8_GROUP)
    padded = qweight.new_zeros(panels * GEMM_PANEL, groups * INT8_GROUP)
    padded[:n, :k] = qweight
    out = padded.view(panels, GEMM_PANEL, groups, INT8_GROUP).permute(0, 2, 1, 3).contiguous()
    return out.view(torch.uint8).bitwise_xor(0x80).view(torch.int8) if flip else out


class _PackedInt8Linear:
    """What the packed int8 linears share: x [..., in] -> [..., out] in x's dtype, the kernel called on
    x's rows as one contiguous [M, in] matrix (``_compute(out, rows)``)."""

    in_features: int
    out_features: int

    def _compute(self, out: torch.Tensor, rows: torch.Tensor) -> None:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step makes ~120 of these calls on a few rows: every tensor op saved here is a
        # microsecond (the kernel itself takes 2-30 us on SmolLM2's layers).
        if x.dtype not in INT8_ACTIVATION_DTYPES:
            raise ValueError(f"the int8 CPU linear takes float32 or bfloat16 activations, got {x.dtype}")
        flat = x.dim() == 2
        rows = x if flat else x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty((rows.shape[0], self.out_features), dtype=x.dtype)
        self._compute(out, rows)
        return out if flat else out.view(*x.shape[:-1], self.out_features)


class PackedInt8Weight(_PackedInt8Linear):
    """An int8 weight (per-channel scale, optional bias) packed once for csrc/gemm_int8.cpp; calling it
    gives the W8A8 product (``w8a8_linear_reference``) for batches of ``w8a8_min_rows`` rows or more and
    the weight-only one (``int8_linear_reference``) below, in x's dtype (float32 or bfloat16). On an AMX-BF16 CPU,
    with ``bf16_tiles`` (the default), bf16 x of ``bf16_tiles_min_rows("int8_rows")`` rows or more (in_features a
    multiple of 32) takes the weight-only product's arithmetic on AMX-BF16 tiles (csrc/amx_bf16.h) instead."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 w8a8_min_rows: int = W8A8_MIN_ROWS, bf16_tiles: bool = True) -> None:
        if qweight.dim() != 2 or qweight.dtype != torch.int8:
            raise ValueError(f"PackedInt8Weight takes an int8 [out, in] weight, got {qweight.dtype} "
                             f"of shape {tuple(qweight.shape)}")
        self.out_features, self.in_features = qweight.shape
        for name, t in (("scale", scale), ("bias", bias)):
            if t is not None and t.shape != (self.out_features,):
                raise ValueError(f"PackedInt8Weight: {name} must have shape ({self.out_features},), "
                                 f"got {tuple(t.shape)}")
        self.w8a8_min_rows = w8a8_min_rows if self.in_features <= W8A8_MAX_IN_FEATURES else sys.maxsize
        self.data = huge_pages.rehome(pack_int8_weight(qweight))
        # What the +128 shift of the activations adds to every sum of column n: 128 * sum_k q[n, k].
        self.compensation = (qweight.to(torch.int32).sum(dim=1) * 128).to(torch.int32)
        self.scale = scale.float().contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self.bf16_tiles = bf16_tiles
        self._w8a8 = torch.ops.kvloom.gemm_w8a8.default  # the overloads themselves: 1 us less a call
        self._weight_only = torch.ops.kvloom.gemm_int8_weight_only.default

    def stack_args(self) -> StackArgs:
        return StackArgs(STACK_INT8_ROWS, [self.data, self.compensation, self.scale, self.bias], self.w8a8_min_rows,
                         self.bf16_tiles)

    def rows(self, ids: torch.Tensor) -> Int8Rows:
        """Rows ``ids`` [T] of the weight as packed (a tied embedding reads its table here, layers/embedding.py)."""
        return Int8Rows(packed_panel_rows(self.data, ids, self.in_features), self.scale[ids])

    def _compute(self, out: torch.Tensor, rows: torch.Tensor) -> None:
        if rows.shape[0] >= self.w8a8_min_rows:
            self._w8a8(out, rows, self.data, self.compensation, self.scale, self.bias, False, self.bf16_tiles)
        else:
            self._weight_only(out, rows, self.data, self.scale, self.bias, False, self.bf16_tiles)


def pack_block_columns(values: torch.Tensor) -> torch.Tensor:
    """[N, blocks] per (column, block) values -> [ceil(N / 48), blocks, 48], as the panels of
    pack_int8_weight hold the columns; zero past N."""
    n, blocks = values.shape
    panels = -(-n // GEMM_PANEL)
    padded = values.new_zeros(panels * GEMM_PANEL, blocks)
    padded[:n] = values
    return padded.view(panels, GEMM_PANEL, blocks).permute(0, 2, 1).contiguous()


class PackedInt8BlocksWeight(_PackedInt8Linear):
    """A block-scaled int8 weight (``Int8Blocks``: int8 [N, K], fp32 scales [N, K / 32]; optional bias)
    packed once for csrc/gemm_int8.cpp; calling it gives ``w8a8_blocks_linear_reference``'s product in x's
    dtype (float32 or bfloat16) at every batch size: per-block activations are accurate enough that there
    is no weight-only product to fall back on, as in llama.cpp. On an AMX-BF16 CPU, with ``bf16_tiles`` (the
    default), bf16 x of ``bf16_tiles_min_rows("int8_blocks")`` rows or more take the dequantizing product instead
    (``w8a8_blocks_dequantized_reference``: no activation quantization)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 bf16_tiles: bool = True) -> None:
        check_blocks_shape(qweight, scale)
        self._set_shape(*qweight.shape, bias)
        # The panels of pack_int8_weight holding q + 128 as u8 (each byte's top bit flipped): the kernel's
        # shift to vpdpbusd's unsigned operand is on the weight, so activations need no compensation per column.
        self._finish(huge_pages.rehome(pack_int8_weight(qweight, flip=True)),
                     pack_block_columns(compact_block_scales(scale)), bias, bf16_tiles)  # fp16 where exact

    @classmethod
    def from_q8_0(cls, parts: Sequence[Q8_0Blocks], bias: torch.Tensor | None,
                  bf16_tiles: bool = True) -> PackedInt8BlocksWeight:
        """The same weight packed straight from a GGUF's Q8_0 bytes (a projection's shards in turn, each
        ``Q8_0Blocks`` of the file's mapped pages) into its final memory: one C++ pass over every row, parallel over
        panels, with no decoded codes, joined shards or padded copies between (``pack_q8_0_parts``)."""
        if not parts or len({p.shape[1] for p in parts}) != 1:
            raise ValueError(f"PackedInt8BlocksWeight.from_q8_0 takes one or more Q8_0 parts of one in_features, got "
                             f"shapes {[tuple(p.shape) for p in parts]}")
        self = cls.__new__(cls)
        self._set_shape(sum(p.shape[0] for p in parts), parts[0].shape[1], bias)
        panels, blocks = -(-self.out_features // GEMM_PANEL), self.in_features // BLOCK
        codes = huge_pages.empty(panels * self.in_features * GEMM_PANEL).view(torch.int8)
        codes = codes.view(panels, self.in_features // INT8_GROUP, GEMM_PANEL, INT8_GROUP)
        scale = torch.empty(panels, blocks, GEMM_PANEL, dtype=torch.float16)
        torch.ops.kvloom.pack_q8_0_parts(codes, scale, [p.data for p in parts], self.in_features)
        self._finish(codes, scale, bias, bf16_tiles)
        return self

    def _set_shape(self, out_features: int, in_features: int, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = out_features, in_features
        if bias is not None and bias.shape != (out_features,):
            raise ValueError(f"PackedInt8BlocksWeight: bias must have shape ({out_features},), got {tuple(bias.shape)}")

    def _finish(self, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, bf16_tiles: bool) -> None:
        self.data, self.scale = data, scale
        self.bias = None if bias is None else bias.float().contiguous()
        self.bf16_tiles = bf16_tiles
        self._product = torch.ops.kvloom.gemm_w8a8_blocks.default

    def stack_args(self) -> StackArgs:
        return StackArgs(STACK_INT8_BLOCKS, [self.data, self.scale, self.bias], bf16_tiles=self.bf16_tiles)

    def rows(self, ids: torch.Tensor) -> Int8Blocks:
        """Rows ``ids`` [T] of the weight as packed (a tied embedding reads its table here, layers/embedding.py)."""
        codes = packed_panel_rows(self.data, ids, self.in_features).view(torch.uint8).bitwise_xor(0x80)
        return Int8Blocks(codes.view(torch.int8), packed_panel_rows(self.scale, ids, self.scale.shape[1]).float())

    def _compute(self, out: torch.Tensor, rows: torch.Tensor) -> None:
        self._product(out, rows, self.data, self.scale, self.bias, False, self.bf16_tiles)


# The library's op saying, per packed weight, from how many bf16 rows it takes the AMX-BF16 tiles (csrc/amx_bf16.h).
BF16_TILES_OPS = {"q4": "q4_bf16_tiles_min_rows", "int8_blocks": "w8a8_blocks_bf16_tiles_min_rows",
                  "int8_rows": "int8_rows_bf16_tiles_min_rows"}


def bf16_tiles_min_rows(weight: str) -> int:
    """From how many rows a packed weight takes bf16 activations to the dequantizing AMX-BF16 product: ``weight``
    "q4" (PackedQ4Weight), "int8_blocks" (PackedInt8BlocksWeight) or "int8_rows" (PackedInt8Weight, in_features a
    multiple of 32); 0: never here (no AMX-BF16 in this CPU or build, KVLOOM_CPU_AMX=0, or no C++ kernels)."""
    if weight not in BF16_TILES_OPS:
        raise ValueError(f"unknown packed weight {weight!r}; expected one of {sorted(BF16_TILES_OPS)}")
    op = BF16_TILES_OPS[weight]
    return int(getattr(torch.ops.kvloom, op)()) if hasattr(torch.ops.kvloom, op) else 0

"""Every environment variable kvloom reads, in one place.

Each ``KVLOOM_*`` variable is an alias for an engine or backend setting; an explicit argument
(``LLM(...)`` keyword or CLI flag) wins over the variable. The seeds' ``NEURON_*`` names of four of
them are read too (``SEED_ALIASES``), so a seed's shell lines run unchanged; the ``KVLOOM_*`` name
wins where both are set. The seeds' argument spellings are mapped in ``kvloom/config/compat.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

ENVIRONMENT_VARIABLES: dict[str, str] = {
    "KVLOOM_API_KEY": "API key the server requires on /v1/* (same as --api-key)",
    "KVLOOM_NUM_THREADS": "torch intra-op threads on the CPU (default: all cores)",
    "KVLOOM_CPU_OMP_THREADS_BIND": "the cores of each engine process on this host (vLLM's VLLM_CPU_OMP_THREADS_BIND; "
    "same as --cpu-omp-threads-bind): auto (default), nobind, or one CPU list per process separated by |, "
    "e.g. 0-3|4-7",
    "KVLOOM_CPU_THREAD_POOL": "1: the CPU kernels run their loops on kvloom's own thread pool, which never waits "
    "for a descheduled thread (for a box shared with other busy processes); default 0: torch's OpenMP threads",
    "KVLOOM_CPU_LAYER_STACK": "0: a Llama model's decoder layers run one torch op at a time on the CPU; default 1: "
    "all of them in one native call (csrc/decoder.cpp; the same kernels, no Python between them)",
    "KVLOOM_CPU_AMX": "0: no AMX tiles (4-bit and Q8_0 products on VNNI, bf16 ones on the AVX512-BF16 dot products); "
    "default 1: on a CPU with AMX, bf16 weights take AMX-BF16 tiles at every row count (their panels read in place) "
    "and 4-bit weights AMX-INT8 tiles for 16 rows at a time (the same exact sums as VNNI); with "
    "KVLOOM_BATCH_INVARIANT=0 also the batch-dependent AMX products that variable names",
    "KVLOOM_BATCH_INVARIANT": "0: allow the faster products whose arithmetic changes with a step's row count, so that "
    "a greedy request's tokens can depend on how many others share its step: on a CPU with AMX-BF16, with bf16 "
    "activations 4-bit weights are dequantized into AMX-BF16 tiles from 16 rows (Q8_0 blocks from 48, int8 rows from "
    "128); on AVX-512, int8 rows take the weight-only product at one row. Default 1: every product keeps one "
    "arithmetic at every row count (tests/e2e/test_batch_invariance.py)",
    "KVLOOM_Q4_ACTIVATIONS": "bf16: on a CPU with AMX-BF16, bf16 activations on a 4-bit weight with fp16 scales per "
    "32 (GGUF Q4_0 / Q4_1, as the default model's) keep bf16 and take the table product on AMX-BF16 tiles at every "
    "row count (one formula whatever the batch; SmolLM2 on 2 cores of an AMX Xeon: 1.41x the default at 64 "
    "sequences, 1.05x at 8, 0.72x at one); default int8: llama.cpp's product (activations in int8 per 32)",
    "KVLOOM_CPU_ONEDNN": "force: bf16 weights hold oneDNN's packing beside kvloom's on any CPU (where oneDNN has no "
    "bf16 product, as on AVX2, the packing is of the weight widened to fp32) and take its product from 4 rows (a "
    "batch-dependent product, slower than kvloom's AMX tiles on an AMX CPU): that path's packing, pickling, mapping "
    "and huge-page move run on every CPU (the tests use it); 0: never oneDNN's packed product; default auto",
    "KVLOOM_CPU_ISA": "avx512, avx2 or generic: run as on a CPU with at most that instruction set (kvloom's kernels "
    "are built for it, torch's ATen and oneDNN capped to it); default: what the CPU has (kvloom env shows it)",
    "KVLOOM_LOGGING_LEVEL": "log level of the kvloom logger (default INFO)",
    "KVLOOM_CACHE_DIR": "folder for kvloom's on-disk caches; compiled CPU kernels go to its extensions/ "
    "(default ~/.cache/kvloom)",
    "KVLOOM_PACKED_CACHE": "0: a GGUF is read and packed for the CPU's kernels at every start; 1: the first start of "
    "a configuration writes the packed model to KVLOOM_CACHE_DIR/packed/ (as large as the packed weights) and later "
    "ones map it from there (kvloom/worker/packed_cache.py); default auto: as 1, but written only where reading and "
    "packing took 3 s or more (not for a file packed by a C++ pass over its bytes: Q4_K / Q6_K super-blocks)",
    "KVLOOM_HUGE_PAGES": "0: packed weights and the KV cache on the CPU in ordinary 4 KiB pages; default 1: in "
    "transparent huge pages where Linux offers them (madvise), which decode streams ~10% faster "
    "(kvloom/ops/huge_pages.py)",
    "KVLOOM_TOKEN_GEN_BUCKETS": "decode batch sizes a step is padded to, comma-separated, e.g. 1,2,4,8,16 "
    "(the seeds' NEURON_TOKEN_GEN_BUCKETS; same as override_backend_config token_gen_buckets)",
    "KVLOOM_CONTEXT_LENGTH_BUCKETS": "prefill token counts a step is padded to, comma-separated "
    "(the seeds' NEURON_CONTEXT_LENGTH_BUCKETS; same as override_backend_config context_length_buckets)",
    "KVLOOM_COMPILED_ARTIFACTS": "folder where compiled kernels are stored and reloaded at the next start "
    "(the seeds' NEURON_COMPILED_ARTIFACTS; default: KVLOOM_CACHE_DIR/compiled)",
    "KVLOOM_QUANT_DTYPE": "store weights quantized: 's8' or 'int8' (the seeds' NEURON_QUANT_DTYPE; same as "
    "quantization='int8')",
    "KVLOOM_ALLOW_RUNTIME_LORA_UPDATING": "1: the server offers POST /v1/load_lora_adapter and "
    "/v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING); default: adapters only from --lora-modules",
}

# The seeds' (vLLM on Neuron) names of the same settings, read when the kvloom name is unset.
SEED_ALIASES: dict[str, str] = {
    "KVLOOM_TOKEN_GEN_BUCKETS": "NEURON_TOKEN_GEN_BUCKETS",
    "KVLOOM_CONTEXT_LENGTH_BUCKETS": "NEURON_CONTEXT_LENGTH_BUCKETS",
    "KVLOOM_COMPILED_ARTIFACTS": "NEURON_COMPILED_ARTIFACTS",
    "KVLOOM_QUANT_DTYPE": "NEURON_QUANT_DTYPE",
}


def get(name: str) -> str | None:
    """The value of a documented kvloom environment variable (else of its seeds' alias), or None when
    unset or empty."""
    if name not in ENVIRONMENT_VARIABLES:
        raise KeyError(f"{name} is not a documented kvloom environment variable")
    value = os.environ.get(name, "").strip()
    if not value and name in SEED_ALIASES:
        value = os.environ.get(SEED_ALIASES[name], "").strip()
    return value or None


def source_name(name: str) -> str:
    """The variable that ``get(name)`` read: ``name``, or its seeds' alias when only that is set (for
    messages that name what the user set)."""
    if not os.environ.get(name, "").strip() and os.environ.get(SEED_ALIASES.get(name, ""), "").strip():
        return SEED_ALIASES[name]
    return name


def get_int(name: str) -> int | None:
    """A positive integer, or None when unset."""
    raw = get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be a positive integer") from None
    if value < 1:
        raise ValueError(f"{name}={raw!r} must be a positive integer")
    return value


def get_bool(name: str, default: bool = False) -> bool:
    """1/true/yes/on or 0/false/no/off (case-insensitive); ``default`` when unset."""
    raw = get(name)
    if raw is None:
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r} must be 1 or 0 (also true/false, yes/no, on/off)")


def get_int_list(name: str) -> list[int] | None:
    """Comma-separated positive integers, or None when unset."""
    raw = get(name)
    if raw is None:
        return None
    message = f"{source_name(name)}={raw!r} must be comma-separated positive integers, e.g. 1,2,4,8"
    try:
        values = [int(part) for part in raw.split(",") if part.strip()]
    except ValueError:
        raise ValueError(message) from None
    if not values or min(values) < 1:
        raise ValueError(message)
    return values


def cache_dir() -> Path:
    """kvloom's on-disk cache: KVLOOM_CACHE_DIR, else ~/.cache/kvloom (compiled CPU kernels, compiled GPU kernels)."""
    root = get("KVLOOM_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "kvloom"

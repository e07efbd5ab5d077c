"""Other spellings of kvloom's settings, mapped to the canonical names in one place.

Two sources of spellings:
- the seeds (vLLM on Neuron): ``override_neuron_config`` for ``override_backend_config``;
  ``speculative_model`` + ``num_speculative_tokens`` (+ ``speculative_max_model_len``,
  ``speculative_disable_by_batch_size``) for ``speculative_config``; the backend keys ``quantized`` /
  ``quantization_dtype`` and the dtype name ``s8`` for ``quantization="int8"``. Their ``NEURON_*``
  environment variables are aliases in ``kvloom/envs.py`` (``SEED_ALIASES``), the one module that reads
  the environment.
- vLLM's engine arguments that name something kvloom does not have or does differently: each is
  accepted at the values that ask for nothing kvloom lacks, and any other value is a ValueError saying
  why (``VLLM_ARGUMENT_LIMITS``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Argument name -> canonical name (LLM keyword and CLI flag alike).
ARGUMENT_ALIASES: dict[str, str] = {"override_neuron_config": "override_backend_config"}

# Weight quantization names: vLLM's "int8" and the seeds' "s8" (NEURON_QUANT_DTYPE) mean the same.
QUANTIZATION_ALIASES: dict[str, str] = {"int8": "int8", "s8": "int8"}
# How a checkpoint that is quantized already is held (vLLM's names): "gguf" keeps a GGUF's 4-bit and Q8_0
# blocks as stored (the default for a GGUF that has 4-bit projections), "gptq" / "awq" a safetensors
# checkpoint's 4-bit weights (the default for one); "none" dequantizes every weight at load.
CHECKPOINT_QUANTIZATIONS = ("gguf", "gptq", "awq", "none")

DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES: dict[str, str] = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                                 "half": "float16"}


def canonical_arguments(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with every aliased name renamed; ValueError when an alias and its canonical name are both
    given."""
    values = dict(kwargs)
    for alias, name in ARGUMENT_ALIASES.items():
        if alias not in values:
            continue
        value = values.pop(alias)
        if values.get(name) is not None and value is not None:
            raise ValueError(f"give {name} or {alias} (the seeds' name of the same), not both")
        if value is not None or name not in values:
            values[name] = value
    return values


def canonical_dtype(dtype: Any) -> str:
    """'auto', 'float32', 'bfloat16' or 'float16' from any accepted spelling (torch.bfloat16, 'bf16', ...)."""
    name = str(dtype).replace("torch.", "").lower()
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    return name


def canonical_quantization(name: Any, where: str = "quantization", checkpoint_formats: bool = False) -> str:
    """'int8' from 'int8' or the seeds' 's8'; with ``checkpoint_formats`` also CHECKPOINT_QUANTIZATIONS."""
    allowed = dict(QUANTIZATION_ALIASES)
    if checkpoint_formats:
        allowed.update({name: name for name in CHECKPOINT_QUANTIZATIONS})
    quantization = allowed.get(str(name).lower())
    if quantization is None:
        raise ValueError(f"{where} must be one of {sorted(allowed)}, got {name!r}")
    return quantization


def quantization_from_backend(quantized: bool, quantization_dtype: str) -> str | None:
    """The seeds' backend keys (NxD Inference's ``quantized`` / ``quantization_dtype``) as ``quantization``."""
    return quantization_dtype if quantized else None


def speculative_values(config: dict[str, Any] | None, speculative_model: str | None,
                       num_speculative_tokens: int | None, speculative_max_model_len: int | None,
                       speculative_disable_by_batch_size: int | None) -> dict[str, Any]:
    """vLLM's ``speculative_config`` dict with the seeds' separate arguments folded in (an empty dict: off)."""
    values = dict(config or {})
    if speculative_model is not None:
        if values:
            raise ValueError("give speculative_config or speculative_model, not both")
        if speculative_model == "[ngram]":
            values["method"] = "ngram"
        else:
            values["model"] = speculative_model
    for name, key, value in (("num_speculative_tokens", "num_speculative_tokens", num_speculative_tokens),
                             ("speculative_max_model_len", "max_model_len", speculative_max_model_len),
                             ("speculative_disable_by_batch_size", "disable_by_batch_size",
                              speculative_disable_by_batch_size)):
        if value is None:
            continue
        if not values:
            raise ValueError(f"{name} needs a speculative method: speculative_model='[ngram]' or a draft "
                             f"model's path, or speculative_config={{'method': ..., ...}}")
        values.setdefault(key, value)
    return values


@dataclass(frozen=True)
class ArgumentLimit:
    """A vLLM engine argument kvloom takes only at some values: ``allows`` says which, ``why`` the reason."""

    allows: Callable[[Any], bool]
    allowed: str  # the allowed values, as the error message shows them
    why: str


def _is_none(value: Any) -> bool:
    return value is None


def _number_at_least(minimum: float) -> Callable[[Any], bool]:
    def allows(value: Any) -> bool:
        return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                 and value >= minimum)
    return allows


def _bool_or_none(value: Any) -> bool:
    return value is None or isinstance(value, bool)


FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")  # vLLM's two names of the e4m3 cache
KV_CACHE_DTYPES = ("auto", "int8", *FP8_KV_CACHE_DTYPES)

VLLM_ARGUMENT_LIMITS: dict[str, ArgumentLimit] = {
    "enable_chunked_prefill": ArgumentLimit(
        lambda value: value is None or value is True, "True or None",
        "kvloom's scheduler always splits a prompt longer than the step's remaining token budget "
        "(max_num_batched_tokens) into chunks; it has no mode that keeps prompts whole"),
    "revision": ArgumentLimit(
        _is_none, "None",
        "kvloom loads local checkpoints only and never reaches a model hub; point model at that revision's files"),
    "tokenizer_revision": ArgumentLimit(
        _is_none, "None",
        "kvloom loads local tokenizers only and never reaches a model hub; point tokenizer at that revision's files"),
    "tokenizer_mode": ArgumentLimit(
        lambda value: value == "auto", "'auto'",
        "kvloom has one tokenizer implementation (the fast `tokenizers` library, from tokenizer.json or the "
        "GGUF's metadata)"),
    "load_format": ArgumentLimit(
        lambda value: value == "auto", "'auto'",
        "kvloom reads what the model path holds: a safetensors directory or a .gguf file"),
    "download_dir": ArgumentLimit(
        _is_none, "None", "kvloom never downloads weights; give model a local path"),
    "kv_cache_dtype": ArgumentLimit(
        lambda value: value in KV_CACHE_DTYPES, "'auto', 'int8', 'fp8' or 'fp8_e4m3'",
        "the KV cache is stored in the model's dtype ('auto'), as int8 with a scale per token and head ('int8', "
        "CPU and CUDA) or as float8 e4m3 ('fp8' = 'fp8_e4m3', CUDA); kvloom has no e5m2 KV cache"),
    "pipeline_parallel_size": ArgumentLimit(
        lambda value: value == 1, "1",
        "kvloom has no pipeline parallelism; split a model with tensor_parallel_size, or add replicas with "
        "data_parallel_size"),
    "cpu_offload_gb": ArgumentLimit(
        lambda value: value == 0, "0", "kvloom keeps every weight on the device that runs the model"),
    "swap_space": ArgumentLimit(
        _number_at_least(0), "a number of GiB >= 0 (unused)",
        "kvloom preempts by recomputation, so no KV blocks are swapped to the CPU"),
    "max_seq_len_to_capture": ArgumentLimit(
        _number_at_least(1), "an integer >= 1 (unused)",
        "kvloom's decode CUDA graphs cover every sequence length up to max_model_len"),
    "use_v2_block_manager": ArgumentLimit(
        _bool_or_none, "True, False or None (no effect)",
        "kvloom has one block manager, the paged KV cache manager"),
}


def check_vllm_arguments(values: dict[str, Any]) -> None:
    """ValueError for a vLLM argument set to a value that asks for something kvloom lacks."""
    for name, limit in VLLM_ARGUMENT_LIMITS.items():
        if name in values and not limit.allows(values[name]):
            raise ValueError(f"{name}={values[name]!r} is not supported: {limit.why} (allowed: {limit.allowed})")

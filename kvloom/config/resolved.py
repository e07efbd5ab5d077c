"""``ResolvedConfig``: the config settled once at start-up against the model and the machine."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvloom.config.backend import BUCKET_KEYS
from kvloom.config.compat import FP8_KV_CACHE_DTYPES
from kvloom.config.engine import EngineConfig

if TYPE_CHECKING:
    import torch

    from kvloom.loader.model_config import ModelConfig
    from kvloom.loader.weights import ModelSource

logger = logging.getLogger("kvloom")


@dataclass(frozen=True)
class ResolvedConfig:
    """Everything settled once at start-up (the model found, its facts read, device and dtype chosen,
    lengths defaulted): built by ``resolve_config`` and handed whole to the executor, the workers and
    the model runner, so no layer re-derives a setting."""

    engine: EngineConfig
    model: ModelConfig
    source: ModelSource
    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    # Steps scheduled one ahead of the device (EngineConfig.async_scheduling, settled for this engine).
    async_scheduling: bool = False

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


def resolve_config(config: EngineConfig) -> ResolvedConfig:
    """Find the model and read its config; ValueError when a setting does not fit the model or machine."""
    # Lazy: the loader and the platform import torch, and kvloom.config must load without it.
    from kvloom.loader.weights import load_model_config, resolve_model
    from kvloom.platform import resolve_device, resolve_dtype

    source = resolve_model(config.model)
    model_config = load_model_config(source, config.hf_overrides)
    if model_config.classifier_from_token:
        settle_classifier_tokens(model_config, resolve_model(config.tokenizer) if config.tokenizer else source)
    if model_config.is_classifier and config.speculative is not None:
        raise ValueError(f"speculative decoding drafts generated tokens, and {model_config.architecture} is a "
                         f"sequence classifier (it scores, never generates): leave speculative_config unset")
    device = resolve_device(config.device)
    model_max = model_config.max_position_embeddings
    max_model_len = config.max_model_len or model_max
    if max_model_len > model_max:
        raise ValueError(f"max_model_len={max_model_len} is longer than the model's context "
                         f"length ({model_max} tokens); use max_model_len <= {model_max}")
    settle_buckets(config, device.type)
    settle_quantization(config, source, device.type)
    check_kv_cache_dtype(config.kv_cache_dtype, device, config.backend.attention_backend)
    return ResolvedConfig(
        engine=config, model=model_config, source=source, device=device,
        dtype=resolve_dtype(config.dtype, model_config.torch_dtype, device),
        block_size=config.block_size, max_model_len=max_model_len,
        max_num_batched_tokens=config.resolve_max_num_batched_tokens(max_model_len),
        async_scheduling=settle_async_scheduling(config, device.type))


def settle_classifier_tokens(model_config: ModelConfig, tokenizer_source: ModelSource) -> None:
    """A classifier made of LM-head rows (hf_overrides' classifier_from_token): its tokens' ids, each one token of
    the tokenizer's vocabulary (vLLM's convert_tokens_to_ids)."""
    from kvloom.loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_source)
    ids = []
    for token in model_config.classifier_from_token or []:
        token_id = tokenizer.token_to_id(token)
        if token_id is None or not 0 <= token_id < model_config.vocab_size:
            raise ValueError(f"hf_overrides classifier_from_token: {token!r} is not one token of this model's "
                             f"vocabulary; give tokens as the vocabulary spells them (e.g. 'yes', 'no')")
        ids.append(token_id)
    model_config.classifier_token_ids = ids


def check_kv_cache_dtype(kv_cache_dtype: str, device: torch.device, attention_backend: str) -> None:
    """An 8-bit KV cache needs attention kernels that read it: int8 the CPU's and the Triton ones, fp8 (e4m3)
    the Triton ones on a GPU with fp8 conversions (compute capability 8.9+); the plain-torch reference reads
    both anywhere. ValueError naming what is missing otherwise."""
    if kv_cache_dtype == "auto":
        return
    where = f"this engine uses device {device.type!r} with attention_backend {attention_backend!r}"
    if attention_backend == "native":
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs the 'auto', 'cpu', 'triton' or 'reference' "
                         f"attention backend; {where}: use kv_cache_dtype='auto'")
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES and attention_backend != "reference":
        if device.type != "cuda":
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} (float8 e4m3) runs on CUDA (or under the slow "
                             f"'reference' attention backend); {where}: use kv_cache_dtype='int8' (about the same "
                             f"bytes) or 'auto'")
        import torch

        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs fp8 conversions (compute capability 8.9+, "
                             f"e.g. L4, H100); this GPU has {capability[0]}.{capability[1]}: use 'int8'")


def settle_async_scheduling(config: EngineConfig, device_type: str) -> bool:
    """Unset: on for CUDA (it hides the host's work behind the GPU's), off on a CPU (its device work is the host's:
    nothing to hide). On only for one rank without speculative decoding (drafts are made from the tokens the step
    before sampled, on the host); asked for where it cannot be, one log line says why it is off."""
    if config.async_scheduling is False or (config.async_scheduling is None and device_type != "cuda"):
        return False
    reason = ("speculative decoding is on" if config.speculative is not None
              else "tensor parallelism is on" if config.tensor_parallel_size > 1 else None)
    if reason is not None:
        if config.async_scheduling:
            logger.info("async_scheduling is off: %s (its steps are scheduled after the last one's tokens)", reason)
        return False
    return True


def settle_buckets(config: EngineConfig, device_type: str) -> None:
    """The seeds' bucket knobs on a CPU: one warning that they apply to CUDA, then bucketing off.

    Buckets pad decode batches to shapes that each replay a captured CUDA graph; kvloom's CPU kernels take
    any shape at no cost, so there the knobs have nothing to do. Settled here, where the device is known,
    so a seed's script (or its NEURON_* variables) runs unchanged on a CPU.
    """
    backend = config.backend
    if device_type == "cuda" or not backend.sets_buckets():
        return
    named = [key for key in BUCKET_KEYS if getattr(backend, key) not in (None, False)]
    logger.warning("%s: bucketing applies to CUDA (decode batches replayed from CUDA graphs); the CPU runs every "
                   "shape as it comes, so they are ignored here", ", ".join(named))
    config.backend = dataclasses.replace(backend, enable_bucketing=False)


def settle_quantization(config: EngineConfig, source: ModelSource, device_type: str) -> None:
    """``quantization`` against the checkpoint. None becomes the checkpoint's own 4-bit format, kept 4-bit as vLLM
    does: 'gguf' for a GGUF whose projections are 4-, 5- or 6-bit code blocks (5- and 6-bit unless the backend's
    ``gguf_5bit_blocks`` / ``gguf_6bit_blocks`` is off), 'int8' (its Q8_0 blocks kept) on a CPU for a GGUF whose
    projections are Q8_0 (unless ``int8_gguf_blocks`` is off; CUDA has no block product and keeps bf16), 'gptq' /
    'awq' for such a safetensors checkpoint. 'none'
    becomes None (everything dequantized at load). A format the checkpoint is not in is a ValueError."""
    from kvloom.loader import gguf
    from kvloom.loader.weights import int4_format

    fmt = int4_format(source)
    stored = "gguf" if source.kind == "gguf" else None if fmt is None else fmt.method
    if config.quantization == "none":
        config.quantization = None
    elif config.quantization in ("gguf", "gptq", "awq") and config.quantization != stored:
        raise ValueError(f"quantization={config.quantization!r} keeps a {config.quantization.upper()} checkpoint's "
                         f"4-bit weights, but {source.path} is {'a ' + stored.upper() if stored else 'not quantized'}"
                         f"; use quantization=None (the checkpoint's own format), 'none' or 'int8'")
    elif config.quantization is None and stored in ("gptq", "awq"):
        config.quantization = stored
    elif (config.quantization is None and stored == "gguf"
          and gguf.has_code_block_projections(source.path, config.backend.gguf_5bit_blocks,
                                                config.backend.gguf_6bit_blocks)):
        logger.info("Keeping the GGUF's 4-, 5- and 6-bit weights in their blocks (quantization='gguf'); "
                    "quantization='none' dequantizes them at load instead")
        config.quantization = "gguf"
    elif (config.quantization is None and stored == "gguf" and device_type == "cpu" and config.backend.int8_gguf_blocks
          and any(name.endswith("_proj.weight") for name in gguf.q8_0_weight_names(source.path))):
        # A Q8_0 file dequantized to bf16 streams 16 bits a weight at decode where its blocks stream 8.5: at one
        # sequence of a 1B model that was 0.54x llama.cpp on the same file (docs/quantization.md).
        logger.info("Keeping the GGUF's Q8_0 weights as int8 blocks (quantization='int8', activations quantized "
                    "per block of 32 as llama.cpp does); quantization='none' dequantizes them at load instead")
        config.quantization = "int8"

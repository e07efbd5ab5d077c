"""Model classes by HF architecture name, and the load and after-load steps every model goes through."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch import nn

from kvloom.layers.embedding import share_tied_table
from kvloom.layers.quantization import (
    finish_gguf,
    finish_int8,
    int8_state,
    keeps_q8_0_blocks,
    kept_as_stored,
    load_int8_state,
    quantize_as_read,
)
from kvloom.layers.smoothing import CALIBRATION_ID, calibrate, calibration_text, smooth_as_read, smoothing_alpha
from kvloom.loader import quantized_checkpoint
from kvloom.loader.model_config import ModelConfig
from kvloom.loader.tokenizer import load_tokenizer
from kvloom.loader.weights import iter_weights
from kvloom.models.classifier import SEQUENCE_CLASSIFIERS
from kvloom.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from kvloom.models.idefics3 import Idefics3ForConditionalGeneration
from kvloom.models.llama import LlamaForCausalLM, MistralForCausalLM
from kvloom.models.llava import LlavaForConditionalGeneration
from kvloom.models.mixtral import MixtralForCausalLM
from kvloom.models.phi3 import Phi3ForCausalLM
from kvloom.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from kvloom.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from kvloom.ops.table import Ops

if TYPE_CHECKING:
    from kvloom.config import ResolvedConfig

logger = logging.getLogger("kvloom")

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
}
# Every text family's sequence classifier (transformers' ``...ForSequenceClassification``: a ``score`` head).
MODEL_REGISTRY.update(SEQUENCE_CLASSIFIERS)


def build_model(config: ModelConfig, ops: Ops) -> nn.Module:
    cls = MODEL_REGISTRY.get(config.architecture)
    if cls is None:
        raise ValueError(f"architecture {config.architecture!r} is not supported; "
                         f"supported: {sorted(MODEL_REGISTRY)}")
    return cls(config, ops)


def process_weights_after_loading(model: nn.Module, ops: Ops) -> None:
    """Once the weights are final (loaded, and sharded for tensor parallelism): pack them for the
    platform's GEMM. Every layer that has something to prepare does it here, never in forward."""
    for module in model.modules():
        if module is not model and hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading(ops)
    share_tied_table(model)  # a tied embedding reads the head's packed table: one copy of it
    if hasattr(model, "prepare_layer_stack"):  # with the weights packed: the layers as one native call
        model.prepare_layer_stack()


def _llama_names(model: nn.Module, weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors under Llama's per-projection names where the family fuses them on disk (Phi-3),
    so that smoothing and int8 quantization as read see the names they know."""
    split = getattr(model, "llama_names", None)
    return weights if split is None else split(weights)


def load_model_weights(model: nn.Module, config: ResolvedConfig) -> None:
    """The checkpoint's weights into ``model``; with ``quantization="int8"``, as int8 (from the quantized
    checkpoint when one matches, else quantized as read and, with a path, written there); with "gguf", a GGUF's
    4-bit and Q8_0 projections as stored."""
    engine = config.engine
    if engine.backend.requantize_lm_head is not None:
        if config.device.type != "cpu":
            # The Triton product reads 5-bit codes one a byte, and CUDA re-quantizes a Q8_0 table per row: the code
            # blocks would hold more than the int8 head, not less.
            raise ValueError(f"override_backend_config: requantize_lm_head runs on the CPU's products only; this "
                             f"engine runs on {config.device.type} (leave it unset there)")
        if engine.quantization not in ("gguf", "gptq", "awq"):
            raise ValueError(f"override_backend_config: requantize_lm_head re-quantizes the LM head of a checkpoint "
                             f"kept in its 4-bit or 8-bit blocks (quantization \"gguf\", \"gptq\" or \"awq\"); "
                             f"this load has quantization={engine.quantization!r}")
    if engine.quantization is None:
        model.load_weights(iter_weights(config.source))
        return
    if engine.quantization in ("gguf", "gptq", "awq"):
        # Q8_0 projections, embedding and head as int8 blocks, unless the backend turns their products off.
        keep_q8_0 = engine.backend.int8_activations and engine.backend.int8_gguf_blocks
        # Q4_K / Q6_K weights as the file's super-blocks for the CPU's k-quant product (ops/q4k.py); a GPU's Triton
        # product takes the decoded code blocks.
        super_blocks = engine.backend.gguf_super_blocks is not False and config.device.type == "cpu"
        # Q8_0 projections likewise as the file's bytes, packed from them in one pass (ops' pack_linear_q8_0).
        model.load_weights(kept_as_stored(iter_weights(config.source, keep_q8_0=keep_q8_0, keep_q4=True,
                                                             keep_q5=engine.backend.gguf_5bit_blocks,
                                                             keep_q6=engine.backend.gguf_6bit_blocks,
                                                             keep_super_blocks=super_blocks,
                                                             keep_q8_0_bytes=config.device.type == "cpu")))
        finish_gguf(model, engine.backend.requantize_lm_head)
        return
    architecture = config.model.architecture
    if not getattr(model, "supports_int8", True):
        dense = sorted(name for name, cls in MODEL_REGISTRY.items() if getattr(cls, "supports_int8", True))
        raise ValueError(f"quantization={engine.quantization!r} is not supported for {architecture}; int8 runs: "
                         f"{dense}")
    lm_head = engine.backend.quantize_lm_head
    alpha = smoothing_alpha(engine.backend, config.device)
    if alpha is not None and not getattr(model, "smoothable", True):
        # Smoothing folds its factors into Llama's norm layout (layers/smoothing.py); Gemma's norms sit elsewhere.
        logger.warning("%s's layers are not laid out as SmoothQuant smoothing expects: its int8 weights are "
                       "quantized without smoothing (int8_smoothing_alpha is not applied)", architecture)
        alpha = None
    if alpha is not None and engine.enable_lora:
        # Smoothing divides each projection's input by per-channel factors (and v's, up's outputs by o's, down's):
        # a LoRA adapter's A and B see the unsmoothed activations, so its delta would be wrong.
        logger.info("enable_lora: int8 weights are quantized without SmoothQuant smoothing (adapters are trained "
                    "on the unsmoothed activations)")
        alpha = None
    keep_q8_0 = keeps_q8_0_blocks(config.source, engine.backend)
    if keep_q8_0 and alpha is not None:
        chosen = alpha != type(engine.backend).int8_smoothing_alpha  # set by hand: WARNING; the default: INFO
        logger.log(logging.WARNING if chosen else logging.INFO,
                   "Keeping the GGUF's Q8_0 blocks as int8 (activations quantized per block of 32, as llama.cpp "
                   "does): int8_smoothing_alpha=%s is not applied. To smooth and re-quantize per row instead, "
                   "pass override_backend_config {\"int8_gguf_blocks\": false}", alpha)
        alpha = None
    path = engine.quantized_checkpoint_path
    if path is not None and any(hasattr(module, "quantize_experts") for module in model.modules()):
        raise ValueError(f"quantized_checkpoint_path is not supported for {architecture} (a quantized checkpoint "
                         "does not hold int8 experts); quantize at load instead (leave it unset)")
    fingerprint = ""
    if path is not None:
        fingerprint = quantized_checkpoint.fingerprint(
            config.source.path, dataclasses.asdict(config.model),
            {"quantization": engine.quantization, "lm_head": lm_head, "dtype": str(config.dtype),
             "smoothing": None if alpha is None else {"alpha": alpha, "calibration": CALIBRATION_ID},
             "gguf_q8_0_blocks": keep_q8_0})
        state = quantized_checkpoint.load(path, fingerprint)
        if state is not None:
            load_int8_state(model, state, lm_head)
            return
    # Q8_0 projections as the file's bytes, packed from them in one pass, where no quantized checkpoint is written.
    q8_0_bytes = keep_q8_0 and config.device.type == "cpu" and path is None
    weights = _llama_names(model, iter_weights(config.source, keep_q8_0=keep_q8_0, keep_q8_0_bytes=q8_0_bytes))
    if alpha is not None:
        # Smoothing calibrates on the float model, then folds its factors into the tensors read again.
        model.load_weights(iter_weights(config.source))
        token_ids = load_tokenizer(config.source).encode(calibration_text())
        weights = smooth_as_read(weights, calibrate(model, token_ids, alpha), config.model.num_attention_heads)
    model.load_weights(quantize_as_read(weights, lm_head))
    finish_int8(model, lm_head)
    if path is not None:
        quantized_checkpoint.save(path, int8_state(model), fingerprint)

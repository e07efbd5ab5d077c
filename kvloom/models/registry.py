"""Model classes by HF architecture name, and the after-load step every model goes through."""

from __future__ import annotations

from torch import nn

from kvloom.loader.model_config import ModelConfig
from kvloom.models.llama import LlamaForCausalLM, MistralForCausalLM
from kvloom.ops.table import Ops

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
}


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

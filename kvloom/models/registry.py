"""Model classes by HF architecture name."""

from __future__ import annotations

from torch import nn

from kvloom.attention.registry import AttentionFn
from kvloom.loader.model_config import ModelConfig
from kvloom.models.llama import LlamaForCausalLM, MistralForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
}


def build_model(config: ModelConfig, attention: AttentionFn) -> nn.Module:
    cls = MODEL_REGISTRY.get(config.architecture)
    if cls is None:
        raise ValueError(f"architecture {config.architecture!r} is not supported; "
                         f"supported: {sorted(MODEL_REGISTRY)}")
    return cls(config, attention)

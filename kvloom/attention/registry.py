"""Attention backends by name: 'reference' (plain torch) and 'native' (torch's fused SDPA)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvloom.attention.metadata import AttentionMetadata
from kvloom.attention.native import attention_native
from kvloom.attention.reference import attention_reference

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                        AttentionMetadata, float], torch.Tensor]

ATTENTION_BACKENDS: dict[str, AttentionFn] = {
    "reference": attention_reference,
    "native": attention_native,
}


def get_attention_backend(name: str) -> AttentionFn:
    if name == "auto":
        name = "native"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; known: {sorted(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name]

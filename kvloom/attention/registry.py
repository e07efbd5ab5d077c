"""Attention backends by name: 'reference' (plain torch), 'native' (torch's fused ops) and 'cpu'
(one C++ kernel over the paged cache, compiled at first use)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvloom.attention.cpu import attention_cpu, cpu_kernel_available
from kvloom.attention.metadata import AttentionMetadata
from kvloom.attention.native import attention_native
from kvloom.attention.reference import attention_reference

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                        AttentionMetadata, float], torch.Tensor]

ATTENTION_BACKENDS: dict[str, AttentionFn] = {
    "reference": attention_reference,
    "native": attention_native,
    "cpu": attention_cpu,
}


def get_attention_backend(name: str, device: torch.device | None = None) -> AttentionFn:
    """The backend called `name` for a model on `device` (None: the CPU).

    'auto' is 'cpu' on the CPU and 'native' elsewhere. 'cpu' is 'native' when its kernel cannot be
    built (a warning says why), so a host without a compiler still runs.
    """
    on_cpu = device is None or torch.device(device).type == "cpu"
    if name == "auto":
        name = "cpu" if on_cpu else "native"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; known: {sorted(ATTENTION_BACKENDS)}")
    if name == "cpu":
        if not on_cpu:
            raise ValueError(f"attention backend 'cpu' runs on the CPU only, the model is on {device}; "
                             f"use 'auto' or 'native'")
        if not cpu_kernel_available():
            return attention_native
    return ATTENTION_BACKENDS[name]

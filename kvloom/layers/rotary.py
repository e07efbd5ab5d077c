"""Rotary position embeddings (HF's rotate-half layout), with Llama-3, linear and LongRoPE (Phi-3) scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvloom.ops.table import NATIVE_OPS, Ops


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    # fp32 throughout, as HF computes it, so positions match the oracle bit for bit in fp32.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type")
    if kind == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled).float()
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    raise ValueError(f"rope scaling type {kind!r} is not supported; supported: {', '.join(SUPPORTED_SCALING)}")


SUPPORTED_SCALING = ("llama3", "linear", "longrope")


def longrope_tables(head_dim: int, max_position: int, theta: float, scaling: dict[str, Any]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """LongRoPE (Phi-3): (cos, sin) [max_position, head_dim / 2], each frequency divided by its factor:
    ``short_factor`` at positions below ``original_max_position_embeddings``, ``long_factor`` from there on;
    both tables multiplied by the attention factor (sqrt(1 + ln(s) / ln(original)), s = max / original,
    unless the config gives ``attention_factor``), as transformers scales its cos and sin.

    Per position, as vLLM does: transformers switches a whole sequence to the long factors once it is
    longer than the original context, so the two agree on every sequence within it."""
    original = int(scaling["original_max_position_embeddings"])
    inv_freq = rope_inverse_frequencies(head_dim, theta, None)
    tables = []
    for key in ("short_factor", "long_factor"):
        factors = torch.tensor(scaling[key], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"longrope {key} must have head_dim / 2 = {inv_freq.numel()} entries, "
                             f"got {factors.numel()}")
        tables.append(inv_freq / factors)
    positions = torch.arange(max_position, dtype=torch.float32)
    angles = torch.where((positions < original)[:, None], torch.outer(positions, tables[0]),
                         torch.outer(positions, tables[1]))
    factor = scaling.get("factor") or max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return angles.cos() * attention_factor, angles.sin() * attention_factor


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None, ops: Ops = NATIVE_OPS) -> None:
        super().__init__()
        if scaling is not None and scaling.get("rope_type") == "longrope":
            cos, sin = longrope_tables(head_dim, max_position, theta, scaling)
        else:
            inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)
            angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
            cos, sin = angles.cos(), angles.sin()
        # [max_position, head_dim // 2] each; kept fp32 for accuracy at long positions.
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        self.ops = ops

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """positions: [T]; x: [T, heads, D] (queries and keys side by side) -> rotated x (maybe in place)."""
        return self.ops.rotary_embedding(positions, x, self.cos_cache, self.sin_cache)

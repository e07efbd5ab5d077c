"""SiLU-and-multiply (and Gemma's GELU-and-multiply) over a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.ops.table import NATIVE_OPS, Ops


class SiluAndMul(nn.Module):
    def __init__(self, ops: Ops = NATIVE_OPS) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, 2 * I] laid out as [gate | up] -> [T, I]."""
        return self.ops.silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """GeGLU (Gemma): gelu(gate, tanh approximation) * up, in plain torch (the op table has no GELU op)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, 2 * I] laid out as [gate | up] -> [T, I]."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

"""SiLU-and-multiply over a fused gate/up projection."""

from __future__ import annotations

import torch
from torch import nn

from kvloom.ops.table import NATIVE_OPS, Ops


class SiluAndMul(nn.Module):
    def __init__(self, ops: Ops = NATIVE_OPS) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, 2 * I] laid out as [gate | up] -> [T, I]."""
        return self.ops.silu_and_mul(x)

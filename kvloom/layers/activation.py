"""SiLU-and-multiply over a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] laid out as [gate | up] -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Set by the model runner when the fused C++ CPU ops are built.
        self.fused_cpu = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_cpu:
            out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
            torch.ops.kvloom.silu_and_mul(out, x)
            return out
        return silu_and_mul(x)

"""SiLU-and-multiply over a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] laid out as [gate | up] -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up

"""RMSNorm, with the residual add fused in: y = w * x / sqrt(mean(x^2) + eps)."""

from __future__ import annotations

import torch
from torch import nn

from kvloom.ops.table import NATIVE_OPS, Ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: Ops = NATIVE_OPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H]. With a residual, returns (norm(x + residual), x + residual)."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


def add_to_stream(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's first norm over the stream x + residual: (norm(x + residual), x + residual); the first
    layer's stream is x alone (no residual yet), and its norm may be no RMSNorm (EAGLE-1's head has none)."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)

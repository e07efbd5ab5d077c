"""RMSNorm, with the residual add fused in: y = w * x / sqrt(mean(x^2) + eps)."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain torch in fp32, as HF's LlamaRMSNorm computes it."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rms_norm_fast(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's fused kernel. In bf16 it accumulates in fp32 and rounds once at the end (the
    reference rounds before the weight multiply too), so results differ by at most an ulp."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.impl = rms_norm_fast
        # Set by the model runner when the fused C++ CPU ops are built (kvloom/attention/csrc).
        self.fused_cpu = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H]. With a residual, returns (norm(x + residual), x + residual)."""
        if self.fused_cpu:
            if residual is None:
                out = torch.empty_like(x)
                torch.ops.kvloom.rms_norm(out, x, self.weight, self.eps)
                return out
            # In place: x (a fresh projection output) becomes the normed value, residual the sum.
            torch.ops.kvloom.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return self.impl(x, self.weight, self.eps)
        residual = x + residual
        return self.impl(residual, self.weight, self.eps), residual

"""Linear layers; fused projections are one weight whose row blocks load from several HF tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b). ``output_sizes`` names the row blocks of a fused weight (e.g. q, k, v)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = output_sizes
        out_features = sum(output_sizes)
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def load_shard(self, name: str, shard: int, tensor: torch.Tensor) -> None:
        """Copy one HF tensor into row block ``shard`` of the fused weight (or bias)."""
        start = sum(self.output_sizes[:shard])
        size = self.output_sizes[shard]
        target = self.weight if name == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {name} for a layer built without one")
        expected = (size,) + tuple(target.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, expected {expected}")
        target.data[start:start + size].copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

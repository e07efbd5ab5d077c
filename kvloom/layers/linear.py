"""Linear layers; fused projections are one weight whose row blocks load from several HF tensors.

After loading (and tensor-parallel sharding), ``process_weights_after_loading`` hands the weight to
the op table's ``pack_linear`` once: on the CPU in bf16 that packs it for kvloom's GEMM
(kvloom/ops/cpu.py) and the plain weight is released; where the table packs nothing, F.linear runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.ops.table import Ops


class Linear(nn.Module):
    """y = x W^T (+ b). ``output_sizes`` names the row blocks of a fused weight (e.g. q, k, v)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = output_sizes
        out_features = sum(output_sizes)
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.packed: Callable[[torch.Tensor], torch.Tensor] | None = None

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

    def process_weights_after_loading(self, ops: Ops) -> None:
        """Pack the final weight for the platform's GEMM, once; the plain weight is then released."""
        if ops.pack_linear is None or self.packed is not None:
            return
        bias = None if self.bias is None else self.bias.data
        self.packed = ops.pack_linear(self.weight.data, bias)
        self.weight.data = torch.empty(0, self.in_features, dtype=self.weight.dtype, device=self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight, self.bias)

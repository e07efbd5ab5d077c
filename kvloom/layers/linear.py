"""Linear layers; fused projections are one weight whose row blocks load from several HF tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def mkldnn_packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN's pre-packed bf16 linear: about 1.25x the GEMM speed of F.linear on the CPU."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The fast path of F.linear(x, W, b) with W packed by pack_weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Module):
    """y = x W^T (+ b). ``output_sizes`` names the row blocks of a fused weight (e.g. q, k, v)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = output_sizes
        out_features = sum(output_sizes)
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        # Set by the model runner on the CPU in bf16: pack the weight at the first forward, after
        # loading and tensor-parallel sharding are done. The plain weight is then released.
        self.pack_batch_hint: int | None = None
        self.packed_weight: torch.Tensor | None = None

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
        if self.pack_batch_hint is not None:
            if self.packed_weight is None:
                self.packed_weight = pack_weight(self.weight.data, self.pack_batch_hint)
                self.weight.data = torch.empty(0, self.in_features, dtype=self.weight.dtype)
            return packed_linear(x, self.packed_weight, self.bias)
        return F.linear(x, self.weight, self.bias)

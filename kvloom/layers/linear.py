"""Linear layers; fused projections are one weight whose row blocks load from several HF tensors.

On the CPU in bf16 the model runner sets ``fast_format`` on every Linear and the LM head, and the
weight is repacked once, at the first forward (after loading and tensor-parallel sharding), for
one of two GEMMs:

- ``"kvloom"``: our AVX512-BF16 kernel (csrc/gemm.cpp), 1.05-1.2x oneDNN at batch 64 and about
  2x at batches of 1-8 on this model's shapes (``benchmarks/gemm_micro.py``);
- ``"onednn"``: oneDNN's pre-packed bf16 linear, where our kernel is not built (no AVX512-BF16).

Both compute F.linear's answer: products summed in fp32, rounded once to bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Output columns per packed panel of the "kvloom" format: 3 vectors of 16 (csrc/gemm.cpp's kPanel).
GEMM_PANEL = 48


def fast_linear_format(dtype: torch.dtype, device: torch.device) -> str | None:
    """The fastest packed GEMM this process has for ``dtype`` on ``device``, or None (F.linear)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    from kvloom.attention.cpu import cpu_kernel_available

    if cpu_kernel_available() and hasattr(torch.ops.kvloom, "gemm_bf16"):
        return "kvloom"
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "onednn"
    return None


def pack_gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 48), ceil(K / 2), 48, 2]: per panel of 48 output columns and k pair, the
    48 columns' (W[n, 2p], W[n, 2p + 1]) words in a row. Padding is zero."""
    n, k = weight.shape
    panels, pairs = -(-n // GEMM_PANEL), -(-k // 2)
    padded = weight.new_zeros(panels * GEMM_PANEL, pairs * 2)
    padded[:n, :k] = weight
    return padded.view(panels, GEMM_PANEL, pairs, 2).permute(0, 2, 1, 3).contiguous()


class PackedWeight:
    """A weight (and bias) repacked once for a fast GEMM; calling it gives F.linear(x, W, b)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, batch_hint: int) -> None:
        self.format = fmt
        self.out_features, self.in_features = weight.shape
        if fmt == "kvloom":
            self.data = pack_gemm_weight(weight)
            self.bias = None if bias is None else bias.float()  # added to the fp32 sums before rounding
        elif fmt == "onednn":
            self.data = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
            self.bias = bias
        else:
            raise ValueError(f"unknown packed weight format {fmt!r}; expected 'kvloom' or 'onednn'")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.format == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.data, self.bias, "none", [], "")
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = x.new_empty(*x.shape[:-1], self.out_features)
        torch.ops.kvloom.gemm_bf16(out.view(-1, self.out_features), rows, self.data, self.bias)
        return out


class Linear(nn.Module):
    """y = x W^T (+ b). ``output_sizes`` names the row blocks of a fused weight (e.g. q, k, v)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = output_sizes
        out_features = sum(output_sizes)
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        # Set by the model runner (see the module docstring); the plain weight is released once packed.
        self.fast_format: str | None = None
        self.batch_hint = 64
        self.packed: PackedWeight | None = None

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
        if self.fast_format is not None:
            if self.packed is None:
                bias = None if self.bias is None else self.bias.data
                self.packed = PackedWeight(self.weight.data, bias, self.fast_format, self.batch_hint)
                self.weight.data = torch.empty(0, self.in_features, dtype=self.weight.dtype)
            return self.packed(x)
        return F.linear(x, self.weight, self.bias)

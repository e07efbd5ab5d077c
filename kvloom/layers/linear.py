"""Linear layers; fused projections are one weight whose row blocks load from several HF tensors.

After loading (and tensor-parallel sharding), ``process_weights_after_loading`` hands the weight to
the op table's ``pack_linear`` once: on the CPU in bf16 that packs it for kvloom's GEMM
(kvloom/ops/cpu.py) and the plain weight is released; where the table packs nothing, F.linear runs.

With int8 weights (``quantization="int8"``), ``quantize`` replaces the float weight by ``qweight``
(int8, [out, in]) and ``weight_scale`` (fp32, [out]) right after loading, before any sharding; the
op table's ``pack_linear_int8`` then prepares them for the platform's int8 product. A layer loaded from
GGUF Q8_0 blocks (``Int8Blocks``) keeps a scale per row and block of 32 inputs, ``weight_scale`` [out, in / 32],
and is prepared by ``pack_linear_int8_blocks``; a fused layer with some shards in blocks and some in rows
holds all of them as blocks (a row's scale repeated over its blocks, exactly).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.ops import int8
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
        # int8 storage (after quantize): int8 [out, in] and one fp32 scale per output row.
        self.qweight: torch.Tensor | None = None
        self.weight_scale: torch.Tensor | None = None
        self.packed: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def quantized(self) -> bool:
        return self.qweight is not None

    @property
    def blocks(self) -> bool:
        """Whether the int8 weight has a scale per block of 32 inputs (GGUF Q8_0) rather than per row."""
        return self.weight_scale is not None and self.weight_scale.dim() == 2

    def load_shard(self, name: str, shard: int, tensor: torch.Tensor | int8.Int8Rows | int8.Int8Blocks) -> None:
        """Copy one HF tensor into row block ``shard`` of the fused weight (or bias); int8 rows or blocks (a
        weight quantized as it was read, or a GGUF Q8_0 kept) go to the int8 storage, which the first of
        them creates."""
        start = sum(self.output_sizes[:shard])
        size = self.output_sizes[shard]
        if isinstance(tensor, (int8.Int8Rows, int8.Int8Blocks)):
            if name != "weight":
                raise ValueError(f"int8 weights can only fill a weight, not a {name}")
            if tuple(tensor.shape) != (size, self.in_features):
                raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, expected "
                                 f"{(size, self.in_features)}")
            if isinstance(tensor, int8.Int8Blocks) or self.blocks:  # one kind of scale per layer: blocks
                if isinstance(tensor, int8.Int8Rows):
                    tensor = int8.Int8Blocks.from_rows(tensor)
                if self.qweight is not None and not self.blocks:
                    self.weight_scale = int8.Int8Blocks.from_rows(int8.Int8Rows(self.qweight, self.weight_scale)).scale
            if self.qweight is None:
                out_features = sum(self.output_sizes)
                device = self.weight.device
                self.set_int8(torch.zeros(out_features, self.in_features, dtype=torch.int8, device=device),
                              torch.ones(out_features, *tensor.scale.shape[1:], device=device))
            self.qweight[start:start + size].copy_(tensor.qweight)
            self.weight_scale[start:start + size].copy_(tensor.scale)
            return
        target = self.weight if name == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {name} for a layer built without one")
        expected = (size,) + tuple(target.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, expected {expected}")
        target.data[start:start + size].copy_(tensor)

    def quantize(self) -> None:
        """Store the weight as int8 with a scale per output row; the float weight is released."""
        qweight, scale = int8.quantize_per_channel(self.weight.data)
        self.set_int8(qweight, scale)

    def set_int8(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        """Take int8 storage as it is (a quantized checkpoint, or GGUF Q8_0 blocks) after checking its shape:
        scale [out] per row, or [out, in / 32] per block."""
        expected = (sum(self.output_sizes), self.in_features)
        if qweight.dtype != torch.int8 or tuple(qweight.shape) != expected:
            raise ValueError(f"int8 weight must be int8 of shape {expected}, got {qweight.dtype} "
                             f"{tuple(qweight.shape)}")
        if scale.dim() == 2:
            int8.check_blocks_shape(qweight, scale)
        elif tuple(scale.shape) != expected[:1]:
            raise ValueError(f"weight_scale must have shape {expected[:1]} (per row) or "
                             f"{(expected[0], expected[1] // int8.BLOCK)} (per block of {int8.BLOCK}), "
                             f"got {tuple(scale.shape)}")
        self.qweight, self.weight_scale = qweight, scale.float()
        self.weight.data = self.weight.data.new_empty(0, self.in_features)

    def process_weights_after_loading(self, ops: Ops) -> None:
        """Pack the final weight for the platform's GEMM, once; the plain weight is then released."""
        if self.packed is not None:
            return
        bias = None if self.bias is None else self.bias.data
        if self.qweight is not None:
            pack = ops.pack_linear_int8_blocks if self.blocks else ops.pack_linear_int8
            self.packed = pack(self.qweight, self.weight_scale, bias)
            self.qweight = self.weight_scale = None  # the packed product holds what it needs
            return
        if ops.pack_linear is None:
            return
        self.packed = ops.pack_linear(self.weight.data, bias)
        self.weight.data = torch.empty(0, self.in_features, dtype=self.weight.dtype, device=self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        if self.qweight is not None:
            product = int8.w8a8_blocks_linear_reference if self.blocks else int8.int8_linear_reference
            return product(x, self.qweight, self.weight_scale, self.bias)
        return F.linear(x, self.weight, self.bias)

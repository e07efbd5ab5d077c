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

A GGUF's 4- and 5-bit weights (``quantization="gguf"``) arrive as ``Q4Blocks`` and stay in their code blocks in
``q4``; the op table's ``pack_linear_q4`` prepares them. A fused layer whose shards are not all code blocks (float
shards beside them, or Q8_0 int8 blocks beside Q4_1 / Q4_K ones) is dequantized whole to float at packing: one
product per layer; where the others are int8 blocks and the code blocks are exactly int8 codes with a scale per 32
(Q4_0, Q5_0: a 576-wide model's Q4_K_M has Q5_0 q and k beside a Q8_0 v), all go to the int8 blocks instead.

A GGUF's Q4_K and Q6_K weights may arrive as the file's super-blocks (``Q4KBlocks``, ``Q6KBlocks``, on a CPU) and
stay so in ``super_blocks`` when every shard of the layer came so, Q4_K shards first (a Q4_K_M file's q and k beside
its Q6_K v: a whole number of panels of 8 rows), for ``pack_linear_q4`` to take as they are (``KQuantRows``,
ops/q4k.py); beside shards of any other kind, or in another order, they are decoded into ``q4`` and go the way
above. A GGUF's Q8_0 projection may arrive likewise as the file's bytes (``int8.Q8_0Blocks``, on a CPU) and stay so in
``q8_0`` while every shard came so, for ``pack_linear_q8_0`` to pack in one pass; beside any other kind (or where the
table has no such packing) they are decoded into the int8 storage above.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.ops import int8
from kvloom.ops.q4 import PANEL, Q4Blocks, q4_linear_reference
from kvloom.ops.q4k import SUPER_BLOCK_TYPES, KQuantRows, Q4KBlocks, Q6KBlocks, joined_blocks
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
        # Code-block storage (a GGUF's 4- or 5-bit blocks kept): codes uint8 [out, in], d and m fp32 [out, in / 32];
        # the shards (indices into output_sizes) that arrived so.
        self.q4: Q4Blocks | None = None
        self.q4_shards: set[int] = set()
        # The file's Q4_K / Q6_K super-blocks by shard, while every weight shard came so.
        self.super_blocks: dict[int, Q4KBlocks | Q6KBlocks] = {}
        # The file's Q8_0 bytes by shard, while every weight shard came so.
        self.q8_0: dict[int, int8.Q8_0Blocks] = {}
        # The shards whose weight is held in float (read as float and not read again as int8, as smoothing's second
        # pass does): where int8 shards stay beside them (a GGUF's Q8_0 v_proj beside float q and k), the layer
        # ends in float, every shard exact.
        self.float_shards: set[int] = set()

    @property
    def quantized(self) -> bool:
        return self.qweight is not None

    @property
    def blocks(self) -> bool:
        """Whether the int8 weight has a scale per block of 32 inputs (GGUF Q8_0) rather than per row."""
        return self.weight_scale is not None and self.weight_scale.dim() == 2

    def load_shard(self, name: str, shard: int,
                   tensor: torch.Tensor | int8.Int8Rows | int8.Int8Blocks | int8.Q8_0Blocks | Q4Blocks | Q4KBlocks
                   | Q6KBlocks) -> None:
        """Copy one HF tensor into row block ``shard`` of the fused weight (or bias); int8 rows or blocks (a
        weight quantized as it was read, or a GGUF Q8_0 kept) go to the int8 storage, which the first of
        them creates, and 4-bit blocks to the 4-bit storage."""
        start = sum(self.output_sizes[:shard])
        size = self.output_sizes[shard]
        if isinstance(tensor, int8.Q8_0Blocks):
            if name == "weight" and self.q4 is None and self.qweight is None and not self.float_shards \
                    and not self.super_blocks:
                if tuple(tensor.shape) != (size, self.in_features):
                    raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, expected "
                                     f"{(size, self.in_features)}")
                self.q8_0[shard] = tensor
                return
            tensor = tensor.to_int8_blocks()  # beside shards of another kind: decoded
        elif name == "weight" and self.q8_0:
            self.q8_0_to_int8()
        if isinstance(tensor, SUPER_BLOCK_TYPES):
            if self.q4 is None and self.qweight is None and not self.float_shards:
                self._load_super_block_shard(name, shard, size, tensor)
                return
            tensor = tensor.to_blocks()  # beside shards of another kind: decoded
        elif name == "weight" and self.super_blocks:
            self.super_blocks_to_q4()
        if isinstance(tensor, Q4Blocks):
            self._load_q4_shard(name, shard, start, size, tensor)
            return
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
                floats, float_shards = self.weight.data, self.float_shards
                self.set_int8(torch.zeros(out_features, self.in_features, dtype=torch.int8, device=device),
                              torch.ones(out_features, *tensor.scale.shape[1:], device=device))
                if float_shards:  # still held until each is read again as int8, or the layer ends float
                    self.weight.data, self.float_shards = floats, float_shards
            self.qweight[start:start + size].copy_(tensor.qweight)
            self.weight_scale[start:start + size].copy_(tensor.scale)
            self.float_shards.discard(shard)
            if not self.float_shards:
                self.weight.data = self.weight.data.new_empty(0, self.in_features)
            return
        if name == "weight" and self.weight.numel() == 0:  # after int8 shards: a float one needs the buffer again
            self.weight.data = self.weight.data.new_zeros(sum(self.output_sizes), self.in_features)
        target = self.weight if name == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {name} for a layer built without one")
        expected = (size,) + tuple(target.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, expected {expected}")
        target.data[start:start + size].copy_(tensor)
        if name == "weight":
            self.float_shards.add(shard)

    def _load_q4_shard(self, name: str, shard: int, start: int, size: int, tensor: Q4Blocks) -> None:
        if name != "weight":
            raise ValueError(f"4-bit blocks can only fill a weight, not a {name}")
        if tuple(tensor.shape) != (size, self.in_features):
            raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, expected {(size, self.in_features)}")
        if self.q4 is None:
            out_features, groups = sum(self.output_sizes), self.in_features // tensor.group
            self.q4 = Q4Blocks(torch.zeros(out_features, self.in_features, dtype=torch.uint8),
                               torch.zeros(out_features, groups), torch.zeros(out_features, groups))
        if tensor.group != self.q4.group:  # a Q6_K shard (scales per 16) beside blocks of 32: all per 16, exactly
            self.q4, tensor = self.q4.in_groups_of_16(), tensor.in_groups_of_16()
        for target, part in zip(self.q4, tensor):
            target[start:start + size].copy_(part)
        self.q4_shards.add(shard)

    def _load_super_block_shard(self, name: str, shard: int, size: int, tensor: Q4KBlocks | Q6KBlocks) -> None:
        if name != "weight":
            raise ValueError(f"k-quant super-blocks can only fill a weight, not a {name}")
        if tuple(tensor.shape) != (size, self.in_features):
            raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, expected {(size, self.in_features)}")
        self.super_blocks[shard] = tensor

    def super_blocks_to_q4(self) -> None:
        """The shards held as the file's super-blocks decoded into the code-block storage ``q4`` (exact)."""
        held, self.super_blocks = self.super_blocks, {}
        for shard, tensor in sorted(held.items()):
            start, size = sum(self.output_sizes[:shard]), self.output_sizes[shard]
            self._load_q4_shard("weight", shard, start, size, tensor.to_blocks())

    def q8_0_to_int8(self) -> None:
        """The shards held as the file's Q8_0 bytes decoded into the int8 storage (codes and block scales, exact)."""
        held, self.q8_0 = self.q8_0, {}
        for shard, tensor in sorted(held.items()):
            self.load_shard("weight", shard, tensor.to_int8_blocks())

    def _k_quant_rows(self) -> KQuantRows | None:
        """Every shard's super-blocks as the k-quant product takes them (Q4_K shards, then Q6_K ones: the Q4_K rows a
        whole number of panels where Q6_K rows follow), or None where they are not so."""
        if len(self.super_blocks) < len(self.output_sizes):
            return None
        shards = [self.super_blocks[i] for i in range(len(self.output_sizes))]
        q4_k = [t for t in shards if isinstance(t, Q4KBlocks)]
        q6_k = shards[len(q4_k):]
        if not all(isinstance(t, Q6KBlocks) for t in q6_k):
            return None  # Q4_K after Q6_K
        q4_k_rows = sum(t.shape[0] for t in q4_k)
        if q4_k and q6_k and q4_k_rows % PANEL:
            return None
        return KQuantRows.of(q4_k, q6_k)  # the shards as parts: packed in one pass, never joined first

    def _int8_to_float(self) -> None:
        """A layer whose shards came as int8 and as float: the int8 ones dequantized into the float weight beside
        the float ones, every shard exact, and the int8 storage released."""
        kind = int8.Int8Blocks if self.blocks else int8.Int8Rows
        values = kind(self.qweight, self.weight_scale).dequantize().to(self.weight.dtype)
        for shard in self.float_shards:
            start, size = sum(self.output_sizes[:shard]), self.output_sizes[shard]
            values[start:start + size] = self.weight.data[start:start + size]
        self.weight.data = values
        self.qweight, self.weight_scale = None, None

    def _q4_to_float(self) -> None:
        """A layer only partly 4-bit: every shard in float (its 4-bit rows dequantized, int8 ones too)."""
        if self.qweight is not None:  # int8 shards beside the 4-bit ones
            self._int8_to_float()
        weight = self.weight.data
        values = self.q4.dequantize()
        for shard in self.q4_shards:
            start, size = sum(self.output_sizes[:shard]), self.output_sizes[shard]
            weight[start:start + size] = values[start:start + size].to(weight.dtype)
        self.weight.data = weight
        self.q4, self.q4_shards = None, set()

    def _q4_to_int8_blocks(self) -> bool:
        """A layer of code blocks and int8 blocks (a Q4_K_M file's Q5_0 q and k beside a Q8_0 v): the code blocks
        moved into the int8 ones where they are exactly int8 codes times a scale per 32 (Q4_0, Q5_0), for one
        int8 product per layer; False (nothing changed) where the other shards are not all int8 blocks or any code
        block is not such."""
        if self.qweight is None or not self.blocks or self.float_shards:
            return False
        converted = []
        for shard in sorted(self.q4_shards):
            start, size = sum(self.output_sizes[:shard]), self.output_sizes[shard]
            rows = Q4Blocks(*(t[start:start + size] for t in self.q4)).as_int8_blocks()
            if rows is None:
                return False
            converted.append((start, size, rows))
        for start, size, (qweight, scale) in converted:
            self.qweight[start:start + size].copy_(qweight)
            self.weight_scale[start:start + size].copy_(scale)
        self.q4, self.q4_shards = None, set()
        return True

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
        device = self.weight.device  # a quantized checkpoint is read on the CPU; the model may sit on a GPU
        self.qweight, self.weight_scale = qweight.to(device), scale.float().to(device)
        self.weight.data = self.weight.data.new_empty(0, self.in_features)
        self.float_shards = set()  # the whole weight is int8 now

    def process_weights_after_loading(self, ops: Ops) -> None:
        """Pack the final weight for the platform's GEMM, once; the plain weight is then released."""
        if self.packed is not None:
            return
        bias = None if self.bias is None else self.bias.data
        if self.q8_0:
            if len(self.q8_0) == len(self.output_sizes) and ops.pack_linear_q8_0 is not None:
                self.packed = ops.pack_linear_q8_0([self.q8_0[i] for i in range(len(self.output_sizes))], bias)
                self.q8_0 = {}
                self.weight.data = self.weight.data.new_empty(0, self.in_features)
                return
            self.q8_0_to_int8()  # the int8 way below
        if self.super_blocks:
            rows = self._k_quant_rows()
            if rows is not None:
                self.packed = ops.pack_linear_q4(rows, bias)
                self.super_blocks = {}
                self.weight.data = self.weight.data.new_empty(0, self.in_features)
                return
            self.super_blocks_to_q4()  # the code-block way below says what becomes of the layer
        if self.q4 is not None and len(self.q4_shards) < len(self.output_sizes):
            if not self._q4_to_int8_blocks():
                self._q4_to_float()
        elif self.qweight is not None and self.float_shards:
            self._int8_to_float()
        if self.q4 is not None:
            device = self.weight.device  # the 4-bit storage is no parameter: it follows the model's device here
            self.packed = ops.pack_linear_q4(Q4Blocks(*(t.to(device) for t in self.q4)), bias)
            self.q4 = None
            self.weight.data = self.weight.data.new_empty(0, self.in_features)
            return
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
        if self.super_blocks:
            weight = joined_blocks([t.to_blocks() for _, t in sorted(self.super_blocks.items())])
            return q4_linear_reference(x, weight, self.bias)
        if self.q8_0:
            blocks = [t.to_int8_blocks() for _, t in sorted(self.q8_0.items())]
            return int8.w8a8_blocks_linear_reference(x, torch.cat([b.qweight for b in blocks]),
                                                     torch.cat([b.scale for b in blocks]), self.bias)
        if self.q4 is not None:
            return q4_linear_reference(x, self.q4, self.bias)
        if self.qweight is not None:
            product = int8.w8a8_blocks_linear_reference if self.blocks else int8.int8_linear_reference
            return product(x, self.qweight, self.weight_scale, self.bias)
        return F.linear(x, self.weight, self.bias)

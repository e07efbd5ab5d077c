"""GGUF Q4_K weights kept in the file's own super-blocks: 4.5 bits a weight, as the file stores them.

A Q4_K row holds per super-block of 256 inputs 144 bytes: an fp16 scale d and offset scale dmin, 12 bytes of 6-bit
sub-scales sc and mins mn for its 8 blocks of 32 (ggml's ``get_scale_min_k4``), and 128 bytes of 4-bit codes q:

    W[n, k] = q[n, k] * (d * sc[b]) - dmin * mn[b],   b = (k % 256) / 32

``Q4KBlocks`` is such a weight as the file's bytes, uint8 [N, K / 256 * 144] (rows are whole: a loader reorders,
cuts and joins them like float rows); ``to_blocks`` decodes it into ``Q4Blocks`` (kvloom/ops/q4.py: codes with an
fp32 d sc and -dmin mn per block of 32, exact), which every other code-block path takes.

``PackedQ4KWeight`` is its product on the CPU (csrc/gemm_q4k.cpp): the file's bytes rearranged once in C++
(``pack_q4k``: no decoding) into panels of 8 rows, per panel and super-block the rows' fp16 d and dmin, their 12
scale bytes as stored (not widened to 8 bits: that would cost 0.125 bits a weight, and their decoding is a few byte
operations per super-block of 8 rows) and their codes in csrc/gemm_q4.cpp's nibble order: 1152 bytes for 8 x 256
weights, exactly the file's 4.5 bits a weight (rows past N, to a whole panel, are zero padding). Its product is
``q4_linear_reference``'s, llama.cpp's per block of 32 (activations quantized per block of 32 by
``quantize_per_block``, exact int32 sums per block, then fp32), with the same fp32 operations in the same order as
``q4.PackedQ4Weight`` on ``to_blocks()`` of the same weight: the results are bit-identical to that product (AVX2
and plain loops alike, at every row count; the dequantizing AMX-BF16 product PackedQ4Weight switches to from 16 bf16
rows is not taken here). ``q4k_linear_reference`` is the plain-torch oracle. Q4_0 / Q4_1 / Q5 / Q6_K / GPTQ / AWQ
weights keep ``PackedQ4Weight``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvloom.ops import huge_pages
from kvloom.ops.q4 import BLOCK, PANEL, PackedQ4Weight, Q4Blocks, q4_linear_reference

SUPER = 256  # inputs per super-block
SUPER_BYTES = 144  # a row's super-block in the file: d | dmin | 12 scale bytes | 128 code bytes
Q5_K_SUPER_BYTES = 176  # Q5_K's: d | dmin | 12 scale bytes | 32 bytes of fifth bits | 128 code bytes
PANEL_SUPER_BYTES = PANEL * SUPER_BYTES  # csrc/gemm_q4k.cpp's kSuperBytes
HEAD_BYTES = PANEL * (4 + 12)  # its kHeadBytes: the 8 rows' d, dmin and scale bytes
STACK_Q4K = 4  # this product's kind in csrc/decoder.cpp's plan (its Projection::kQ4K)


def decode_k_quant(blocks: torch.Tensor, fifth_bits: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Super-blocks uint8 [S, 144] (Q4_K) or [S, 176] (Q5_K, ``fifth_bits``) -> codes uint8 [S, 256], d and m fp32
    [S, 8] with x = q * d + m per block of 32, exact: d = d_file * sc, m = -dmin * mn (ggml's dequantize_row_q4_K /
    _q5_K). Block b takes the low (b even) or high (b odd) nibbles of code bytes 32 (b // 2) .. +32 and, Q5_K, bit b
    of qh[0..32) as its fifth bit."""
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [S, 1]
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
    packed = blocks[:, 4:16].to(torch.int32)  # [S, 12]
    low, high = packed[:, 0:4], packed[:, 4:8]  # get_scale_min_k4: j < 4 reads q[j], q[j + 4]
    top = packed[:, 8:12]
    scale = torch.cat((low & 63, (top & 0x0F) | ((low >> 6) << 4)), dim=1)  # [S, 8]
    minimum = torch.cat((high & 63, (top >> 4) | ((high >> 6) << 4)), dim=1)
    qs = blocks[:, -128:].reshape(-1, 4, 32)  # [S, chunk, 32]: chunk j holds blocks 2 j (low) and 2 j + 1 (high)
    codes = torch.stack((qs & 0x0F, qs >> 4), dim=2)  # [S, 4, 2, 32]: block b = 2 j + h
    if fifth_bits:
        qh = blocks[:, 16:48]  # [S, 32]: bit b of byte l is block b's fifth bit of element l
        fifth = (qh.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1  # [S, 8, 32]
        codes = codes | (fifth.view(-1, 4, 2, 32) << 4)
    return codes.reshape(-1, SUPER), d * scale.float(), -(dmin * minimum.float())


class Q4KBlocks(NamedTuple):
    """A GGUF Q4_K weight [N, K] as the file stores it: uint8 [N, K / 256 * 144], each row its super-blocks."""

    data: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        n, row_bytes = self.data.shape
        return torch.Size((n, row_bytes // SUPER_BYTES * SUPER))

    @classmethod
    def from_gguf(cls, raw: torch.Tensor, shape: tuple[int, int]) -> Q4KBlocks:
        """A 2-D Q4_K tensor's bytes (uint8, as read) of torch shape [N, K]."""
        n, k = shape
        if k % SUPER:
            raise ValueError(f"a Q4_K weight needs in_features a multiple of {SUPER}, got {k}")
        if raw.numel() != n * k // SUPER * SUPER_BYTES:
            raise ValueError(f"{raw.numel()} bytes do not hold a Q4_K weight of shape {tuple(shape)}")
        return cls(raw.reshape(n, k // SUPER * SUPER_BYTES))

    def to_blocks(self) -> Q4Blocks:
        """The same weight as codes with a scale and an offset per block of 32 (exact)."""
        n, k = self.shape
        codes, d, m = decode_k_quant(self.data.reshape(-1, SUPER_BYTES), fifth_bits=False)
        return Q4Blocks(codes.reshape(n, k).contiguous(), d.reshape(n, k // BLOCK), m.reshape(n, k // BLOCK))

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]."""
        return self.to_blocks().dequantize()

    def take(self, ids: torch.Tensor) -> Q4KBlocks:
        """Rows ``ids`` [T]."""
        return Q4KBlocks(self.data[ids])

    def columns(self, start: int, size: int) -> Q4KBlocks:
        """Inputs [start, start + size) of every row, whole super-blocks (a row-parallel rank's share)."""
        if start % SUPER or size % SUPER:
            raise ValueError(f"a Q4_K weight is cut between super-blocks of {SUPER} inputs only, got inputs "
                             f"[{start}, {start + size})")
        first, count = start // SUPER * SUPER_BYTES, size // SUPER * SUPER_BYTES
        return Q4KBlocks(self.data[:, first:first + count].contiguous())


def q4k_linear_reference(x: torch.Tensor, weight: Q4KBlocks, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The Q4_K product in float64 (the super-blocks decoded, then q4_linear_reference): x [..., K] -> [..., N]."""
    return q4_linear_reference(x, weight.to_blocks(), bias)


def packed_q4k_rows(data: torch.Tensor, ids: torch.Tensor, in_features: int) -> Q4Blocks:
    """Rows ``ids`` [T] of pack_q4k's panels uint8 [panels, K / 256, 1152], decoded as Q4KBlocks.to_blocks does."""
    panels, column = torch.div(ids, PANEL, rounding_mode="floor"), ids % PANEL
    t, supers = ids.shape[0], in_features // SUPER
    chosen = data[panels]  # [T, S, 1152]
    head = chosen[:, :, :HEAD_BYTES]
    pick = torch.arange(t)
    d = head[:, :, :2 * PANEL].reshape(t, supers, PANEL, 2)[pick, :, column]  # [T, S, 2]
    dmin = head[:, :, 2 * PANEL:4 * PANEL].reshape(t, supers, PANEL, 2)[pick, :, column]
    scales = head[:, :, 4 * PANEL:].reshape(t, supers, 12, PANEL)[pick, :, :, column]  # [T, S, 12]
    # codes: per block b, pair j, byte (c, i): code 8 j + i low, 8 j + 4 + i high
    nibbles = chosen[:, :, HEAD_BYTES:].reshape(t, supers, 8, 4, PANEL, 4)[pick, :, :, :, column]  # [T, S, b, j, i]
    codes = torch.stack((nibbles & 0x0F, nibbles >> 4), dim=4)  # [T, S, b, j, half, i]
    # back to the file's bytes: block b's element l in byte 32 (b // 2) + l, low nibble (b even) or high
    elements = codes.reshape(t, supers, 4, 2, 32)  # [T, S, b // 2, b % 2, l]
    qs = elements[:, :, :, 0] | (elements[:, :, :, 1] << 4)  # [T, S, 4, 32]
    file_bytes = torch.cat((d, dmin, scales, qs.reshape(t, supers, 128)), dim=2)  # [T, S, 144]
    return Q4KBlocks(file_bytes.reshape(t, -1).contiguous()).to_blocks()


class PackedQ4KWeight:
    """A Q4_K weight packed once for csrc/gemm_q4k.cpp, straight from the file's bytes: x [..., K] (float32 or
    bfloat16) -> [..., N] in x's dtype, q4_linear_reference's product (bit for bit PackedQ4Weight's on the decoded
    blocks)."""

    def __init__(self, weight: Q4KBlocks, bias: torch.Tensor | None, portable: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"PackedQ4KWeight: bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
        self.data = huge_pages.rehome(torch.ops.kvloom.pack_q4k(weight.data.contiguous(), self.out_features,
                                                                self.in_features))
        self.bias = None if bias is None else bias.float().contiguous()
        self.portable = portable
        self._product = torch.ops.kvloom.gemm_q4k.default

    def stack_args(self) -> tuple[int, list[torch.Tensor | None], int]:
        """(kind, tensors, W8A8 rows) for csrc/decoder.cpp's plan (cpu.py llama_layer_stack)."""
        return STACK_Q4K, [self.data, self.bias], 0

    def rows(self, ids: torch.Tensor) -> Q4Blocks:
        """Rows ``ids`` [T] of the weight, decoded (a tied embedding reads its table here, layers/embedding.py)."""
        return packed_q4k_rows(self.data, ids, self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the Q4_K CPU linear takes float32 or bfloat16 activations, got {x.dtype}")
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty((rows.shape[0], self.out_features), dtype=x.dtype)
        self._product(out, rows, self.data, self.bias, self.portable)
        return out.view(*x.shape[:-1], self.out_features)


def pack_code_blocks(weight: Q4Blocks | Q4KBlocks, bias: torch.Tensor | None) -> PackedQ4Weight | PackedQ4KWeight:
    """The CPU op table's code-block product: the file's Q4_K super-blocks take PackedQ4KWeight, every other code
    block PackedQ4Weight."""
    if isinstance(weight, Q4KBlocks):
        return PackedQ4KWeight(weight, bias)
    return PackedQ4Weight(weight, bias)

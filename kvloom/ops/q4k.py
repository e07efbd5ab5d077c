"""GGUF Q4_K and Q6_K weights kept in the file's own super-blocks, at the file's bits a weight (4.5 and 6.5625).

A Q4_K row holds per super-block of 256 inputs 144 bytes: an fp16 scale d and offset scale dmin, 12 bytes of 6-bit
sub-scales sc and mins mn for its 8 blocks of 32 (ggml's ``get_scale_min_k4``), and 128 bytes of 4-bit codes q:

    W[n, k] = q[n, k] * (d * sc[b]) - dmin * mn[b],   b = (k % 256) / 32

A Q6_K row holds per super-block 210 bytes: 6-bit codes (low 4 bits, top 2 bits apart), an int8 scale s per 16 inputs
and an fp16 d: W[n, k] = (q[n, k] - 32) * d * s[g], g = (k % 256) / 16.

``Q4KBlocks`` / ``Q6KBlocks`` are such a weight as the file's bytes, uint8 [N, K / 256 * 144 (210)] (rows are
whole: a loader reorders, cuts and joins them like float rows); ``to_blocks`` decodes one into ``Q4Blocks``
(kvloom/ops/q4.py: codes with an fp32 scale and offset per 32 inputs, per 16 for Q6_K, exact), which every other
code-block path takes. ``KQuantRows`` is a projection's rows: Q4_K rows, then Q6_K rows (a Q4_K_M file's q and k
beside its Q6_K v), either part possibly absent.

``PackedKQuantWeight`` is their product on the CPU (csrc/gemm_q4k.cpp): the file's bytes rearranged once in C++
(``pack_kquant_parts``: no decoding, a word of codes at a time, parallel over panels, from the file's mapped pages
and a fused projection's shards straight into one buffer) into panels of 8 rows, per panel and super-block the
rows' fp16 d (and dmin), their scale bytes as stored (Q4_K's 12 bytes of 6-bit values are not widened to 8 bits: that
would cost 0.125 bits a weight, and their decoding is a few vector operations per super-block of 8 rows) and their
codes in csrc/gemm_q4.cpp's nibble order (Q6_K's top 2 bits beside them): exactly the file's bytes (rows past N, to a
whole panel, are zero padding). Its product is ``q4_linear_reference``'s, llama.cpp's per block of 32 (activations
quantized per block of 32 by ``quantize_per_block``, exact int32 sums per block, or per 16 for Q6_K, then fp32),
with the same fp32 operations in the same order as ``q4.PackedQ4Weight`` on ``to_blocks()`` of the same weight: for a
weight all Q4_K or all Q6_K the results are bit-identical to that product (AVX2, VNNI, AMX-INT8 tiles and plain loops
alike, at every row count, one formula whatever the batch; with ``bf16_tiles``, where batch-dependent products are
allowed, bf16 rows from 16 on take PackedQ4Weight's dequantizing AMX-BF16 product, on panels unpacked as reached:
csrc/q4_panels.h); for Q4_K rows beside Q6_K ones each row gets what PackedQ4Weight gives its own type alone (where
PackedQ4Weight, holding the layer in one form, summed the Q4_K rows per 16 inputs: the same value up to fp32
rounding). ``q4k_linear_reference`` is the plain-torch oracle. A table (embedding, head) in Q4_K or Q6_K takes it too:
the head multiplies, the lookup reads rows back (``rows``). Q4_0 / Q4_1 / Q5 / GPTQ / AWQ weights and a k-quant
weight fused with other types keep ``PackedQ4Weight``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from kvloom.ops import huge_pages
from kvloom.ops.int8 import rows_of_bytes
from kvloom.ops.layer_stack import StackArgs
from kvloom.ops.q4 import BLOCK, PANEL, SUB_BLOCK, PackedQ4Weight, Q4Blocks, q4_linear_reference

SUPER = 256  # inputs per super-block
SUPER_BYTES = 144  # a Q4_K row's super-block in the file: d | dmin | 12 scale bytes | 128 code bytes
Q6_K_SUPER_BYTES = 210  # a Q6_K row's: ql (128 bytes of low nibbles) | qh (64 bytes of top 2 bits) | 16 int8 scales | d
PANEL_SUPER_BYTES = PANEL * SUPER_BYTES  # csrc/gemm_q4k.cpp's kSuperBytes
Q6_K_PANEL_SUPER_BYTES = PANEL * Q6_K_SUPER_BYTES  # its kQ6SuperBytes
HEAD_BYTES = PANEL * (4 + 12)  # its kHeadBytes: the 8 rows' d, dmin and scale bytes
Q6_K_HEAD_BYTES = PANEL * (2 + 16)  # its kQ6HeadBytes: the 8 rows' d and int8 scales
STACK_K_QUANT = 4  # this product's kind in csrc/decoder.cpp's plan (its Projection::kKQuant)


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


def decode_q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K super-blocks uint8 [S, 210] -> codes uint8 [S, 256] (0..63), d and m fp32 [S, 16] per group of 16 with
    x = q * d + m, exact: d = d_file * scale, m = -32 d. In half n of 128, element 32 q + l (quarter q, l < 32) takes
    the low (q < 2) or high (q >= 2) nibble of ql[64 n + 32 (q % 2) + l] and bits 2 q, 2 q + 1 of qh[32 n + l] as its
    5th and 6th bits (ggml's dequantize_row_q6_K)."""
    ql = blocks[:, :128].reshape(-1, 2, 2, 32)  # [S, half, q % 2, l]
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)  # [S, half, 1, l]
    low = torch.cat((ql & 0x0F, ql >> 4), dim=2)  # [S, half, quarter, l]
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8).view(1, 1, 4, 1)
    codes = low | (((qh >> shifts) & 3) << 4)
    scale = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [S, 16]
    d = blocks[:, 208:210].contiguous().view(torch.float16).float() * scale  # [S, 16]
    return codes.reshape(-1, SUPER), d, -32 * d


def _columns(data: torch.Tensor, start: int, size: int, super_bytes: int) -> torch.Tensor:
    """Inputs [start, start + size) of every row of super-block bytes, whole super-blocks."""
    if start % SUPER or size % SUPER:
        raise ValueError(f"a k-quant weight is cut between super-blocks of {SUPER} inputs only, got inputs "
                         f"[{start}, {start + size})")
    first, count = start // SUPER * super_bytes, size // SUPER * super_bytes
    return data[:, first:first + count].contiguous()


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
        return cls(rows_of_bytes(raw, shape, "Q4_K", SUPER, SUPER_BYTES))

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
        return Q4KBlocks(_columns(self.data, start, size, SUPER_BYTES))


class Q6KBlocks(NamedTuple):
    """A GGUF Q6_K weight [N, K] as the file stores it: uint8 [N, K / 256 * 210], each row its super-blocks."""

    data: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        n, row_bytes = self.data.shape
        return torch.Size((n, row_bytes // Q6_K_SUPER_BYTES * SUPER))

    @classmethod
    def from_gguf(cls, raw: torch.Tensor, shape: tuple[int, int]) -> Q6KBlocks:
        """A 2-D Q6_K tensor's bytes (uint8, as read) of torch shape [N, K]."""
        return cls(rows_of_bytes(raw, shape, "Q6_K", SUPER, Q6_K_SUPER_BYTES))

    def to_blocks(self) -> Q4Blocks:
        """The same weight as 6-bit codes with a scale and an offset per 16 inputs (exact)."""
        n, k = self.shape
        codes, d, m = decode_q6_k(self.data.reshape(-1, Q6_K_SUPER_BYTES))
        groups = k // SUB_BLOCK
        return Q4Blocks(codes.reshape(n, k).contiguous(), d.reshape(n, groups), m.reshape(n, groups))

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]."""
        return self.to_blocks().dequantize()

    def take(self, ids: torch.Tensor) -> Q6KBlocks:
        """Rows ``ids`` [T]."""
        return Q6KBlocks(self.data[ids])

    def columns(self, start: int, size: int) -> Q6KBlocks:
        """Inputs [start, start + size) of every row, whole super-blocks (a row-parallel rank's share)."""
        return Q6KBlocks(_columns(self.data, start, size, Q6_K_SUPER_BYTES))


SUPER_BLOCK_TYPES = (Q4KBlocks, Q6KBlocks)


def joined_blocks(parts: list[Q4Blocks]) -> Q4Blocks:
    """Row blocks of code blocks as one weight (all per 16 inputs where any is: the blocks of 32 repeated, exact)."""
    if len({part.group for part in parts}) > 1:
        parts = [part.in_groups_of_16() for part in parts]
    return Q4Blocks(*(torch.cat(t) for t in zip(*parts)))


class KQuantRows(NamedTuple):
    """A projection's rows as the file's super-blocks: its Q4_K parts, then its Q6_K parts, each a row block in order
    (the shards of a fused projection, packed in one pass without being joined first); either may be empty; with
    both, the Q4_K rows fill whole panels of 8 (a Q4_K_M file's q and k beside its Q6_K v)."""

    q4_k: tuple[Q4KBlocks, ...]
    q6_k: tuple[Q6KBlocks, ...]

    @classmethod
    def of(cls, q4_k: Q4KBlocks | Sequence[Q4KBlocks] | None = None,
           q6_k: Q6KBlocks | Sequence[Q6KBlocks] | None = None) -> KQuantRows:
        """From one weight of each type, a sequence of parts, or None (no rows of that type)."""
        def parts(value: Any) -> tuple:
            return () if value is None else (value,) if isinstance(value, SUPER_BLOCK_TYPES) else tuple(value)
        return cls(parts(q4_k), parts(q6_k))

    @classmethod
    def one(cls, weight: KQuantRows | Q4KBlocks | Q6KBlocks) -> KQuantRows:
        """A weight of one type as its rows, or the rows as they are."""
        if isinstance(weight, Q4KBlocks):
            return cls.of(q4_k=weight)
        return cls.of(q6_k=weight) if isinstance(weight, Q6KBlocks) else weight

    @property
    def shape(self) -> torch.Size:
        parts = [*self.q4_k, *self.q6_k]
        return torch.Size((sum(p.shape[0] for p in parts), parts[0].shape[1]))

    @property
    def q4_k_rows(self) -> int:
        return sum(p.shape[0] for p in self.q4_k)

    def to_blocks(self) -> Q4Blocks:
        """The code blocks of every row (exact; per 16 inputs where Q6_K rows are)."""
        return joined_blocks([p.to_blocks() for p in (*self.q4_k, *self.q6_k)])


def q4k_linear_reference(x: torch.Tensor, weight: Q4KBlocks | Q6KBlocks | KQuantRows,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """The k-quant product in float64 (the super-blocks decoded, then q4_linear_reference): x [..., K] -> [..., N]."""
    return q4_linear_reference(x, weight.to_blocks(), bias)


def packed_q4k_rows(data: torch.Tensor, ids: torch.Tensor, in_features: int) -> Q4KBlocks:
    """Rows ``ids`` [T] of pack_q4k's panels uint8 [panels, K / 256, 1152], back in the file's bytes."""
    panels, column = torch.div(ids, PANEL, rounding_mode="floor"), ids % PANEL
    t, supers = ids.shape[0], in_features // SUPER
    chosen = data[panels]  # [T, S, 1152]
    pick = torch.arange(t)
    d = chosen[:, :, :2 * PANEL].reshape(t, supers, PANEL, 2)[pick, :, column]  # [T, S, 2]
    dmin = chosen[:, :, 2 * PANEL:4 * PANEL].reshape(t, supers, PANEL, 2)[pick, :, column]
    scales = chosen[:, :, 4 * PANEL:HEAD_BYTES].reshape(t, supers, 12, PANEL)[pick, :, :, column]  # [T, S, 12]
    # codes: per block b, pair j, byte (c, i): code 8 j + i low, 8 j + 4 + i high
    nibbles = chosen[:, :, HEAD_BYTES:].reshape(t, supers, 8, 4, PANEL, 4)[pick, :, :, :, column]  # [T, S, b, j, i]
    codes = torch.stack((nibbles & 0x0F, nibbles >> 4), dim=4).reshape(t, supers, 4, 2, 32)  # [T, S, b // 2, b % 2, l]
    # the file's bytes: block b's element l in byte 32 (b // 2) + l, low nibble (b even) or high
    qs = codes[:, :, :, 0] | (codes[:, :, :, 1] << 4)  # [T, S, 4, 32]
    file_bytes = torch.cat((d, dmin, scales, qs.reshape(t, supers, 128)), dim=2)  # [T, S, 144]
    return Q4KBlocks(file_bytes.reshape(t, -1).contiguous())


def packed_q6k_rows(data: torch.Tensor, ids: torch.Tensor, in_features: int) -> Q6KBlocks:
    """Rows ``ids`` [T] of pack_q6k's panels uint8 [panels, K / 256, 1680], back in the file's bytes."""
    panels, column = torch.div(ids, PANEL, rounding_mode="floor"), ids % PANEL
    t, supers = ids.shape[0], in_features // SUPER
    chosen = data[panels]  # [T, S, 1680]
    pick = torch.arange(t)
    d = chosen[:, :, :2 * PANEL].reshape(t, supers, PANEL, 2)[pick, :, column]  # [T, S, 2]
    scales = chosen[:, :, 2 * PANEL:Q6_K_HEAD_BYTES].reshape(t, supers, 16, PANEL)[pick, :, :, column]  # [T, S, 16]
    body = chosen[:, :, Q6_K_HEAD_BYTES:].reshape(t, supers, 8, 192)
    nibbles = body[..., :128].reshape(t, supers, 8, 4, PANEL, 4)[pick, :, :, :, column]  # [T, S, b, j, i]
    tops = body[..., 128:].reshape(t, supers, 8, 2, PANEL, 4)[pick, :, :, :, column]  # [T, S, b, j // 2, i]
    shifts = (2 * torch.arange(4, dtype=torch.uint8)).view(2, 2, 1)  # [j % 2, h, 1]: bit 2 (2 (j % 2) + h)
    top = (tops[:, :, :, :, None, None, :] >> shifts) & 3  # [T, S, b, j // 2, j % 2, h, i]
    low = torch.stack((nibbles & 0x0F, nibbles >> 4), dim=4)  # [T, S, b, j, h, i]
    codes = (low | (top.reshape(low.shape) << 4)).reshape(t, supers, 256)  # element 32 b + 8 j + 4 h + i
    # the file's bytes: element 128 n + 32 q + l in ql[64 n + 32 (q % 2) + l] (nibble q // 2), qh[32 n + l] (bits 2 q)
    e = codes.reshape(t, supers, 2, 4, 32)  # [T, S, n, q, l]
    ql = (e[:, :, :, 0:2] & 0x0F) | ((e[:, :, :, 2:4] & 0x0F) << 4)  # [T, S, n, q % 2, l]
    high = e >> 4
    qh = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6)  # [T, S, n, l]
    file_bytes = torch.cat((ql.reshape(t, supers, 128), qh.reshape(t, supers, 64), scales, d), dim=2)  # [T, S, 210]
    return Q6KBlocks(file_bytes.reshape(t, -1).contiguous())


def _packed_panels(parts: tuple[Q4KBlocks, ...] | tuple[Q6KBlocks, ...], in_features: int, panel_super_bytes: int,
                   six_bits: bool) -> torch.Tensor:
    """The parts' rows in turn as csrc/gemm_q4k.cpp's panels uint8 [panels, K / 256, panel bytes], packed straight from
    the file's (mapped) bytes into their final memory (``huge_pages.empty``: huge pages where the weight is large
    enough, or ordinary memory under ``huge_pages.deferred`` for a move onto them over the first steps)."""
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    rows = sum(p.shape[0] for p in parts)
    shape = (-(-rows // PANEL), in_features // SUPER, panel_super_bytes)
    out = huge_pages.empty(shape[0] * shape[1] * shape[2]).view(shape)
    torch.ops.kvloom.pack_kquant_parts(out, [p.data for p in parts], in_features, six_bits)
    return out


class PackedKQuantWeight:
    """A k-quant weight packed once for csrc/gemm_q4k.cpp, straight from the file's bytes (Q4_K rows, then Q6_K
    rows): x [..., K] (float32 or bfloat16) -> [..., N] in x's dtype, q4_linear_reference's product (bit for bit
    PackedQ4Weight's on the decoded blocks of a weight all Q4_K or all Q6_K; with both, each row's as PackedQ4Weight
    computes it for its own type alone)."""

    def __init__(self, weight: KQuantRows | Q4KBlocks | Q6KBlocks, bias: torch.Tensor | None,
                 portable: bool = False, bf16_tiles: bool = False) -> None:
        weight = KQuantRows.one(weight)
        self.out_features, self.in_features = weight.shape
        self.q4_k_rows = weight.q4_k_rows
        if weight.q4_k and weight.q6_k and self.q4_k_rows % PANEL:
            raise ValueError(f"PackedKQuantWeight: Q4_K rows before Q6_K ones must fill whole panels of {PANEL}, got "
                             f"{self.q4_k_rows}")
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"PackedKQuantWeight: bias must have shape ({self.out_features},), got "
                             f"{tuple(bias.shape)}")
        self.q4_k = _packed_panels(weight.q4_k, self.in_features, PANEL_SUPER_BYTES, six_bits=False)
        self.q6_k = _packed_panels(weight.q6_k, self.in_features, Q6_K_PANEL_SUPER_BYTES, six_bits=True)
        self.bias = None if bias is None else bias.float().contiguous()
        self.portable = portable
        self.bf16_tiles = bf16_tiles
        self._product = torch.ops.kvloom.gemm_kquant.default

    def stack_args(self) -> StackArgs:
        """How csrc/decoder.cpp's plan calls this product (cpu.py llama_layer_stack)."""
        return StackArgs(STACK_K_QUANT, [self.q4_k, self.q6_k, self.bias], bf16_tiles=self.bf16_tiles)

    def rows(self, ids: torch.Tensor) -> Q4Blocks:
        """Rows ``ids`` [T] of the weight, decoded (per 16 inputs where the weight has Q6_K rows)."""
        parts = []
        if self.q4_k.numel():
            parts.append((ids < self.q4_k_rows, packed_q4k_rows(self.q4_k, ids.clamp(max=self.q4_k_rows - 1),
                                                                self.in_features).to_blocks()))
        if self.q6_k.numel():
            tail = (ids - self.q4_k_rows).clamp(min=0)
            parts.append((ids >= self.q4_k_rows, packed_q6k_rows(self.q6_k, tail, self.in_features).to_blocks()))
        if len(parts) == 1:
            return parts[0][1]
        (first, a), (_, b) = parts
        a = a.in_groups_of_16()
        return Q4Blocks(*(torch.where(first.view(-1, 1), x, y) for x, y in zip(a, b)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the k-quant CPU linear takes float32 or bfloat16 activations, got {x.dtype}")
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty((rows.shape[0], self.out_features), dtype=x.dtype)
        self._product(out, rows, self.q4_k, self.q6_k, self.bias, self.portable, -1, self.bf16_tiles)
        return out.view(*x.shape[:-1], self.out_features)


def pack_code_blocks(weight: Q4Blocks | KQuantRows, bias: torch.Tensor | None, bf16_tiles: bool = True,
                     table_product: bool = False) -> PackedQ4Weight | PackedKQuantWeight:
    """The CPU op table's code-block product: the file's k-quant super-blocks take PackedKQuantWeight, every other code
    block PackedQ4Weight (``bf16_tiles``, either: the dequantizing AMX-BF16 product from 16 bf16 rows, on a CPU with
    those tiles; else one formula at every row count; ``table_product``: PackedQ4Weight's table product, also one
    formula)."""
    if isinstance(weight, (KQuantRows, *SUPER_BLOCK_TYPES)):
        return PackedKQuantWeight(weight, bias, bf16_tiles=bf16_tiles)
    return PackedQ4Weight(weight, bias, bf16_tiles=bf16_tiles, table_product=table_product)

"""Weights kept in GGUF's code blocks: 4-bit (Q4_0 / Q4_1 / Q4_K, GPTQ, AWQ), 5-bit (Q5_1 / Q5_K) and 6-bit (Q6_K,
a scale and an offset per 16 inputs instead of 32), their products and their reference.

A ``Q4Blocks`` weight [N, K] holds codes q (0..15 for the 4-bit types, 0..31 for the 5-bit ones, 0..63 for Q6_K) and
per group of G = 32 consecutive k of a row (16 for Q6_K) a scale d and an offset m (fp32; exact):

    W[n, k] = q[n, k] * d[n, k // G] + m[n, k // G]

Q4_1 stores d and m; Q4_0 stores d and means q - 8, which is m = -8 d (exact in fp32).

The product (``q4_linear_reference``) is llama.cpp's for these blocks (``vec_dot_q4_1_q8_1``): the
activations are quantized per (row, block of 32) to int8 codes with one scale each (``quantize_per_block``, the
W8A8 products' quantizer), and per block

    y[m, n] += d[n, b] dx[m, b] S[m, n, b] + m[n, b] dx[m, b] sum_k qx[m, k],   S = sum_k q[n, k] qx[m, k]

with S an exact integer, so the result is W times the quantized activations, whatever the codes' range.
``PackedQ4Weight`` runs it with csrc/gemm_q4.cpp on the codes' low 4 bits (two per byte) and, for 5- and 6-bit codes,
their upper bits in planes beside them (``pack_high_bits``: one bit a weight a plane, put back into each nibble in
registers); Q6_K's groups of 16 are two per block, each with its own sums and scales (the activations still
quantized per 32). On CUDA the Triton kernel reads 5- and 6-bit codes one per byte, groups of 16 with their scales.

A GGUF's Q4_K and Q6_K projections and tables take, on a CPU, the product on the file's own super-blocks instead
(kvloom/ops/q4k.py, whose AMX-INT8 and AMX-BF16 tiles run this file's on panels unpacked as reached: the same
results bit for bit, at the file's 4.5 and 6.56 bits a weight instead of 4.625 and
6.625; a Q4_K_M file's q and k beside its Q6_K v at 4.5 and 6.56 where this packing held all three at 7.125); a
k-quant weight fused with other types, on a GPU, or with ``gguf_super_blocks`` off is decoded into
``Q4Blocks`` here.

On a CPU with AMX-BF16, bf16 activations of ``cpu.bf16_tiles_min_rows("q4")`` rows or more take a second product
instead: the weight dequantized per call, block by block, into bf16 tiles (q d + m in fp32, rounded once to bf16:
the values ``quantization="none"`` would hold) and multiplied by the unquantized activations with fp32 sums
(``q4_dequantized_linear_reference``). Measured at SmolLM2's shapes on 2 cores (csrc/gemm_q4.cpp, kBf16MinRows):
1.1x llama.cpp's product on AMX-INT8 tiles at 16 rows and 1.8x at 64 with the weights streaming from memory, 2-4x at
64-2,048 rows on a weight in cache. Fewer rows keep llama.cpp's product on VNNI, ahead there.

A 4-bit weight with fp16 scales per 32 (GGUF Q4_0 / Q4_1) takes, for bf16 activations where bf16 tiles are allowed
(``table_product``: ``KVLOOM_Q4_ACTIVATIONS=bf16``, or ``bf16_tiles``), the table product at every row count
instead: the same values (q4_dequantized_linear_reference) on AMX-BF16 tiles with the weight as the A tile, each
column's 16 bf16 values looked up from its nibbles, so one formula whatever the batch. SmolLM2's 30 layers of
projections on 2 cores of an AMX Xeon: 8.4-9.9 ms at 1 row against 4.9-5.5 for the int8 product, 8.7-10.5 against
7.4-9.1 at 8 rows, 19-21 ms against 32-35 at 64 rows: opt-in (the table lookups cost more than one row's int8 dots).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvloom.ops import huge_pages
from kvloom.ops.int8 import dequantized_product_reference, quantize_per_block
from kvloom.ops.layer_stack import StackArgs

BLOCK = 32
SUB_BLOCK = 16  # Q6_K's scale granularity: two groups per block of 32
PANEL = 8  # output columns per packed panel (csrc/gemm_q4.cpp's kPanel)
STACK_Q4 = 3  # this product's kind in csrc/decoder.cpp's plan (its Projection::kQ4)


class Q4Blocks(NamedTuple):
    """A code-block weight as GGUF stores it, unpacked: codes uint8 [N, K] (0..15, 0..31 for 5-bit types, 0..63 for
    Q6_K), scales d and offsets m fp32 [N, K / group], a group of 32 inputs (16 for Q6_K's sub-blocks)."""

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def group(self) -> int:
        """Inputs per scale and offset: 32, or 16."""
        n, k = self.codes.shape
        return k // self.d.shape[1] if self.d.dim() == 2 and self.d.shape[1] else BLOCK

    def in_groups_of_16(self) -> Q4Blocks:
        """The same weight with a scale and an offset per 16 inputs (a group of 32's repeated: exact)."""
        if self.group == SUB_BLOCK:
            return self
        return Q4Blocks(self.codes, self.d.repeat_interleave(2, dim=1), self.m.repeat_interleave(2, dim=1))

    @classmethod
    def from_gguf(cls, raw: torch.Tensor, shape: tuple[int, int], with_offset: bool) -> Q4Blocks:
        """A 2-D tensor's bytes as stored: Q4_1 (``with_offset``: d, m, 16 bytes of nibbles per block of 32) or
        Q4_0 (d, 16 bytes). In each block byte j holds element j in its low nibble and element j + 16 in its high
        one."""
        n, k = shape
        if k % BLOCK:
            raise ValueError(f"a Q4 weight needs in_features a multiple of {BLOCK}, got {k}")
        head = 4 if with_offset else 2
        blocks = raw.reshape(-1, head + BLOCK // 2)
        if blocks.shape[0] != n * k // BLOCK:
            raise ValueError(f"{raw.numel()} bytes do not hold a Q4 weight of shape {shape}")
        qs = blocks[:, head:]
        codes = torch.cat((qs & 0x0F, qs >> 4), dim=1).reshape(n, k)
        d = blocks[:, 0:2].contiguous().view(torch.float16).float().reshape(n, k // BLOCK)
        m = (blocks[:, 2:4].contiguous().view(torch.float16).float().reshape(n, k // BLOCK) if with_offset
             else -8.0 * d)
        return cls(codes.contiguous(), d, m)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bits: int = 4, group: int = BLOCK) -> Q4Blocks:
        """Q4_1-style blocks of a float weight (min/max per group, as llama.cpp's quantize_row_q4_1; ``bits`` 5
        as Q5_1's, 6 with ``group`` 16 shaped as Q6_K's): for tests, benchmarks and weights that arrive in float."""
        n, k = weight.shape
        if k % BLOCK or group not in (BLOCK, SUB_BLOCK) or bits not in (4, 5, 6):
            raise ValueError(f"a code-block weight needs in_features a multiple of {BLOCK} (got {k}), a group of "
                             f"{BLOCK} or {SUB_BLOCK} (got {group}) and 4, 5 or 6 bits (got {bits})")
        top = (1 << bits) - 1
        w = weight.float().reshape(n, k // group, group)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        d = (hi - lo) / top
        inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        codes = torch.round((w - lo[..., None]) * inverse[..., None]).clamp_(0, top).to(torch.uint8)
        return cls(codes.reshape(n, k), d.half().float(), lo.half().float())

    def take(self, ids: torch.Tensor) -> Q4Blocks:
        """Rows ``ids`` [T] (a lookup's)."""
        return Q4Blocks(self.codes[ids], self.d[ids], self.m[ids])

    def fits_4_bits(self) -> bool:
        """Whether every code is 0..15, so the 4-bit product (two codes per byte) takes it exactly."""
        return self.codes.numel() == 0 or int(self.codes.max()) <= 15

    def as_int8_blocks(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The same values as int8 codes with a scale per block of 32 ([N, K] int8, [N, K / 32] fp32), where every
        block's offset is a whole number of its scales that leaves the codes in int8 (GGUF Q4_0: m = -8 d, Q5_0:
        -16 d), so q * d + m = (q + m / d) * d exactly; None for any other weight (offsets of their own, Q6_K's
        scales per 16)."""
        if self.group != BLOCK:
            return None
        zero = self.d == 0  # a block of zeros (its offset must be 0 too)
        shift = self.m / torch.where(zero, torch.ones_like(self.d), self.d)
        if not torch.equal(shift, shift.round()) or (shift.numel() and float(shift.abs().max()) > 255) \
                or not torch.equal(shift * self.d, self.m):
            return None
        n, k = self.codes.shape
        codes = self.codes.view(n, k // BLOCK, BLOCK).to(torch.int16) + shift.to(torch.int16)[..., None]
        if codes.numel() and (int(codes.min()) < -128 or int(codes.max()) > 127):
            return None
        return codes.view(n, k).to(torch.int8), self.d.float().clone()

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]: q * d + m per group."""
        n, k = self.codes.shape
        group = self.group
        q = self.codes.float().view(n, k // group, group)
        return (q * self.d[..., None] + self.m[..., None]).view(n, k)


def q4_linear_reference(x: torch.Tensor, weight: Q4Blocks, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The Q4 product in float64 from exact sums per group (x quantized per block of 32 all the same), rounded once
    to x's dtype: x [..., K] -> [..., N]."""
    rows = x.reshape(-1, x.shape[-1])
    qx, dx = quantize_per_block(rows)
    (m, k), n = rows.shape, weight.codes.shape[0]
    group = weight.group
    groups = k // group
    qxb = qx.view(m, groups, group).double()
    sums = torch.einsum("mbk,nbk->mnb", qxb, weight.codes.view(n, groups, group).double())  # exact
    code_sums = qxb.sum(dim=-1)  # [M, groups]
    dxd = dx.double().repeat_interleave(BLOCK // group, dim=1)
    out = (sums * weight.d.double()[None] * dxd[:, None, :]).sum(-1) \
        + (weight.m.double()[None] * (dxd * code_sums)[:, None, :]).sum(-1)
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def q4_dequantized_linear_reference(x: torch.Tensor, weight: Q4Blocks, bias: torch.Tensor | None = None
                                    ) -> torch.Tensor:
    """The bf16 tiles' product in float64: x times the weight dequantized and rounded to x's dtype, plus the bias,
    rounded once to x's dtype: x [..., K] -> [..., N]."""
    n, k = weight.codes.shape
    group = weight.group
    # q d + m rounded once to fp32 (the kernel's FMA), then to x's dtype
    w = (weight.codes.double().view(n, k // group, group) * weight.d.double()[..., None]
         + weight.m.double()[..., None]).view(n, k).float()
    return dequantized_product_reference(x, w, bias)


def pack_q4_weight(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] -> uint8 [ceil(N / 8), K / 32, 128]: per panel of 8 columns and block, 4 loads of 32
    bytes; byte (c, i) of load j holds code (c, 32 b + 8 j + i) low and (c, 32 b + 8 j + 4 + i) high. Zero
    past N."""
    n, k = codes.shape
    panels, blocks = -(-n // PANEL), k // BLOCK
    padded = codes.new_zeros(panels * PANEL, k)
    padded[:n] = codes
    # [panels, c, blocks, j, half, i] -> [panels, blocks, j, c, i, half]
    q = padded.view(panels, PANEL, blocks, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    return (q[..., 0] | (q[..., 1] << 4)).contiguous().view(panels, blocks, 4 * PANEL * 4)


def pack_high_bits(codes: torch.Tensor, planes: int) -> torch.Tensor:
    """The bits above the fourth of 5- or 6-bit codes [N, K] -> uint8 [ceil(N / 8), K / 32, planes, 32]: in plane p
    (bit 4 + p of the codes) byte 4 c + i of a panel's block holds in bit 2 j + h that bit of code
    (c, 32 b + 8 j + 4 h + i), the code pack_q4_weight puts in pair j's byte (c, i), low nibble (h = 0) or high
    (h = 1). Zero past N."""
    n, k = codes.shape
    panels, blocks = -(-n // PANEL), k // BLOCK
    padded = codes.new_zeros(panels * PANEL, k)
    padded[:n] = codes >> 4
    # [panels, c, blocks, j, h, i] -> [panels, blocks, c, i, j, h]: the 8 bits of a byte last
    upper = padded.view(panels, PANEL, blocks, 4, 2, 4).permute(0, 2, 1, 5, 3, 4).reshape(panels, blocks, 32, 8)
    out = []
    for p in range(planes):
        bits = (upper >> p) & 1
        plane = bits[..., 0].clone()
        for t in range(1, 8):
            plane |= bits[..., t] << t
        out.append(plane)
    return torch.stack(out, dim=2).contiguous()


# The two-level scales of the k-quants (GGUF Q4_K / Q5_K / Q6_K) as stored: per super-block of SUPER blocks of 32
# (256 inputs) an fp16 scale per row, and per group an integer sub-scale; each fp32 scale is their exact product.
SUPER = 8
SPLIT_HEAD = 2 * PANEL * 2  # a panel's super-block starts with the fp16 D and M of its 8 columns: 32 bytes
# Sub-scales tried for a super-block's largest |value| (llama.cpp's quantizers give it 63 in Q4_K / Q5_K and -128 in
# Q6_K); a tensor whose super-blocks these leave unresolved keeps fp32 scales (the factoring only saves bytes).
_SUB_SCALE_GUESSES = (63, -128, 127, -127, 31, 15)


def split_scales(values: torch.Tensor, per_super: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """fp32 [N, G] -> (fp16 [N, G / per_super], int8 [N, G]) whose products are the values exactly, in fp32 (a
    k-quant's super-block scale times its sub-scales); None where some super-block is no such product."""
    n, groups = values.shape
    if groups % per_super or not values.numel():
        return None
    v = values.float().reshape(-1, per_super)
    top = v.gather(1, v.abs().argmax(dim=1, keepdim=True))  # [S, 1]: the value of largest magnitude
    scale = torch.zeros_like(top)
    todo = (top != 0).squeeze(1).nonzero().squeeze(1)
    for guess in _SUB_SCALE_GUESSES:
        if not todo.numel():
            break
        rows, d = v[todo], top[todo] / guess
        sub = rows / d
        ok = ((d.half().float() == d).squeeze(1) & (sub == sub.round()).all(1) & (sub >= -128).all(1)
              & (sub <= 127).all(1) & (d * sub.round() == rows).all(1))
        scale[todo[ok]] = d[ok]
        todo = todo[~ok]
    if todo.numel():
        return None
    nonzero = scale != 0
    sub = torch.where(nonzero, v / torch.where(nonzero, scale, torch.ones_like(scale)), torch.zeros_like(v))
    return scale.view(n, groups // per_super).half(), sub.round().to(torch.int8).view(n, groups)


def _panel_columns_last(t: torch.Tensor, n: int, per: int) -> torch.Tensor:
    """[N, S * per] -> [panels, S, per, 8]: each panel's 8 columns last, zero past N."""
    panels = -(-n // PANEL)
    padded = t.new_zeros(panels * PANEL, t.shape[1])
    padded[:n] = t
    return padded.view(panels, PANEL, -1, per).permute(0, 2, 3, 1)


def pack_split_scales(d: torch.Tensor, m: torch.Tensor, groups_per_block: int = 1) -> torch.Tensor | None:
    """fp32 [N, groups] scales and offsets -> uint8 [ceil(N / 8), blocks / SUPER, SPLIT_HEAD + SUPER * rows * 8]
    (per panel and super-block: the fp16 D of its 8 columns, their fp16 M, then per block ``rows`` x 8 int8
    sub-scales: those of d per group, then those of m), with d = D s and m = M t exactly; where m = -32 d (GGUF
    Q6_K) the offsets' sub-scales are d's and only those are stored (rows = G, M = -32 D). None where the scales
    are no such products (the file's own fp16 scales per block, GGUF Q4_0 / Q4_1, or a fused layer's mix)."""
    n, groups = d.shape
    g = groups_per_block
    per_super = SUPER * g
    d_split = split_scales(d, per_super)
    if d_split is None:
        return None
    derived = g == 2 and torch.equal(m, -32 * d)
    if derived:
        top_m = (-32 * d_split[0].float()).half()
        if not torch.equal(top_m.float(), -32 * d_split[0].float()):
            return None
        m_split = (top_m, d_split[1])
    else:
        m_split = split_scales(m, per_super)
        if m_split is None:
            return None
    head = [_panel_columns_last(t.view(torch.int16), n, 1).contiguous().view(torch.uint8)  # [P, S, 1, 16]
            for t in (d_split[0], m_split[0])]
    subs = [d_split[1]] if derived else [d_split[1], m_split[1]]
    # [P, S, SUPER * g, 8] each -> [P, S, SUPER, rows, 8]: per block, d's groups then m's
    blocks = [_panel_columns_last(t, n, per_super).reshape(-1, groups // per_super, SUPER, g, PANEL) for t in subs]
    body = torch.cat(blocks, dim=3).contiguous().view(torch.uint8)
    panels, supers = body.shape[0], body.shape[1]
    return torch.cat((head[0].view(panels, supers, -1), head[1].view(panels, supers, -1),
                      body.view(panels, supers, -1)), dim=2).contiguous()


def pack_q4_scales(d: torch.Tensor, m: torch.Tensor, groups_per_block: int = 1) -> torch.Tensor:
    """fp32 [N, groups] scales and offsets -> the kernel's block scales: the k-quants' two levels where they factor
    (pack_split_scales: 4.6 bits a weight for Q4_K's 4-bit codes, 6.6 for Q6_K's 6-bit ones), else
    [ceil(N / 8), blocks, 2 G, 8] for G groups per block of 32 (d of each group, then m of each, per column; zero
    past N), in fp16 where every value is exactly one (GGUF Q4_0 / Q4_1, GPTQ, AWQ: half the scale bytes to
    stream), else fp32."""
    split = pack_split_scales(d, m, groups_per_block)
    return split if split is not None else pack_block_scales(d, m, groups_per_block)


def pack_block_scales(d: torch.Tensor, m: torch.Tensor, groups_per_block: int = 1) -> torch.Tensor:
    """pack_q4_scales' one level: [ceil(N / 8), blocks, 2 G, 8], fp16 where exact, else fp32."""
    n, groups = d.shape
    panels, g = -(-n // PANEL), groups_per_block
    both = d.new_zeros(2, panels * PANEL, groups)
    both[0, :n], both[1, :n] = d, m
    # [kind, panels, c, blocks, g] -> [panels, blocks, kind, g, c]
    packed = both.view(2, panels, PANEL, groups // g, g).permute(1, 3, 0, 4, 2).reshape(panels, groups // g, 2 * g,
                                                                                         PANEL).contiguous()
    half = packed.half()
    return half if torch.equal(half.float(), packed) else packed


def unpack_q4_scales(scales: torch.Tensor, panels: torch.Tensor, column: torch.Tensor, groups_per_block: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns (panel, column) [T] of pack_q4_scales' scales -> d and m fp32 [T, blocks * G]."""
    t, g = panels.shape[0], groups_per_block
    if scales.dtype != torch.uint8:
        both = scales[panels, :, :, column].float()  # [T, blocks, 2 G]
        return both[:, :, :g].reshape(t, -1), both[:, :, g:].reshape(t, -1)
    chosen = scales[panels]  # [T, S, bytes]
    supers, rows = chosen.shape[1], (chosen.shape[2] - SPLIT_HEAD) // (SUPER * PANEL)
    top = chosen[:, :, :SPLIT_HEAD].contiguous().view(torch.float16).view(t, supers, 2, PANEL)
    top = top[torch.arange(t), :, :, column].float()  # [T, S, 2]
    sub = chosen[:, :, SPLIT_HEAD:].contiguous().view(torch.int8).view(t, supers, SUPER, rows, PANEL)
    sub = sub[torch.arange(t), :, :, :, column].float()  # [T, S, SUPER, rows]
    d = top[:, :, 0, None, None] * sub[..., :g]
    m = top[:, :, 1, None, None] * (sub[..., :g] if rows == g else sub[..., g:])
    return d.reshape(t, -1), m.reshape(t, -1)


def packed_q4_rows(data: torch.Tensor, high: torch.Tensor | None, scales: torch.Tensor, ids: torch.Tensor,
                   in_features: int) -> Q4Blocks:
    """Rows ``ids`` [T] of a weight packed by pack_q4_weight, pack_high_bits and pack_q4_scales, unpacked: the
    codes, scales and offsets those took (in fp32)."""
    panels, column = torch.div(ids, PANEL, rounding_mode="floor"), ids % PANEL
    t, blocks = ids.shape[0], in_features // BLOCK
    # byte (c, i) of load j: code 32 b + 8 j + i in its low nibble, 32 b + 8 j + 4 + i in its high one
    nibbles = data.view(data.shape[0], blocks, 4, PANEL, 4)[panels, :, :, column]  # [T, blocks, j, i]
    codes = torch.stack((nibbles & 0x0F, nibbles >> 4), dim=3)  # [T, blocks, j, half, i]
    if high is not None:
        # plane p, byte 4 c + i, bit 2 j + h: bit 4 + p of the code pack_q4_weight put in (j, h, i)
        planes = high.view(high.shape[0], blocks, high.shape[2], PANEL, 4)[panels, :, :, column]  # [T, b, p, i]
        shifts = torch.arange(8, dtype=torch.uint8).view(4, 2)  # [j, h]
        for plane in range(high.shape[2]):
            bits = (planes[:, :, plane, None, None, :] >> shifts[..., None]) & 1  # [T, b, j, h, i]
            codes |= bits << (4 + plane)
    groups = 2 if high is not None and high.shape[2] == 2 else 1  # 6-bit codes: a scale and an offset per 16
    d, m = unpack_q4_scales(scales, panels, column, groups)
    return Q4Blocks(codes.reshape(t, in_features), d, m)


class NativeQ4Linear:
    """The Q4 product in torch ops where the C++ kernel is not built: activations quantized per block as the
    reference does, both sides dequantized to fp32 per call (the same sums up to fp32 rounding)."""

    def __init__(self, weight: Q4Blocks, bias: torch.Tensor | None) -> None:
        # A Q4_K weight as the file's super-blocks (q4k.Q4KBlocks) is decoded into code blocks of 32 here.
        self.weight = weight if isinstance(weight, Q4Blocks) else weight.to_blocks()
        self.bias = None if bias is None else bias.float()

    def rows(self, ids: torch.Tensor) -> Q4Blocks:
        """Rows ``ids`` [T] of the weight (a tied embedding reads its table here, layers/embedding.py)."""
        return self.weight.take(ids)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        qx, dx = quantize_per_block(rows)
        m, k = qx.shape
        x_blocks = (qx.float().view(m, k // BLOCK, BLOCK) * dx[..., None]).view(m, k)
        out = x_blocks @ self.weight.dequantize().t()
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.weight.codes.shape[0])


class PackedQ4Weight:
    """A Q4 weight packed once for csrc/gemm_q4.cpp: x [..., K] (float32 or bfloat16) -> [..., N] in x's
    dtype, the product of q4_linear_reference; with ``bf16_tiles`` (the default) bf16 x of
    cpu.bf16_tiles_min_rows("q4") rows or more take that of q4_dequantized_linear_reference (on a CPU with AMX-BF16),
    and for 4-bit codes with fp16 scales per 32 where cpu.q4_table_product(), bf16 x of any row count take it
    (the table product: one formula whatever the batch, so ``table_product`` allows it where batch-dependent
    products are not)."""

    def __init__(self, weight: Q4Blocks, bias: torch.Tensor | None, portable: bool = False,
                 bf16_tiles: bool = True, table_product: bool = False) -> None:
        self.out_features, self.in_features = weight.codes.shape
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"PackedQ4Weight: bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
        codes = weight.codes
        top = int(codes.max()) if codes.numel() else 0
        if codes.dtype != torch.uint8 or top > 63:
            raise ValueError(f"PackedQ4Weight takes uint8 codes of 4, 5 or 6 bits (0..63), got {codes.dtype} codes up "
                             f"to {top}")
        if weight.group not in (BLOCK, SUB_BLOCK):
            raise ValueError(f"PackedQ4Weight takes a scale per {BLOCK} or {SUB_BLOCK} inputs, got {weight.group}")
        # 6-bit codes (Q6_K) go with a scale and an offset per 16 inputs, and groups of 16 with 6-bit planes (a
        # layer fusing Q4_K and Q6_K shards): the kernel's two forms are 4 or 5 bits per 32, and 6 bits per 16.
        halves = top > 31 or weight.group == SUB_BLOCK
        if halves:
            weight = weight.in_groups_of_16()
        planes = 2 if halves else 1 if top > 15 else 0
        self.data = huge_pages.rehome(pack_q4_weight(codes & 0x0F))
        # The codes' fifth (and sixth) bits in planes beside the nibbles, read by the same kernel.
        self.high = huge_pages.rehome(pack_high_bits(codes, planes)) if planes else None
        self.scales = huge_pages.rehome(pack_q4_scales(weight.d.float(), weight.m.float(), 2 if halves else 1))
        self.bias = None if bias is None else bias.float().contiguous()
        self.portable = portable
        # The op's bf16_tiles: on an AMX-BF16 CPU a 4-bit weight with fp16 scales per 32 then takes the table product
        # at every row count (one formula: allowed by ``table_product`` too); others the dequantizing one from 16.
        table = not halves and planes == 0 and self.scales.dtype == torch.float16
        self.bf16_tiles = bf16_tiles or (table_product and table)
        self._product = torch.ops.kvloom.gemm_q4.default

    def stack_args(self) -> StackArgs:
        """How csrc/decoder.cpp's plan calls this product (cpu.py llama_layer_stack)."""
        return StackArgs(STACK_Q4, [self.data, self.scales, self.bias, self.high], bf16_tiles=self.bf16_tiles)

    def rows(self, ids: torch.Tensor) -> Q4Blocks:
        """Rows ``ids`` [T] of the weight as packed (a tied embedding reads its table here, layers/embedding.py);
        Q4_0 / Q4_1 / Q5_1-like groups of 32 as such, 6-bit ones per 16."""
        return packed_q4_rows(self.data, self.high, self.scales, ids, self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the Q4 CPU linear takes float32 or bfloat16 activations, got {x.dtype}")
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty((rows.shape[0], self.out_features), dtype=x.dtype)
        self._product(out, rows, self.data, self.scales, self.bias, self.portable, self.high, self.bf16_tiles)
        return out.view(*x.shape[:-1], self.out_features)


"""int8 weight storage: per-output-channel symmetric quantization, and the references of its matrix products.

A weight W [N, K] is stored as ``qweight`` int8 [N, K] and ``scale`` fp32 [N] with
W[n, :] ~= qweight[n, :] * scale[n] and scale[n] = max|W[n, :]| / 127 (a zero row gets scale 1).

Two products use it:
- weight-only (``int8_linear_reference``): activations stay in their dtype; y = (x @ qweight^T) * scale + b,
  summed in fp32 and rounded once to x's dtype;
- W8A8 (``w8a8_linear_reference``): each activation row is quantized to int8 on the fly with its own
  scale (``quantize_per_token``), the products are summed exactly in int32, and both scales are
  applied at the end.

A group-scaled weight (``Int8Blocks``: a GGUF Q8_0 tensor kept as it is stored) has one scale per block of
BLOCK = 32 consecutive k of a row: ``scale`` [N, K / 32] (fp32, each a Q8_0 file's fp16 d exactly; packed for the
CPU product in fp16 again, ``compact_block_scales``), W[n, k] = qweight[n, k] * scale[n, k // 32].
Its product (``w8a8_blocks_linear_reference``) quantizes the activations per (token, block) too, as
llama.cpp's ``vec_dot_q8_0_q8_0`` does, sums each block exactly and applies the block's two scales:

    y[m, n] = sum_b (sum_{k in b} qx[m, k] qweight[n, k]) * x_scale[m, b] * scale[n, b]

Activation blocks of 32 follow their outliers closely, which is why Q8_0 needs no smoothing. (llama.cpp
rounds its activation scales to fp16 and its codes half away from zero; here the scales stay fp32 and
the rounding is to even, as for the per-token activations.)

``NativeInt8Linear`` and ``NativeInt8BlocksLinear`` are the portable fast-enough paths (torch ops
only), used wherever no platform kernel is built.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

QMAX = 127
BLOCK = 32  # k per scale of a group-scaled weight: a GGUF Q8_0 block


class Int8Rows(NamedTuple):
    """A weight already in int8 storage, as the loader hands it to a layer: int8 [N, K] and fp32 scales [N]."""

    qweight: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Rows:
        return cls(*quantize_per_channel(weight))

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]: codes times their row's scale."""
        return dequantize(self.qweight, self.scale)


class Int8Blocks(NamedTuple):
    """A group-scaled int8 weight (a GGUF Q8_0 tensor's own codes and block scales): int8 [N, K] and fp32
    scales [N, K / BLOCK]."""

    qweight: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @classmethod
    def from_rows(cls, rows: Int8Rows) -> Int8Blocks:
        """The same weight with its row scale repeated over the row's blocks (exact)."""
        n, k = rows.qweight.shape
        if k % BLOCK:
            raise ValueError(f"int8 rows of {k} values cannot take block scales: in_features must be a multiple "
                             f"of {BLOCK}")
        return cls(rows.qweight, rows.scale.float()[:, None].expand(n, k // BLOCK).contiguous())

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]: codes times their block's scale (exact in fp32 for a Q8_0 weight's fp16 scales)."""
        return dequantize_blocks(self.qweight, self.scale)

    def to_rows(self) -> Int8Rows:
        """Re-quantized per row from the exact values: for products that have no block scales."""
        return Int8Rows.quantize(self.dequantize())


Q8_0_BLOCK_BYTES = 2 + BLOCK  # a GGUF Q8_0 block as stored: fp16 d, then 32 int8 codes


def rows_of_bytes(raw: torch.Tensor, shape: tuple[int, int], name: str, inputs: int, block_bytes: int) -> torch.Tensor:
    """A 2-D tensor's bytes as the file stores it (blocks of ``inputs`` values in ``block_bytes`` each, row after row)
    -> uint8 [N, K / inputs * block_bytes]."""
    n, k = shape
    if k % inputs:
        raise ValueError(f"a {name} weight needs in_features a multiple of {inputs}, got {k}")
    if raw.numel() != n * k // inputs * block_bytes:
        raise ValueError(f"{raw.numel()} bytes do not hold a {name} weight of shape {tuple(shape)}")
    return raw.reshape(n, k // inputs * block_bytes)


class Q8_0Blocks(NamedTuple):
    """A GGUF Q8_0 weight [N, K] as the file stores it: uint8 [N, K / 32 * 34], each row its blocks (fp16 d, then 32
    int8 codes). A projection's shards stay so until ``cpu.PackedInt8BlocksWeight.from_q8_0`` packs them from these
    bytes in one pass (no decoding, no joined copy); anything else reads them as ``Int8Blocks`` (``to_int8_blocks``:
    the same values exactly)."""

    data: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        n, row_bytes = self.data.shape
        return torch.Size((n, row_bytes // Q8_0_BLOCK_BYTES * BLOCK))

    @classmethod
    def from_gguf(cls, raw: torch.Tensor, shape: tuple[int, int]) -> Q8_0Blocks:
        """A 2-D Q8_0 tensor's bytes (uint8, as read or mapped) of torch shape [N, K]."""
        return cls(rows_of_bytes(raw, shape, "Q8_0", BLOCK, Q8_0_BLOCK_BYTES))

    def to_int8_blocks(self) -> Int8Blocks:
        """The codes int8 [N, K] and the fp16 block scales as fp32 [N, K / 32] (exact)."""
        n, k = self.shape
        blocks = self.data.reshape(-1, Q8_0_BLOCK_BYTES)
        codes = blocks[:, 2:].contiguous().view(torch.int8).reshape(n, k)
        return Int8Blocks(codes, blocks[:, :2].contiguous().view(torch.float16).float().reshape(n, k // BLOCK))

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]."""
        return self.to_int8_blocks().dequantize()

    def take(self, ids: torch.Tensor) -> Q8_0Blocks:
        """Rows ``ids`` [T]."""
        return Q8_0Blocks(self.data[ids])


def compact_block_scales(scale: torch.Tensor) -> torch.Tensor:
    """Block scales as the packed product streams them: fp16 where every one is exactly an fp16 value (a GGUF Q8_0's
    own d, so 8.5 bits a weight as in the file instead of 9; csrc/gemm_int8.cpp widens them exactly), else fp32."""
    half = scale.half()
    return half if torch.equal(half.float(), scale.float()) else scale.float()


def check_blocks_shape(qweight: torch.Tensor, scale: torch.Tensor) -> None:
    """ValueError unless qweight is int8 [N, K] with K a multiple of BLOCK and scale is [N, K / BLOCK]."""
    if qweight.dim() != 2 or qweight.dtype != torch.int8:
        raise ValueError(f"a group-scaled int8 weight must be int8 [out, in], got {qweight.dtype} "
                         f"of shape {tuple(qweight.shape)}")
    n, k = qweight.shape
    if k % BLOCK:
        raise ValueError(f"a group-scaled int8 weight needs in_features a multiple of {BLOCK} (Q8_0 blocks), "
                         f"got {k}")
    if tuple(scale.shape) != (n, k // BLOCK):
        raise ValueError(f"the block scales of an int8 [{n}, {k}] weight must have shape {(n, k // BLOCK)}, "
                         f"got {tuple(scale.shape)}")


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], fp32 scale [N]): symmetric, one scale per output row."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_per_channel takes a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    qweight = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return qweight, scale


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (qweight.float() * scale.float()[:, None]).to(dtype)


def dequantize_blocks(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = qweight.shape
    return (qweight.float().view(n, k // BLOCK, BLOCK) * scale.float()[..., None]).view(n, k)


def quantize_per_block(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] float -> (int8 [M, K], fp32 scale [M, K / BLOCK]): each block of 32 k of a row with its own
    symmetric scale, as quantize_per_token does for a whole row."""
    m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"quantize_per_block needs K a multiple of {BLOCK}, got {k}")
    xf = x.float().view(m, k // BLOCK, BLOCK)
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    return torch.round(xf / scale[..., None]).clamp_(-QMAX, QMAX).to(torch.int8).view(m, k), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] float -> (int8 [M, K], fp32 scale [M]): each row with its own symmetric scale."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    return torch.round(xf / scale[..., None]).clamp_(-QMAX, QMAX).to(torch.int8), scale


def int8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only int8: (x @ qweight^T) * scale (+ bias) in fp32, rounded once to x's dtype."""
    out = (x.float() @ qweight.float().t()) * scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def w8a8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """int8 activations (per token) times int8 weights (per channel), exact int32 sums, scales at the end."""
    rows = x.reshape(-1, x.shape[-1])
    qx, x_scale = quantize_per_token(rows)
    acc = qx.to(torch.int64) @ qweight.to(torch.int64).t()  # exact: what an int32 accumulator holds
    out = acc.double() * x_scale.double()[:, None] * scale.double()[None, :]
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])


def w8a8_blocks_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """A group-scaled weight's product: activations quantized per (token, block), each block's sum exact,
    scaled by x_scale[m, b] * scale[n, b] and summed over blocks in float64, rounded once to x's dtype."""
    check_blocks_shape(qweight, scale)
    rows = x.reshape(-1, x.shape[-1])
    qx, x_scale = quantize_per_block(rows)
    (m, k), n = rows.shape, qweight.shape[0]
    blocks = k // BLOCK
    # [M, N, blocks] block sums: exact in float64 (|sum| < 32 * 127^2).
    acc = torch.einsum("mbk,nbk->mnb", qx.view(m, blocks, BLOCK).double(), qweight.view(n, blocks, BLOCK).double())
    out = (acc * x_scale.double()[:, None, :] * scale.double()[None, :, :]).sum(dim=-1)
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def w8a8_blocks_dequantized_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the AMX-BF16 tiles compute for a block-scaled weight and bf16 x of enough rows (csrc/amx_bf16.h): x
    times the weight dequantized (q d rounded once to fp32) and rounded to x's dtype, plus the bias, in float64,
    rounded once to x's dtype."""
    check_blocks_shape(qweight, scale)
    return dequantized_product_reference(x, dequantize_blocks(qweight, scale), bias)  # q d: one fp32 rounding


def dequantized_product_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The AMX-BF16 tiles' product (csrc/amx_bf16.h) in float64: x [..., K] times ``weight`` (the dequantized fp32
    [N, K]) rounded to x's dtype, plus the bias, rounded once to x's dtype: [..., N]."""
    out = x.reshape(-1, x.shape[-1]).double() @ weight.to(x.dtype).double().t()
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


class NativeInt8Linear:
    """Weight-only int8 in torch ops: int8_linear_reference's arithmetic. The int8 weight is cast to fp32 per
    call (exact), multiplied by torch's fp32 GEMM, scaled and biased in fp32 and rounded once to x's dtype:
    torch's bf16 GEMM where the CPU has no bf16 dot product rounds partial sums (4 bf16 ulps off at AVX2's and
    the generic level), and a bf16 scale would round the scale itself."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.qweight = qweight
        self.scale = scale.float()
        self.bias = None if bias is None else bias.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x.float(), self.qweight.float()) * self.scale
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype)


class NativeInt8BlocksLinear:
    """A group-scaled weight's product in torch ops: the activations quantized per (token, block) as the
    reference does, then both sides dequantized to fp32 per call and multiplied by torch's GEMM (the same
    sums as the reference up to fp32 rounding; only the int8 weight is kept)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        check_blocks_shape(qweight, scale)
        self.qweight = qweight
        self.scale = scale.float()
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        x_blocks = dequantize_blocks(*quantize_per_block(rows))
        out = F.linear(x_blocks, dequantize_blocks(self.qweight, self.scale))
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], self.qweight.shape[0])

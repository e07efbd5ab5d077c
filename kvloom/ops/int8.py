"""int8 weight storage: per-output-channel symmetric quantization, and the references of its matrix products.

A weight W [N, K] is stored as ``qweight`` int8 [N, K] and ``scale`` fp32 [N] with
W[n, :] ~= qweight[n, :] * scale[n] and scale[n] = max|W[n, :]| / 127 (a zero row gets scale 1).

Two products use it:
- weight-only (``int8_linear_reference``): activations stay in their dtype; y = (x @ qweight^T) * scale + b,
  summed in fp32 and rounded once to x's dtype;
- W8A8 (``w8a8_linear_reference``): each activation row is quantized to int8 on the fly with its own
  scale (``quantize_per_token``), the products are summed exactly in int32, and both scales are
  applied at the end.

``NativeInt8Linear`` is the portable fast-enough path (torch ops only), used wherever no platform
kernel is built.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

QMAX = 127


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


class NativeInt8Linear:
    """Weight-only int8 in torch ops: the int8 weight is cast to x's dtype per call (exact: |q| <= 127),
    multiplied by torch's GEMM, and the per-channel scale applied to the output."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.qweight = qweight
        self.scale = scale.float()
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out

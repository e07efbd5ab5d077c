"""The CUDA ops: Triton kernels (triton/) behind the ops' signatures.

The kernels take preallocated outputs and never sync the host, so a decode step that calls them can
be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from kvloom.ops.metadata import AttentionMetadata
from kvloom.ops.q4 import Q4Blocks
from kvloom.ops.triton import attention as kernels
from kvloom.ops.triton import fused
from kvloom.ops.triton import int8 as int8_kernels
from kvloom.ops.triton import q4 as q4_kernels


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              key_cache: torch.Tensor, value_cache: torch.Tensor,
              metadata: AttentionMetadata, scale: float, logit_softcap: float | None = None) -> torch.Tensor:
    """query: [T, Hq, D]; key, value: [T, Hkv, D] (this step's); returns [T, Hq, D]. ``logit_softcap``
    (Gemma 2): scores become cap * tanh(scores / cap) before the mask and softmax."""
    kernels.write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    kernels.paged_attention(out, query, key_cache, value_cache, metadata.block_table, metadata.seq_lens,
                            metadata.query_start_loc_tensor, metadata.num_decodes, metadata.max_query_len,
                            scale, metadata.sliding_window or 0, logit_softcap=logit_softcap)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    fused.rms_norm(out, x, weight, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: x becomes norm(x + residual), residual the sum."""
    fused.fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def rotary_embedding(positions: torch.Tensor, x: torch.Tensor, cos_cache: torch.Tensor,
                     sin_cache: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, heads, D] in place."""
    fused.rotary_embedding(x, positions, cos_cache, sin_cache)
    return x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
    fused.silu_and_mul(out, x)
    return out


class Int8Linear:
    """An int8 weight (per-channel scale, optional bias) for the Triton weight-only GEMM: the weight is
    stored transposed once, [K, N]; calling it gives int8_linear_reference's (x @ q^T) * scale + bias."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        if qweight.dim() != 2 or qweight.dtype != torch.int8:
            raise ValueError(f"Int8Linear takes an int8 [out, in] weight, got {qweight.dtype} "
                             f"of shape {tuple(qweight.shape)}")
        self.out_features, self.in_features = qweight.shape
        self.weight_t = qweight.t().contiguous()
        self.scale = scale.float().contiguous()
        self.bias = None if bias is None else bias.float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype, device=x.device)
        int8_kernels.int8_linear(out.view(-1, self.out_features), rows, self.weight_t, self.scale, self.bias)
        return out


class Q4Linear:
    """A code-block weight (``Q4Blocks``, optional bias) for the Triton code-block GEMM: nibbles packed once
    [K / 2, N] (triton/q4.py pack_q4_columns), or one code a byte [K, N] where a code takes 5 bits
    (pack_code_columns), d and m transposed [K / 32, N] ([K / 16, N] for Q6_K's groups of 16); calling it gives
    x @ W^T (+ b) with W dequantized in registers."""

    def __init__(self, weight: Q4Blocks, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.codes.shape
        # Groups of 16 are read from one code a byte (the kernel's two halves of a block each with their scales).
        four_bits = weight.fits_4_bits() and weight.group == 32
        pack = q4_kernels.pack_q4_columns if four_bits else q4_kernels.pack_code_columns
        self.packed = pack(weight.codes)
        self.d = weight.d.float().t().contiguous()
        self.m = weight.m.float().t().contiguous()
        self.bias = None if bias is None else bias.float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype, device=x.device)
        q4_kernels.q4_linear(out.view(-1, self.out_features), rows, self.packed, self.d, self.m, self.bias)
        return out

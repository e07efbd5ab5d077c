"""The ops through torch's own fused kernels, on any device: the fallback of every platform.

Attention goes through torch's scaled_dot_product_attention (CPU flash kernel, CUDA flash).

Decodes are one batched product over keys gathered by block table up to a bucketed length (the
null block pads shorter rows, the mask hides it). A prefill with no earlier context attends to its own
new keys directly (no cache read); a chunk that continues a sequence gathers its context.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvloom.ops.metadata import AttentionMetadata
from kvloom.ops.reference import apply_rotary_reference, causal_mask, gather_sequence, grouped_experts, write_kv_cache
from kvloom.ops.reference import silu_and_mul as silu_and_mul


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     key_cache: torch.Tensor, value_cache: torch.Tensor,
                     metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """query: [T, Hq, D]; key, value: [T, Hkv, D]; returns [T, Hq, D]."""
    write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
    out = torch.empty_like(query)
    num_decodes = metadata.num_decodes
    if num_decodes:
        out[:num_decodes] = _decode(query[:num_decodes], key_cache, value_cache, metadata, scale)
    for i in range(num_decodes, metadata.num_requests):
        start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
        seq_len = metadata.seq_lens_host[i]
        query_len = end - start
        q = query[start:end].transpose(0, 1)  # [Hq, Q, D]
        if seq_len == query_len and (metadata.sliding_window is None or seq_len <= metadata.sliding_window):
            k = key[start:end].transpose(0, 1)
            v = value[start:end].transpose(0, 1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            k = gather_sequence(key_cache, metadata.block_table[i], seq_len).transpose(0, 1)
            v = gather_sequence(value_cache, metadata.block_table[i], seq_len).transpose(0, 1)
            mask = causal_mask(query_len, seq_len, metadata.sliding_window, query.device)
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                               scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
    return out


def dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """query [B, H, Lq, D], key and value [B, H, Lk, D] -> [B, H, Lq, D]: every query attends to every key (no mask,
    scale 1 / sqrt(D)), a vision tower's attention within a tile."""
    return F.scaled_dot_product_attention(query, key, value)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """gelu with tanh's approximation (SigLIP's ``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's fused kernel. In bf16 it accumulates in fp32 and rounds once at the end (the
    reference rounds before the weight multiply too), so results differ by at most an ulp."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the sum is rounded to the dtype, as HF rounds it."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rotary_embedding(positions: torch.Tensor, x: torch.Tensor, cos_cache: torch.Tensor,
                     sin_cache: torch.Tensor) -> torch.Tensor:
    """positions: [T]; x: [T, heads, D]; caches: [max_position, D // 2] fp32 -> rotated x (a new tensor).

    fp32 is the reference exactly; lower precisions compute in x's dtype as HF does (no fp32 round trip).
    """
    cos = cos_cache.index_select(0, positions)
    sin = sin_cache.index_select(0, positions)
    if x.dtype == torch.float32:
        return apply_rotary_reference(x, cos, sin)
    cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits: [B, V] -> [B] int64."""
    return logits.argmax(dim=-1)


def _decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """query: [B, Hq, D] (one token per request) -> [B, Hq, D].

    Grouped matmuls rather than SDPA: torch's fused kernels are slow for one query row with a
    mask on the CPU. The g query heads that share a KV head form one [g, D] x [D, L] product.
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    block_table = metadata.block_table[:batch, :metadata.decode_num_blocks]
    # [B, nb, bs, Hkv, D] -> [B, Hkv, L, D]
    k = key_cache[block_table].view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = value_cache[block_table].view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    q = query.view(batch, num_kv_heads, group, head_dim)
    scores = torch.matmul(q, k.transpose(2, 3).to(q.dtype)).float() * scale  # [B, Hkv, g, L]
    scores = scores.masked_fill(~metadata.decode_mask.view(batch, 1, 1, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    return torch.matmul(probs, v.to(query.dtype)).view(batch, num_heads, head_dim)


class PackedExperts:
    """A mixture of experts whose every expert's two weights are packed for the platform's GEMM (``pack_linear``:
    the CPU's bf16 GEMM), run grouped by expert (reference.grouped_experts): each expert's packed products run
    once over its tokens. The stacked weights are not kept. (hidden, topk_weights, topk_ids) -> [T, H]."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor,
                 pack_linear: Callable[[torch.Tensor, torch.Tensor | None], Callable[[torch.Tensor], torch.Tensor]]
                 ) -> None:
        self.num_experts = w13.shape[0]
        self.gate_up = [pack_linear(w13[e].contiguous(), None) for e in range(self.num_experts)]
        self.down = [pack_linear(w2[e].contiguous(), None) for e in range(self.num_experts)]

    def __call__(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return grouped_experts(hidden, lambda e, x: self.gate_up[e](x), lambda e, x: self.down[e](x),
                               self.num_experts, topk_weights, topk_ids)


class PackedInt8Experts:
    """A mixture of experts in int8 (quantization="int8"): every expert's two int8 weights (per-row scales, the
    dense layers' format) packed for the platform's int8 product (``pack_linear_int8``: the CPU's C++ int8 GEMM,
    W8A8 or weight-only as the dense layers run; the Triton weight-only GEMM on CUDA; torch ops under the
    reference backend), run grouped by expert (reference.grouped_experts): each expert's two products once over
    its tokens. w13_qweight int8 [E, 2I, H], w13_scale fp32 [E, 2I], w2_qweight [E, H, I], w2_scale [E, H].
    (hidden, topk_weights, topk_ids) -> [T, H]."""

    def __init__(self, w13_qweight: torch.Tensor, w13_scale: torch.Tensor, w2_qweight: torch.Tensor,
                 w2_scale: torch.Tensor,
                 pack_linear_int8: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None],
                                            Callable[[torch.Tensor], torch.Tensor]]) -> None:
        self.num_experts = w13_qweight.shape[0]
        self.gate_up = [pack_linear_int8(w13_qweight[e].contiguous(), w13_scale[e].contiguous(), None)
                        for e in range(self.num_experts)]
        self.down = [pack_linear_int8(w2_qweight[e].contiguous(), w2_scale[e].contiguous(), None)
                     for e in range(self.num_experts)]

    def __call__(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return grouped_experts(hidden, lambda e, x: self.gate_up[e](x), lambda e, x: self.down[e](x),
                               self.num_experts, topk_weights, topk_ids)


class ExpertProducts:
    """A mixture of experts given each expert's two products (gate/up: x [n, H] -> [n, 2I]; down: [n, I] -> [n, H]),
    packed however each one's weights are held (a GGUF's 4-bit blocks, or float), run grouped by expert
    (reference.grouped_experts). (hidden, topk_weights, topk_ids) -> [T, H]."""

    def __init__(self, gate_up: list[Callable[[torch.Tensor], torch.Tensor]],
                 down: list[Callable[[torch.Tensor], torch.Tensor]]) -> None:
        self.gate_up, self.down = gate_up, down

    def __call__(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return grouped_experts(hidden, lambda e, x: self.gate_up[e](x), lambda e, x: self.down[e](x),
                               len(self.gate_up), topk_weights, topk_ids)

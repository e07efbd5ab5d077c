"""The op table: which implementation of each op runs, chosen once when the model is built.

The choice, for a model on ``device`` in ``dtype`` with ``attention_backend``:

    backend      attention                small ops (norm, rotary, SiLU, argmax)   linear
    reference    reference (per request)  torch                                     F.linear
    native       torch SDPA               platform's (C++ on the CPU, Triton on CUDA) platform's
    cpu          C++ paged attention      C++                                       packed bf16 GEMM
    triton       Triton paged attention   Triton                                    F.linear (cuBLAS)
    auto         cpu on the CPU, triton on CUDA

and for int8 weights (``pack_linear_int8``): the C++ W8A8 / weight-only GEMMs on the CPU
(cpu.PackedInt8Weight), the Triton weight-only GEMM on CUDA (cuda.Int8Linear); torch ops
(int8.NativeInt8Linear) under the reference backend and where neither is built. Block-scaled int8
weights (``pack_linear_int8_blocks``: a GGUF Q8_0 kept as stored) take the C++ W8A8-on-blocks GEMM on the
CPU (cpu.PackedInt8BlocksWeight) and torch ops (int8.NativeInt8BlocksLinear) under the reference
backend; CUDA has no block-scaled kernel, so there they are re-quantized per row once, as they are packed,
for the Triton weight-only GEMM (the same int8 weights as a per-row load of the same file). Code-block weights
(``pack_linear_q4``: a GGUF's 4-, 5- and 6-bit blocks kept) take the C++ Q4 GEMM on the CPU (q4.PackedQ4Weight,
llama.cpp's product; 5- and 6-bit codes with their upper bits in planes beside the nibbles), torch ops
(q4.NativeQ4Linear) under the reference backend, and on CUDA
the Triton code-block GEMM (cuda.Q4Linear: the weight dequantized in registers, activations as they are; two
codes a byte, or one, with Q6_K's scales per 16 inputs).

A mixture of experts (``pack_experts``) runs the Triton grouped GEMM on CUDA (triton/moe.py TritonExperts), each
expert's products through the packed bf16 GEMM on the CPU (native.PackedExperts), and the plain-torch grouped
reference elsewhere (fp32 on the CPU, the reference backend). A model whose attention needs a feature the
kernels lack (Gemma 2's logit soft-cap) gets the reference attention from ``attention_for``, with a log line.

A platform whose kernels cannot be built (no compiler, no Triton) falls back to the native ops, with
one warning that says why.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvloom.ops import ATTENTION_BACKENDS, int8, native, q4, q4k, reference
from kvloom.ops.layer_stack import LayerShape, LayerWeights
from kvloom.ops.metadata import AttentionMetadata
from kvloom.ops.reference import allocate_kv_caches

logger = logging.getLogger("kvloom")

# (query [T, Hq, D], key [T, Hkv, D], value, key_cache, value_cache, metadata, scale) -> [T, Hq, D];
# writes this step's keys and values into the caches first.
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                        AttentionMetadata, float], torch.Tensor]
# (weight [N, K], bias [N] or None) -> a function x [..., K] -> [..., N] equal to F.linear.
PackLinearFn = Callable[[torch.Tensor, torch.Tensor | None], Callable[[torch.Tensor], torch.Tensor]]
# (qweight int8 [N, K], scale fp32 [N] (or [N, K / 32] for the blocks' op), bias [N] or None) -> a function
# x [..., K] -> [..., N] (ops/int8.py).
PackInt8Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], Callable[[torch.Tensor], torch.Tensor]]
PackQ4Fn = Callable[[q4.Q4Blocks, torch.Tensor | None], Callable[[torch.Tensor], torch.Tensor]]
PackQ8_0Fn = Callable[[Sequence[int8.Q8_0Blocks], torch.Tensor | None], Callable[[torch.Tensor], torch.Tensor]]


# (w13 [E, 2I, H], w2 [E, H, I]) -> a function (hidden [T, H], topk_weights [T, k], topk_ids [T, k]) -> [T, H]:
# a mixture of experts' SwiGLU MLPs, tokens grouped by expert (ops/reference.py grouped_experts).
PackExpertsFn = Callable[[torch.Tensor, torch.Tensor], Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                                                                  torch.Tensor]]


# (query [B, H, Lq, D], key [B, H, Lk, D], value [B, H, Lk, D]) -> [B, H, Lq, D]: attention with no mask and no
# cache (a vision tower's, within a tile), scale 1 / sqrt(D).
DenseAttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# (per-layer weights, shape, hidden size, rotary cos table, sin table) -> a function (embeddings [T, H],
# positions, kv_caches, metadata) -> (last layer's output, residual stream) running every decoder layer at
# once, or None where these layers do not qualify.
LayerStackFn = Callable[[list[LayerWeights], LayerShape, int, torch.Tensor, torch.Tensor], Callable | None]


@dataclass(frozen=True)
class Ops:
    """One implementation of every op. See each platform module for the shapes."""

    name: str
    attention: AttentionFn
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (x, residual, weight, eps) -> (norm(x + residual), x + residual); may reuse x and residual's memory.
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    # (positions, x [T, heads, D], cos_cache, sin_cache) -> rotated x; may rotate x in place.
    rotary_embedding: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    argmax: Callable[[torch.Tensor], torch.Tensor]
    # None: linear layers keep their weight and call F.linear.
    pack_linear: PackLinearFn | None = None
    # int8 weights (quantization="int8"): the platform's int8 product; torch ops where none is built.
    pack_linear_int8: PackInt8Fn = int8.NativeInt8Linear
    # Block-scaled int8 weights (int8.Int8Blocks): the product with activations quantized per block.
    pack_linear_int8_blocks: PackInt8Fn = int8.NativeInt8BlocksLinear
    # A GGUF's Q8_0 projection as the file's bytes (its shards, int8.Q8_0Blocks) -> the block-scaled product packed from
    # them in one pass; None: the shards are decoded to int8.Int8Blocks for pack_linear_int8_blocks.
    pack_linear_q8_0: PackQ8_0Fn | None = None
    # 4-bit weights kept 4-bit (a GGUF's Q4_0 / Q4_1 / Q4_K, quantization="gguf"): the platform's Q4 product.
    pack_linear_q4: PackQ4Fn = q4.NativeQ4Linear
    # The native attention's batched decode reads a block table padded to a bucketed width and a mask.
    needs_decode_mask: bool = False
    # (head_dim, block_size, dtype) -> whether attention reads the caches in the pairs layout (ops/reference.py
    # allocate_kv_cache); None: always rows.
    pairs_layout: Callable[[int, int, torch.dtype], bool] | None = None
    # Every Llama decoder layer in one native call (the CPU's csrc/decoder.cpp); None: module by module.
    llama_layer_stack: LayerStackFn | None = None
    # A mixture of experts' MLPs (layers/moe.py), prepared once from the stacked weights.
    pack_experts: PackExpertsFn = reference.ReferenceExperts
    # A vision tower's attention (models/vision_encoder.py): the CPU's csrc/dense_attention.cpp, else torch's SDPA.
    dense_attention: DenseAttentionFn = native.dense_attention
    # gelu with tanh's approximation (a SigLIP tower's MLP): x -> gelu(x); may write over x.
    gelu_tanh: Callable[[torch.Tensor], torch.Tensor] = native.gelu_tanh

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's zeroed (key_cache, value_cache) in the layout this table's attention reads."""
        return self.allocate_kv_caches(1, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)[0]

    def allocate_kv_caches(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                           head_dim: int, dtype: torch.dtype, device: torch.device | str
                           ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's zeroed (key_cache, value_cache) in the layout this table's attention reads (on the CPU
        one mapping for all layers: ops/reference.py allocate_kv_caches)."""
        pairs = self.pairs_layout is not None and self.pairs_layout(head_dim, block_size, dtype)
        return allocate_kv_caches(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                                  pairs=pairs)


NATIVE_OPS = Ops(name="native", attention=native.attention, rms_norm=native.rms_norm,
                 add_rms_norm=native.add_rms_norm, rotary_embedding=native.rotary_embedding,
                 silu_and_mul=native.silu_and_mul, argmax=native.argmax, needs_decode_mask=True)
REFERENCE_OPS = Ops(name="reference", attention=reference.attention_reference, rms_norm=native.rms_norm,
                    add_rms_norm=native.add_rms_norm, rotary_embedding=native.rotary_embedding,
                    silu_and_mul=reference.silu_and_mul, argmax=native.argmax)


def select_ops(device: torch.device, dtype: torch.dtype, attention_backend: str = "auto",
               batch_hint: int = 64, int8_activations: bool = False, q4_activations: str | None = None) -> Ops:
    """The op table for a model on ``device`` in ``dtype``. ``batch_hint``: the usual rows of a GEMM.
    ``int8_activations``: int8 weights multiply int8-quantized activations (W8A8) on the CPU for batches of
    2+ rows (faster, less accurate); otherwise int8 products are weight-only. ``q4_activations``: "bf16" gives
    Q4_0 / Q4_1 weights the table product on an AMX-BF16 CPU (cpu.q4_bf16_activations)."""
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {attention_backend!r} is unknown; known: {list(ATTENTION_BACKENDS)}")
    if attention_backend == "reference":
        return REFERENCE_OPS
    on_cpu = device.type == "cpu"
    if attention_backend == "auto":
        attention_backend = "cpu" if on_cpu else "triton"
    if attention_backend == "cpu" and not on_cpu:
        raise ValueError(f"attention backend 'cpu' runs on the CPU only, the model is on {device}; "
                         f"use 'auto', 'triton' or 'native'")
    if attention_backend == "triton" and device.type != "cuda":
        raise ValueError(f"attention backend 'triton' runs on CUDA only, the model is on {device}; "
                         f"use 'auto', 'cpu' or 'native'")
    platform = _cpu_ops(dtype, batch_hint, int8_activations, q4_activations) if on_cpu else _cuda_ops()
    if attention_backend == "native":
        return dataclasses.replace(platform, name="native", attention=native.attention, needs_decode_mask=True,
                                   pairs_layout=None, llama_layer_stack=None, dense_attention=native.dense_attention)
    return platform


def attention_for(ops: Ops, logit_softcap: float | None = None) -> AttentionFn:
    """The attention op for a model whose attention needs ``logit_softcap`` (Gemma 2's soft-capped scores):
    the table's own where it has the feature, else the plain-torch reference (ops/reference.py), which has
    every feature and reads every cache layout. Sliding windows need nothing here: every kernel masks them."""
    if logit_softcap is None:
        return ops.attention
    if ops.name == "cpu":
        from kvloom.ops import cpu

        if ops.attention is cpu.attention:  # csrc/paged_attention.cpp caps the scores itself
            return functools.partial(cpu.attention, logit_softcap=logit_softcap)
    if ops.name == "triton":
        from kvloom.ops import cuda

        if ops.attention is cuda.attention:  # the Triton kernels cap the scores themselves
            return functools.partial(cuda.attention, logit_softcap=logit_softcap)
    if ops.attention is not reference.attention_reference:
        logger.info("Attention logit soft-capping (%s) is not in the %s attention kernel: this model's attention "
                    "runs the plain-torch reference (ops/reference.py), which is slower", logit_softcap, ops.name)
    return functools.partial(reference.attention_reference, logit_softcap=logit_softcap)


def _cpu_ops(dtype: torch.dtype, batch_hint: int, int8_activations: bool = False,
             q4_activations: str | None = None) -> Ops:
    from kvloom.ops import cpu

    fmt = cpu.linear_format(dtype)  # oneDNN's packed GEMM even where our library is not built
    pack = None if fmt is None else (
        lambda weight, bias: cpu.PackedWeight(weight, bias, cpu.weight_format(fmt, weight), batch_hint))
    # Experts packed one by one for the same GEMM as the linears (bf16); else the reference's F.linear.
    pack_experts = reference.ReferenceExperts if pack is None else functools.partial(native.PackedExperts,
                                                                                     pack_linear=pack)
    if not cpu.cpu_kernel_available():
        return dataclasses.replace(NATIVE_OPS, pack_linear=pack, pack_experts=pack_experts)
    # csrc/gemm_q4.cpp: its AVX2 kernel where built, else the same product on plain loops (still faster than
    # torch ops, which dequantize the whole weight every call).
    # On an AMX-BF16 CPU the dequantizing AMX-BF16 products change arithmetic at a row count, so they are taken only
    # where batch-dependent products are allowed (KVLOOM_BATCH_INVARIANT=0). A GGUF's Q4_K / Q6_K super-blocks take
    # csrc/gemm_q4k.cpp (one formula at every row count).
    # q4_activations "bf16" (or KVLOOM_Q4_ACTIVATIONS=bf16): a Q4_0 / Q4_1 weight's table product on AMX-BF16
    # tiles, one formula at every row count (so allowed in batch-invariant mode too).
    tiles = not cpu.batch_invariant()
    pack_q4 = functools.partial(q4k.pack_code_blocks, bf16_tiles=tiles,
                                table_product=cpu.q4_bf16_activations(q4_activations))
    # csrc/gemm_int8.cpp for float32 and bfloat16 activations alike, where its AVX-512 or AVX2 kernels are built.
    pack_int8, pack_int8_blocks = int8.NativeInt8Linear, int8.NativeInt8BlocksLinear
    pack_q8_0 = None
    if cpu.int8_kernels_available():
        pack_int8_blocks = functools.partial(cpu.PackedInt8BlocksWeight, bf16_tiles=tiles)
        pack_q8_0 = functools.partial(cpu.PackedInt8BlocksWeight.from_q8_0, bf16_tiles=tiles)
        # W8A8 (from 1 row; from 2 on AVX-512 where batch-dependent products are allowed) unless int8_activations is
        # off: per-token int8 activations cost SmolLM2 +3.3% perplexity alone, +0.7% with the default smoothing
        # (layers/smoothing.py; benchmarks/int8_quality.py).
        rows = cpu.w8a8_min_rows() if int8_activations else sys.maxsize
        pack_int8 = functools.partial(cpu.PackedInt8Weight, w8a8_min_rows=rows, bf16_tiles=tiles)
    return Ops(name="cpu", attention=cpu.attention, rms_norm=cpu.rms_norm, add_rms_norm=cpu.add_rms_norm,
               rotary_embedding=cpu.rotary_embedding, silu_and_mul=cpu.silu_and_mul, argmax=cpu.argmax,
               pack_linear=pack, pack_linear_int8=pack_int8, pack_linear_int8_blocks=pack_int8_blocks,
               pack_linear_q8_0=pack_q8_0, pack_linear_q4=pack_q4, pairs_layout=cpu.pairs_layout,
               llama_layer_stack=cpu.llama_layer_stack,
               pack_experts=pack_experts, dense_attention=cpu.dense_attention, gelu_tanh=cpu.gelu_tanh)


def _cuda_ops() -> Ops:
    try:
        from kvloom.ops import cuda
        from kvloom.ops.triton import moe as triton_moe
    except ImportError as e:  # no Triton in this environment
        logger.warning("The Triton kernels are not available, so CUDA runs torch's native ops (%s)", e)
        return NATIVE_OPS
    return Ops(name="triton", attention=cuda.attention, rms_norm=cuda.rms_norm, add_rms_norm=cuda.add_rms_norm,
               rotary_embedding=cuda.rotary_embedding, silu_and_mul=cuda.silu_and_mul, argmax=native.argmax,
               pack_linear_int8=cuda.Int8Linear, pack_linear_int8_blocks=_blocks_as_rows(cuda.Int8Linear),
               pack_linear_q4=cuda.Q4Linear,
               pack_experts=triton_moe.TritonExperts)


def _blocks_as_rows(pack_rows: PackInt8Fn) -> PackInt8Fn:
    """A platform without a block-scaled kernel: the blocks re-quantized per row (from their exact values)."""
    def pack(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> Callable:
        rows = int8.Int8Blocks(qweight, scale).to_rows()
        return pack_rows(rows.qweight, rows.scale, bias)

    return pack

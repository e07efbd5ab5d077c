"""Phi-3 / Phi-3.5-mini: Llama's architecture with fused checkpoint tensors and LongRoPE (no device code here).

The checkpoint stores q, k and v as one ``qkv_proj`` and gate and up as one ``gate_up_proj``: they are split
by rows as they are read into Llama's names, so float, int8-quantized-as-read and GGUF weights all load
through the one loader. LongRoPE (``rope_scaling`` type ``longrope``: short and long factors, and the
attention factor on cos and sin) is the rotary table's (layers/rotary.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvloom.models.llama import LlamaForCausalLM
from kvloom.ops.int8 import Int8Blocks, Int8Rows, Q8_0Blocks
from kvloom.ops.q4 import Q4Blocks
from kvloom.ops.q4k import SUPER_BLOCK_TYPES, Q4KBlocks, Q6KBlocks

Weight = torch.Tensor | Int8Rows | Int8Blocks | Q8_0Blocks | Q4Blocks | Q4KBlocks | Q6KBlocks


def split_rows(tensor: Weight, sizes: list[int]) -> list[Weight]:
    """A weight's row blocks of ``sizes``; int8 rows or blocks, and 4-bit blocks (a GGUF's fused attn_qkv /
    ffn_up kept 4-bit), keep each row's scales (and offsets) with it (exact)."""
    if tuple(tensor.shape)[0] != sum(sizes):
        raise ValueError(f"a fused tensor has {tuple(tensor.shape)[0]} rows, expected {sum(sizes)} ({sizes})")
    if isinstance(tensor, torch.Tensor):
        return list(tensor.split(sizes))
    if isinstance(tensor, (Q4Blocks, Q8_0Blocks, *SUPER_BLOCK_TYPES)):
        return [type(tensor)(*parts) for parts in zip(*(t.split(sizes) for t in tensor))]
    return [type(tensor)(q, s) for q, s in zip(tensor.qweight.split(sizes), tensor.scale.split(sizes))]


class Phi3ForCausalLM(LlamaForCausalLM):
    # csrc/decoder.cpp's layer stack is Llama's alone: the layers run module by module.
    uses_layer_stack = False

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        super().load_weights(self.llama_names(weights))

    def llama_names(self, weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        """The checkpoint's tensors with each fused one split into Llama's names (others, and tensors already
        split, as they come)."""
        config = self.config
        q_size = config.num_attention_heads * config.head_dim
        kv_size = config.num_key_value_heads * config.head_dim
        fused = {
            "self_attn.qkv_proj": (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                                   [q_size, kv_size, kv_size]),
            "mlp.gate_up_proj": (["mlp.gate_proj", "mlp.up_proj"], [config.intermediate_size] * 2),
        }
        for name, tensor in weights:
            prefix, _, kind = name.rpartition(".")
            for fused_part, (parts, sizes) in fused.items():
                if prefix.endswith(f".{fused_part}"):
                    base = prefix.removesuffix(fused_part)
                    for part, piece in zip(parts, split_rows(tensor, sizes)):
                        yield f"{base}{part}.{kind}", piece
                    break
            else:
                yield name, tensor

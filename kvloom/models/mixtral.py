"""Mixtral: Llama's attention with a sparse mixture of experts in place of the MLP (no device code here).

Each layer's router picks 2 of 8 experts per token (softmax over all experts, the top 2 renormalized:
a softmax over the chosen); the experts run as one fused computation (layers/moe.py). The checkpoint's
``block_sparse_moe`` is this model's ``mlp``; its experts' w1 / w3 / w2 are gate / up / down.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kvloom.layers.moe import SparseMoeBlock, load_experts_as_read
from kvloom.layers.rotary import RotaryEmbedding
from kvloom.loader.model_config import ModelConfig
from kvloom.models.llama import LlamaDecoderLayer, LlamaForCausalLM, load_hf_weights
from kvloom.ops.table import Ops


class MixtralForCausalLM(LlamaForCausalLM):
    # csrc/decoder.cpp's layer stack is Llama's alone: the layers run module by module.
    uses_layer_stack = False
    # int8 experts (layers/moe.py); SmoothQuant folds into a dense MLP's norm, which a sparse layer lacks.
    smoothable = False

    def make_layer(self, config: ModelConfig, ops: Ops, rotary: RotaryEmbedding, index: int) -> nn.Module:
        experts = SparseMoeBlock(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                           config.intermediate_size, renormalize=True, ops=ops)
        return LlamaDecoderLayer(config, ops, rotary, index, mlp=experts)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                yield name.replace(".block_sparse_moe.", ".mlp."), tensor

        load_hf_weights(self, load_experts_as_read(self, renamed()), self.FUSED)

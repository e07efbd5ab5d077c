"""Qwen2-MoE and Qwen3-MoE: Qwen2's / Qwen3's attention with sparse mixtures of experts (no device code here).

A layer is sparse unless it is listed in ``mlp_only_layers`` or falls between ``decoder_sparse_step``s (then
it has a dense MLP of ``intermediate_size``). The router takes the top k of E experts by softmax, their
weights renormalized only with ``norm_topk_prob``; the experts (``moe_intermediate_size`` each) run as one
fused computation (layers/moe.py). Qwen2-MoE adds a shared expert every token passes through, scaled by
sigmoid(shared_expert_gate(x)); Qwen3-MoE has none, and normalizes q and k per head (``qk_norm``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvloom.layers.linear import Linear
from kvloom.layers.moe import SparseMoeBlock, load_experts_as_read
from kvloom.layers.rotary import RotaryEmbedding
from kvloom.loader.model_config import ModelConfig
from kvloom.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, load_hf_weights
from kvloom.ops.table import Ops


class Qwen2MoeSparseBlock(SparseMoeBlock):
    """Routed experts plus, where the config has one, the gated shared expert: hidden [T, H] -> [T, H]."""

    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                         config.moe_intermediate_size, config.norm_topk_prob, ops)
        self.shared_expert: nn.Module | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(config, ops, config.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(config.hidden_size, [1])
            self.shared_expert_gate.keep_float = True  # one row: int8 leaves it float, as it does the router

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = super().forward(hidden)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return out


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    FUSED = {**LlamaForCausalLM.FUSED,
             "shared_expert.gate_proj": ("shared_expert.gate_up_proj", 0),
             "shared_expert.up_proj": ("shared_expert.gate_up_proj", 1)}
    # csrc/decoder.cpp's layer stack is Llama's alone: the layers run module by module.
    uses_layer_stack = False
    # int8 experts (layers/moe.py); SmoothQuant folds into a dense MLP's norm, which a sparse layer lacks.
    smoothable = False

    def make_layer(self, config: ModelConfig, ops: Ops, rotary: RotaryEmbedding, index: int) -> nn.Module:
        sparse = (index not in config.mlp_only_layers and config.num_experts > 0
                  and (index + 1) % config.decoder_sparse_step == 0)
        return LlamaDecoderLayer(config, ops, rotary, index, mlp=Qwen2MoeSparseBlock(config, ops) if sparse else None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_hf_weights(self, load_experts_as_read(self, weights), self.FUSED)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-MoE: no shared expert (its config has none), q/k norms (ModelConfig.qk_norm)."""

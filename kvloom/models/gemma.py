"""Gemma 2 and Gemma 3 (text): the architecture, top to bottom (no device code here).

What sets Gemma apart from Llama, each in one place below:
- embeddings multiplied by sqrt(hidden), rounded to the model's dtype first, as transformers does;
- RMSNorm scaling by (1 + w): the checkpoint's w is stored as 1 + w when it is loaded, so the op table's
  RMSNorm runs unchanged (exact in fp32; in bf16, 1 + w is rounded to bf16 where transformers keeps fp32);
- four norms per layer (before and after attention, before and after the MLP);
- GeGLU (gelu with the tanh approximation) in place of SwiGLU;
- attention scaled by query_pre_attn_scalar ** -0.5;
- Gemma 2: attention scores soft-capped (cap * tanh(s / cap)), which the fast kernels lack, so its attention
  is the plain-torch reference (ops/table.py attention_for says so in the log), and final logits soft-capped;
- Gemma 3: a per-head (1 + w) RMSNorm of q and k before rotary instead of the attention soft-cap, and the
  sliding layers' rotary base (1e4) apart from the global layers' (1e6, maybe with linear scaling);
- sliding-window layers among global ones (``ModelConfig.layer_sliding_windows``: Gemma 2 alternates,
  Gemma 3 has five local per global): each layer narrows the step's metadata to its window.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvloom.layers.activation import GeluTanhAndMul
from kvloom.layers.embedding import LMHead, VocabEmbedding
from kvloom.layers.linear import Linear
from kvloom.layers.norm import RMSNorm, add_to_stream
from kvloom.layers.rotary import RotaryEmbedding
from kvloom.loader.model_config import ModelConfig
from kvloom.models.llama import LlamaAttention, LlamaForCausalLM, load_hf_weights
from kvloom.ops.metadata import AttentionMetadata
from kvloom.ops.table import AttentionFn, Ops, attention_for


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, [size, size])
        self.down_proj = Linear(size, [config.hidden_size])
        self.act = GeluTanhAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(hidden)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, rotary: RotaryEmbedding, layer_index: int,
                 attention: AttentionFn) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, ops, rotary, layer_index, scale=config.query_pre_attn_scalar ** -0.5,
                                        attention=attention)
        self.mlp = GemmaMLP(config)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, ops)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, ops)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream is hidden + residual (hidden alone for the first layer), as in Llama's layers; returns
        (the MLP branch's output, the stream before it)."""
        hidden, residual = add_to_stream(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata)
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2ForCausalLM(nn.Module):
    FUSED = LlamaForCausalLM.FUSED
    # SmoothQuant folds into Llama's norms (post_attention_layernorm feeding the MLP); Gemma's MLP reads
    # pre_feedforward_layernorm, and its norms hold 1 + w: int8 weights here are not smoothed.
    smoothable = False

    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        if config.query_pre_attn_scalar is None:
            raise ValueError(f"{config.architecture} needs query_pre_attn_scalar in its config")
        self.config = config
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                 config.rope_scaling, ops)
        # Gemma 3's sliding layers rotate with their own base (one table shared by them all).
        local_rotary = rotary if config.local_rope_theta is None else RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.local_rope_theta, config.local_rope_scaling, ops)
        windows = config.layer_sliding_windows or [config.sliding_window] * config.num_hidden_layers
        attention = attention_for(ops, config.attn_logit_softcapping)  # one choice (and log line) per model
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, ops, local_rotary if windows[index] is not None else rotary, index, attention)
            for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.aux_hidden_state_layers: tuple[int, ...] = ()  # EAGLE-3 drafts for Llama targets only

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, H]."""
        if self.aux_hidden_state_layers:
            raise ValueError(f"EAGLE-3 speculative decoding does not support {self.config.architecture} targets")
        hidden = self.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the model's dtype before the product, as transformers rounds it.
        hidden = hidden * torch.tensor(self.config.hidden_size ** 0.5, dtype=hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, V] in the model's dtype, soft-capped where the config says so."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors into the parameters; every norm's w is stored as 1 + w (computed in fp32)."""
        def norms_plus_one() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                yield name, (tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)

        load_hf_weights(self, norms_plus_one(), self.FUSED)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model: Gemma 2's layers with q/k norms (``ModelConfig.qk_norm``, picked up by
    LlamaAttention, their w stored as 1 + w like every norm here) and per-kind rotary bases."""

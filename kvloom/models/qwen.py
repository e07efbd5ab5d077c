"""Qwen2 / Qwen2.5 and Qwen3: Llama's architecture with a flag each (no device code here).

Qwen2: a bias on the q, k and v projections but not on o (``ModelConfig.qkv_bias``); large vocabularies,
rope_theta 1e6, tied or untied heads. Qwen3: no bias, a per-head RMSNorm of q and of k before rotary
(``q_norm`` / ``k_norm``, ``ModelConfig.qk_norm``) and an explicit ``head_dim``. Both may slide a window
over the layers from ``max_window_layers`` on (``use_sliding_window``; off in every released checkpoint).
"""

from __future__ import annotations

from kvloom.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    # csrc/decoder.cpp's layer stack is Llama's alone: the layers run module by module.
    uses_layer_stack = False


class Qwen3ForCausalLM(LlamaForCausalLM):
    uses_layer_stack = False

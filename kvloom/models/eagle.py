"""EAGLE draft heads, EAGLE-1 and EAGLE-3, in the checkpoint layouts vLLM loads (llama_eagle.py,
llama_eagle3.py): a config.json with the head's own Llama config, and safetensors named as below.

EAGLE-1 (one or more Llama layers over [embedding(x_{p+1}) | target hidden h_p]):

    fc.weight [H, 2H] (fc.bias)         layers.N.self_attn.{q,k,v,o}_proj.weight, layers.N.mlp.*,
    layers.N.post_attention_layernorm   layers.N.input_layernorm for N > 0 (layer 0 has none)
    embed_tokens.weight (optional: else the target's)    lm_head.weight (optional: else the target's)
    add_para_norm (HASS): embedding_layernorm.weight, hidden_states_layernorm.weight

    e = embed(x_{p+1}); h = fc([e | h_p]); h = layers(h); out = h + residual   (no final norm; the LM head
    reads it directly, and it is also the hidden state fed back for the next guess)

EAGLE-3 (the target's residual stream at three layers, fused by fc; ``midlayer.`` = ``layers.0.``):

    fc.weight [H, 3 * H_target]         midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}
    midlayer.self_attn.q/k/v_proj.weight [*, 2H] (their input is [norm(embedding) | hidden_norm(h)])
    norm.weight    lm_head.weight [draft_vocab, H] (else the target's)    d2t [draft_vocab]: a draft id d
    is target id d + d2t[d]    (t2d is not needed)    embed_tokens.weight (optional)

    config: draft_vocab_size, target_hidden_size, eagle_config.eagle_aux_hidden_state_layer_ids (or
    eagle_aux_hidden_state_layer_ids; default: 2, L/2, L-3 of the target's L layers), norm_before_residual

Tensors may carry a ``model.`` prefix. Every tensor's shape is checked against the head's config and the
target's hidden size and vocabulary; a mismatch is a ValueError naming the tensor.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvloom.layers.embedding import LMHead, VocabEmbedding
from kvloom.layers.linear import Linear
from kvloom.layers.norm import RMSNorm
from kvloom.layers.rotary import RotaryEmbedding
from kvloom.loader.model_config import ModelConfig
from kvloom.loader.safetensors import iter_safetensors_weights, read_config_json
from kvloom.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, build_layer_stack
from kvloom.ops.metadata import AttentionMetadata
from kvloom.ops.table import Ops

# HF tensor name part -> (our parameter part, row block of the fused weight), as Llama's.
_FUSED = LlamaForCausalLM.FUSED


@dataclass(frozen=True)
class EagleConfig:
    """An EAGLE checkpoint's facts: its own Llama config and what it needs of the target."""

    method: str  # "eagle" | "eagle3"
    model: ModelConfig  # the head's layers
    target_hidden_size: int
    draft_vocab_size: int
    aux_hidden_state_layers: tuple[int, ...]  # EAGLE-3: the target layers whose input it reads; () for EAGLE-1
    norm_before_residual: bool = False  # EAGLE-3
    add_para_norm: bool = False  # EAGLE-1, HASS


def read_eagle_config(path: str, method: str, target: ModelConfig) -> EagleConfig:
    """The head's config.json, checked against the target: the same vocabulary, aux layers that exist."""
    raw = read_config_json(path)
    source = os.path.join(path, "config.json")
    # The head's layers are Llama layers whatever its architecture name says (EagleLlamaForCausalLM, ...).
    model = ModelConfig.from_hf_dict(dict(raw, architectures=["LlamaForCausalLM"]), source)
    if model.vocab_size != target.vocab_size:
        raise ValueError(f"{source}: the EAGLE head's vocab_size is {model.vocab_size}, the target model's "
                         f"{target.vocab_size}; the head must be trained for the target (the same vocabulary)")
    eagle_config: dict[str, Any] = raw.get("eagle_config") or {}
    target_hidden = raw.get("target_hidden_size") or target.hidden_size
    if target_hidden != target.hidden_size:
        raise ValueError(f"{source}: target_hidden_size is {target_hidden}, but the target model's hidden size "
                         f"is {target.hidden_size}")
    draft_vocab = int(raw.get("draft_vocab_size") or model.vocab_size)
    aux: tuple[int, ...] = ()
    if method == "eagle3" and eagle_config.get("use_aux_hidden_state", True):
        layers = (eagle_config.get("eagle_aux_hidden_state_layer_ids") or raw.get("eagle_aux_hidden_state_layer_ids")
                  or [2, target.num_hidden_layers // 2, target.num_hidden_layers - 3])
        aux = tuple(int(layer) for layer in layers)
        if len(aux) != 3 or not all(0 <= layer < target.num_hidden_layers for layer in aux):
            raise ValueError(f"{source}: eagle_aux_hidden_state_layer_ids must name 3 of the target's layers "
                             f"(0..{target.num_hidden_layers - 1}), got {list(aux)}")
    return EagleConfig(method, model, target.hidden_size, draft_vocab, aux,
                       norm_before_residual=bool(raw.get("norm_before_residual", False)),
                       add_para_norm=bool(raw.get("add_para_norm", False)))


class Eagle3DecoderLayer(nn.Module):
    """Layer 0 of an EAGLE-3 head attends over [norm(embedding) | hidden_norm(h)] (2H wide); later layers
    are plain Llama layers."""

    def __init__(self, config: ModelConfig, ops: Ops, rotary: RotaryEmbedding, first: bool,
                 norm_before_residual: bool) -> None:
        super().__init__()
        self.first = first
        self.norm_before_residual = norm_before_residual
        self.self_attn = LlamaAttention(config, ops, rotary)
        if first:
            attention = self.self_attn
            self.self_attn.qkv_proj = Linear(2 * config.hidden_size,
                                             [attention.q_size, attention.kv_size, attention.kv_size],
                                             bias=config.attention_bias)
            self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = LlamaMLP(config, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: tuple[torch.Tensor, torch.Tensor],
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if self.first:
            embeds = self.input_layernorm(embeds)
            if self.norm_before_residual:
                hidden = self.hidden_norm(hidden)
                residual = hidden
            else:
                residual = hidden
                hidden = self.hidden_norm(hidden)
            hidden = torch.cat([embeds, hidden], dim=-1)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class EagleHead(nn.Module):
    """An EAGLE-1 or EAGLE-3 head. ``embed_tokens`` and ``lm_head`` are the checkpoint's or the target's."""

    def __init__(self, config: EagleConfig, ops: Ops, names: set[str]) -> None:
        super().__init__()
        self.config = config
        mc = config.model
        hidden = mc.hidden_size
        self.eagle3 = config.method == "eagle3"
        self.embed_tokens: nn.Module = VocabEmbedding(mc.vocab_size, hidden)
        rotary = RotaryEmbedding(mc.head_dim, mc.max_position_embeddings, mc.rope_theta, mc.rope_scaling, ops)
        if self.eagle3:
            self.fc = (Linear(3 * config.target_hidden_size, [hidden]) if config.aux_hidden_state_layers else None)
            self.layers = nn.ModuleList(Eagle3DecoderLayer(mc, ops, rotary, i == 0, config.norm_before_residual)
                                        for i in range(mc.num_hidden_layers))
            self.norm = RMSNorm(hidden, mc.rms_norm_eps, ops)
        else:
            self.fc = Linear(2 * config.target_hidden_size, [hidden], bias="fc.bias" in names)
            self.layers = nn.ModuleList(LlamaDecoderLayer(mc, ops, rotary) for _ in range(mc.num_hidden_layers))
            self.layers[0].input_layernorm = nn.Identity()  # EAGLE-1 feeds layer 0 un-normed
            if config.add_para_norm:
                self.embedding_layernorm = RMSNorm(hidden, mc.rms_norm_eps, ops)
                self.hidden_states_layernorm = RMSNorm(hidden, mc.rms_norm_eps, ops)
        self.lm_head: nn.Module = LMHead(config.draft_vocab_size, hidden)
        self.ops = ops
        # EAGLE-1's decoder layers in one native call where the op table has one (prepare_layer_stack).
        self.layer_stack: Callable | None = None
        if config.draft_vocab_size != mc.vocab_size:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        else:
            self.d2t = None

    def quantize(self, target: nn.Module) -> None:
        """int8 per row (``speculative_config`` quantization "int8"), before the weights are packed: the head's
        projections, and its LM head when it has its own (one it shares with the target stays the target's)."""
        for module in self.modules():
            if isinstance(module, Linear) and not module.quantized:
                module.quantize()
        if self.lm_head is not target.lm_head and self.lm_head.qweight is None:
            self.lm_head.quantize()

    def prepare_layer_stack(self) -> None:
        """After the weights are packed (registry.process_weights_after_loading): EAGLE-1's layers, the first
        without an input norm, as the op table's layer stack. A guess at batch 1 is a few dozen kernel calls:
        the stack runs them with no trip through Python in between."""
        if not self.eagle3:
            self.layer_stack = build_layer_stack(self.ops, self.layers, self.config.model, first_norm_optional=True)

    def combine_hidden_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states as the head's first input: EAGLE-3's aux states [T, 3 H_t] -> [T, H]."""
        return self.fc(hidden) if self.eagle3 and self.fc is not None else hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions: [T]; hidden: [T, H] (the target's at the previous position, or the head's own
        from its previous guess) -> (hidden states for the LM head [T, H], hidden states to feed back [T, H])."""
        embeds = self.embed_tokens(input_ids)
        residual = None
        if self.eagle3:
            for layer, kv_cache in zip(self.layers, kv_caches):
                hidden, residual = layer(positions, embeds, hidden, residual, kv_cache, metadata)
            return self.norm(hidden, residual)
        if self.config.add_para_norm:
            embeds = self.embedding_layernorm(embeds)
            hidden = self.hidden_states_layernorm(hidden)
        hidden = self.fc(torch.cat([embeds, hidden], dim=-1))
        if self.layer_stack is not None and self.layer_stack.takes(hidden.shape[0]):
            hidden, residual = self.layer_stack(hidden, positions, kv_caches, metadata)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                hidden, residual = layer(positions, hidden, residual, kv_cache, metadata)
        hidden = hidden + residual
        return hidden, hidden

    def next_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy guesses [N] in the target's vocabulary from hidden states [N, H]."""
        draft_ids = self.lm_head(hidden).argmax(dim=-1)
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], target: nn.Module) -> None:
        """Copy the checkpoint's tensors in, checking each shape; take the target's embedding and LM head where
        the checkpoint has none (their width must then be the head's)."""
        params: dict[str, torch.Tensor] = dict(self.named_parameters())
        if self.d2t is not None:
            params["d2t"] = self.d2t
        loaded: set[str] = set()
        for stored_name, tensor in weights:
            name = _our_name(stored_name)
            if name == "t2d" or "rotary_emb.inv_freq" in name:
                continue
            if not self.eagle3 and name == "layers.0.input_layernorm.weight":
                continue  # EAGLE-1's first layer has no input norm (vLLM drops it too)
            if name == "d2t" and self.d2t is None:
                # A draft vocabulary as large as the target's: d2t maps each id to itself, nothing to keep.
                if tensor.any():
                    raise ValueError(f"EAGLE checkpoint tensor {stored_name!r}: with a draft vocabulary as large as "
                                     f"the target's ({self.config.model.vocab_size}), d2t must be all zeros")
                continue
            for hf_part, (our_part, shard) in _FUSED.items():
                if f".{hf_part}." in f".{name}":
                    module_name, _, kind = name.replace(hf_part, our_part).rpartition(".")
                    module = self.get_submodule(module_name) if _has_module(self, module_name) else None
                    if not isinstance(module, Linear):
                        raise ValueError(f"EAGLE checkpoint tensor {stored_name!r} has no place in the head")
                    expected = (module.output_sizes[shard], module.in_features)[:tensor.dim()]
                    if tuple(tensor.shape) != expected:
                        raise ValueError(f"EAGLE checkpoint tensor {stored_name!r} has shape {tuple(tensor.shape)}, "
                                         f"expected {expected} (head config and target hidden size "
                                         f"{self.config.target_hidden_size})")
                    module.load_shard(kind, shard, tensor)
                    loaded.add(f"{module_name}.{kind}#{shard}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"EAGLE checkpoint tensor {stored_name!r} has no place in an "
                                     f"{self.config.method} head; expected names: {sorted(params)[:8]} ...")
                param = params[name]
                if tuple(param.shape) != tuple(tensor.shape):
                    config = self.config
                    raise ValueError(f"EAGLE checkpoint tensor {stored_name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(param.shape)} (head hidden size {config.model.hidden_size}, "
                                     f"target hidden size {config.target_hidden_size}, vocabulary "
                                     f"{config.model.vocab_size}, draft vocabulary {config.draft_vocab_size})")
                param.data.copy_(tensor)
                loaded.add(name)
        hidden = self.config.model.hidden_size
        for name, shared in (("embed_tokens", target.embed_tokens), ("lm_head", target.lm_head)):
            if f"{name}.weight" in loaded:
                continue
            if name == "lm_head" and self.config.draft_vocab_size != self.config.model.vocab_size:
                raise ValueError(f"the EAGLE checkpoint has no lm_head.weight, but its draft vocabulary "
                                 f"({self.config.draft_vocab_size}) is not the target's: it needs its own LM head")
            if shared.weight.shape[1] != hidden:
                raise ValueError(f"the EAGLE checkpoint has no {name}.weight and the target's is "
                                 f"{shared.weight.shape[1]} wide, the head {hidden}: it needs its own {name}")
            setattr(self, name, shared)  # the target's module, shared
            loaded.add(f"{name}.weight")
        missing = []
        for module_name, module in self.named_modules():
            if isinstance(module, Linear) and len(module.output_sizes) > 1:
                missing += [f"{module_name}.weight[{shard}]" for shard in range(len(module.output_sizes))
                            if f"{module_name}.weight#{shard}" not in loaded]
        for name in params:
            fused = any(our in name for our, _ in _FUSED.values())
            if not fused and name not in loaded and not name.endswith(".bias") and not name.startswith(
                    ("embed_tokens.", "lm_head.")):
                missing.append(name)
        if missing:
            raise ValueError(f"the EAGLE checkpoint is missing {len(missing)} tensor(s) of an {self.config.method} "
                             f"head, e.g. {missing[:4]}")


def load_eagle_head(path: str, method: str, target_config: ModelConfig, target: nn.Module, ops: Ops
                    ) -> EagleHead:
    """Build and load the head at ``path`` (parameters in torch's default dtype and device)."""
    if not os.path.isdir(path):
        raise ValueError(f"speculative_config: the EAGLE head {path!r} is not a directory with config.json and "
                         f"*.safetensors")
    config = read_eagle_config(path, method, target_config)
    weights = list(iter_safetensors_weights(path))
    head = EagleHead(config, ops, {_our_name(name) for name, _ in weights})
    head.load_weights(weights, target)
    return head.eval()


def _our_name(name: str) -> str:
    name = name.removeprefix("model.")
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def _has_module(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True

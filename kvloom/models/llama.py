"""Llama (and Mistral, which differs only in its sliding window): the architecture, top to bottom.

Tokens arrive flat: [T] ids for every scheduled request end to end, with their positions and the
attention metadata that says which request each token belongs to. No device code lives here.

The families that differ from Llama only by a flag reuse these parts (models/qwen.py, phi3.py, mixtral.py,
qwen_moe.py): a bias on q/k/v alone (``qkv_bias``), a per-head RMSNorm of q and k before rotary
(``qk_norm``), a window per layer (``layer_sliding_windows``), a mixture of experts in place of the MLP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from kvloom.layers.activation import SiluAndMul
from kvloom.layers.embedding import LMHead, VocabEmbedding
from kvloom.layers.linear import Linear
from kvloom.layers.norm import RMSNorm, add_to_stream
from kvloom.layers.rotary import RotaryEmbedding
from kvloom.loader.model_config import ModelConfig
from kvloom.ops.int8 import Int8Blocks, Int8Rows, Q8_0Blocks
from kvloom.ops.layer_stack import LayerShape, LayerWeights
from kvloom.ops.metadata import AttentionMetadata, with_sliding_window
from kvloom.ops.q4 import Q4Blocks
from kvloom.ops.q4k import SUPER_BLOCK_TYPES
from kvloom.ops.table import AttentionFn, Ops

# A norm over one head's D values of [N, D] rows: RMSNorm (Qwen3), or Gemma's (1 + w) RMSNorm.
HeadNorm = Callable[[int, float, Ops], nn.Module]


class LlamaAttention(nn.Module):
    """``layer_index`` picks the layer's window where the config's layers differ (``layer_sliding_windows``);
    ``head_norm`` (where ``config.qk_norm``) builds q_norm and k_norm; ``scale`` and ``attention`` replace
    head_dim ** -0.5 and the op table's attention (Gemma's)."""

    def __init__(self, config: ModelConfig, ops: Ops, rotary: RotaryEmbedding, layer_index: int = 0, *,
                 head_norm: HeadNorm = RMSNorm, scale: float | None = None,
                 attention: AttentionFn | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5 if scale is None else scale
        qkv_bias = config.attention_bias if config.qkv_bias is None else config.qkv_bias
        self.qkv_proj = Linear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=qkv_bias)
        self.o_proj = Linear(self.q_size, [config.hidden_size], bias=config.attention_bias)
        self.q_norm = head_norm(self.head_dim, config.rms_norm_eps, ops) if config.qk_norm else None
        self.k_norm = head_norm(self.head_dim, config.rms_norm_eps, ops) if config.qk_norm else None
        self.rotary = rotary  # one table of cos/sin for every layer (of a kind)
        self.attention = ops.attention if attention is None else attention
        # Without windows per layer the step's metadata is used as the runner built it (one window, or none, for
        # every layer). Plain values, not a sentinel object: the module is pickled into the packed-model cache
        # (worker/packed_cache.py), where an object() would come back as another object.
        windows = config.layer_sliding_windows
        self.own_window = windows is not None
        self.sliding_window = windows[layer_index] if windows is not None else None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # Queries and keys rotate together: one rotary call for both.
            qk = self.rotary(positions, qkv[:, :self.num_heads + self.num_kv_heads])
        else:
            # Each head's q and k normalized over its D values ([T * heads, D] rows), then rotated together.
            # (With one kv head, k's rows are a strided view of qkv: the norm kernels want them contiguous.)
            tokens = qkv.shape[0]
            q = self.q_norm(qkv[:, :self.num_heads].reshape(-1, self.head_dim).contiguous())
            k = self.k_norm(qkv[:, self.num_heads:self.num_heads + self.num_kv_heads].reshape(-1, self.head_dim)
                            .contiguous())
            qk = self.rotary(positions, torch.cat((q.view(tokens, self.num_heads, self.head_dim),
                                                   k.view(tokens, self.num_kv_heads, self.head_dim)), dim=1))
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.num_heads + self.num_kv_heads:]
        if self.own_window:
            metadata = with_sliding_window(metadata, self.sliding_window)
        out = self.attention(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, intermediate_size: int | None = None) -> None:
        super().__init__()
        size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, [size, size], bias=config.mlp_bias)
        self.down_proj = Linear(size, [config.hidden_size], bias=config.mlp_bias)
        self.act = SiluAndMul(ops)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(hidden)))


class LlamaDecoderLayer(nn.Module):
    """``mlp``: a mixture of experts (or anything [T, H] -> [T, H]) in place of the dense MLP."""

    def __init__(self, config: ModelConfig, ops: Ops, rotary: RotaryEmbedding, layer_index: int = 0,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, ops, rotary, layer_index)
        self.mlp = LlamaMLP(config, ops) if mlp is None else mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = add_to_stream(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def build_layer_stack(ops: Ops, layers: Iterable[nn.Module], config: ModelConfig,
                      first_norm_optional: bool = False) -> Callable | None:
    """The op table's layer stack of these decoder layers (their weights packed), or None when it has none or
    something sits between a layer's modules (tensor parallelism's all-reduce hooks, for one).
    ``first_norm_optional``: the first layer may have no input norm (an ``nn.Identity``, EAGLE-1's)."""
    if ops.llama_layer_stack is None:
        return None
    layers = list(layers)
    weights = []
    for index, layer in enumerate(layers):
        if type(layer) is not LlamaDecoderLayer:
            return None
        attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
        modules = (layer, attn, mlp, norm, layer.post_attention_layernorm, attn.qkv_proj, attn.o_proj,
                   mlp.gate_up_proj, mlp.down_proj, mlp.act)
        unnormed = first_norm_optional and index == 0 and type(norm) is nn.Identity
        if (attn.attention is not ops.attention or not (isinstance(norm, RMSNorm) or unnormed)
                or any(m._forward_hooks or m._forward_pre_hooks for m in modules)):
            return None
        # Which products the stack can call (not an unpacked F.linear) is the op table's to say.
        input_norm = norm.weight.data if not unnormed else layer.post_attention_layernorm.weight.data.new_empty(0)
        weights.append(LayerWeights(input_norm, attn.qkv_proj.packed, attn.o_proj.packed,
                                    layer.post_attention_layernorm.weight.data, mlp.gate_up_proj.packed,
                                    mlp.down_proj.packed))
    attn = layers[0].self_attn
    shape = LayerShape(attn.num_heads, attn.num_kv_heads, attn.head_dim, config.intermediate_size,
                       layers[0].post_attention_layernorm.eps, attn.scale)
    return ops.llama_layer_stack(weights, shape, config.hidden_size, attn.rotary.cos_cache, attn.rotary.sin_cache)


def load_hf_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    fused: dict[str, tuple[str, int]]) -> None:
    """Copy HF-named tensors into ``model``'s (fused) parameters; every parameter must be covered.
    ``fused``: HF tensor name suffix -> (the model's parameter suffix, row block of the fused weight)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        name = hf_name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        shard_target = None
        for hf_part, (our_part, shard) in fused.items():
            if f".{hf_part}." in f".{name}":
                shard_target = (name.replace(hf_part, our_part), shard)
                break
        if shard_target is not None:
            target_name, shard = shard_target
            module_name, _, kind = target_name.rpartition(".")
            module = model.get_submodule(module_name)
            module.load_shard(kind, shard, tensor)
            loaded.add(f"{target_name}#{shard}")
            continue
        # as read
        if isinstance(tensor, (Int8Rows, Int8Blocks, Q8_0Blocks, Q4Blocks, *SUPER_BLOCK_TYPES)) and name in params:
            model.get_submodule(name.rpartition(".")[0]).load_shard("weight", 0, tensor)
            loaded.add(name)
            continue
        if name not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {model.config.architecture}")
        param = params[name]
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        param.data.copy_(tensor)
        loaded.add(name)
    missing = []
    checked_by_module: set[str] = set()  # parameters of modules that say themselves what they lack (experts)
    for name, module in model.named_modules():
        if hasattr(module, "missing"):
            missing += [f"{name}.{entry}" for entry in module.missing()]
            checked_by_module.update(f"{name}.{param}" for param, _ in module.named_parameters(recurse=False))
        if isinstance(module, Linear) and len(module.output_sizes) > 1:
            for shard in range(len(module.output_sizes)):
                if f"{name}.weight#{shard}" not in loaded:
                    missing.append(f"{name}.weight[{shard}]")
    for name in params:
        is_fused = any(our in name for our, _ in fused.values())
        if not is_fused and name not in loaded and name not in checked_by_module and not (
                name == "lm_head.weight" and model.config.tie_word_embeddings):
            if name.endswith(".bias"):
                continue
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:4]}")


class LlamaForCausalLM(nn.Module):
    # HF tensor name suffix -> (our parameter suffix, row block of the fused weight)
    FUSED = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", 1),
        "self_attn.v_proj": ("self_attn.qkv_proj", 2),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", 1),
    }

    # Whether the op table's one-call layer stack (csrc/decoder.cpp, Llama's layers only) may run these layers.
    uses_layer_stack = True

    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # The rotary table ([max_position, head_dim / 2] of cos and of sin, 33 MB each at 131,072
        # positions) is built once and shared by every layer's attention.
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                 config.rope_scaling, ops)
        self.layers = nn.ModuleList(self.make_layer(config, ops, rotary, index)
                                    for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # EAGLE-3 drafts from the residual stream entering these layers (0: the embeddings); set by the runner.
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.ops = ops
        # Every decoder layer in one native call where the op table has one and the layers qualify
        # (prepare_layer_stack, once the weights are final); None: the layers run module by module.
        self.layer_stack: Callable | None = None

    def make_layer(self, config: ModelConfig, ops: Ops, rotary: RotaryEmbedding, index: int) -> nn.Module:
        """Decoder layer ``index``; a family with another MLP (experts) passes its own."""
        return LlamaDecoderLayer(config, ops, rotary, index)

    def prepare_layer_stack(self) -> None:
        """After the weights are packed: hand the layers to the op table's layer stack (``build_layer_stack``)."""
        if self.uses_layer_stack:
            self.layer_stack = build_layer_stack(self.ops, self.layers, self.config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions: [T] -> final hidden states [T, H]; with aux_hidden_state_layers, also the
        residual stream entering each of those layers, side by side: ([T, H], [T, len(layers) * H]).
        ``inputs_embeds`` [T, H]: the input rows in place of the token embeddings (a vision-language model's,
        image embeddings among them)."""
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        stack = self.layer_stack
        if stack is not None and not self.aux_hidden_state_layers and stack.takes(hidden.shape[0]):
            hidden, residual = stack(hidden, positions, kv_caches, metadata)
            return self.norm(hidden, residual)[0]
        residual = None
        streams: dict[int, torch.Tensor] = {}
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if index in self.aux_hidden_state_layers:
                # A copy: the fused add + RMSNorm updates the residual in place.
                streams[index] = hidden.clone() if residual is None else hidden + residual
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata)
        hidden, _ = self.norm(hidden, residual)
        if self.aux_hidden_state_layers:
            return hidden, torch.cat([streams[index] for index in self.aux_hidden_state_layers], dim=-1)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, V] in the model's dtype."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters; every parameter must be covered."""
        load_hf_weights(self, weights, self.FUSED)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama with an optional sliding attention window (handled by the attention mask)."""

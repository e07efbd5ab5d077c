"""The vision encoder of the vision-language models: one SigLIP / CLIP-style transformer over square tiles.

A tile of ``image_size`` pixels is cut into ``(image_size / patch_size) ** 2`` patches; the patch convolution
runs as one GEMM over the unfolded patches, position embeddings are added, and pre-norm encoder layers run
with non-causal attention within the tile. The two families differ only where ``EncoderStyle`` says:

    SIGLIP (Idefics3)  patch bias; positions from the tile's bucketed fractional coordinates; a final layer norm
    CLIP (LLaVA)       no patch bias; a class token first (with its own position); a layer norm before the layers;
                       the features are read at a layer (``num_layers``), before the final norm

Also here: ``WrapsLanguageModel``, what a vision-language model shares around its text model (the image rows
replace their tokens' embeddings). No device code.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.layers.linear import Linear
from kvloom.ops.metadata import AttentionMetadata
from kvloom.ops.table import DenseAttentionFn, Ops

# A checkpoint's q/k/v projections -> their shard of the fused qkv_proj.
QKV_SHARDS = {"q_proj": 0, "k_proj": 1, "v_proj": 2}


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> VisionConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        config = cls(**{k: v for k, v in d.items() if k in names})
        if config.hidden_act not in ("gelu_pytorch_tanh", "gelu", "quick_gelu"):
            raise ValueError(f"vision_config.hidden_act {config.hidden_act!r} is not supported; "
                             f"supported: gelu_pytorch_tanh, gelu, quick_gelu")
        if config.image_size % config.patch_size or config.hidden_size % config.num_attention_heads:
            raise ValueError("vision_config: image_size must be a multiple of patch_size and hidden_size of "
                             "num_attention_heads")
        return config

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclasses.dataclass(frozen=True)
class EncoderStyle:
    """Where a SigLIP encoder and a CLIP one part."""

    patch_bias: bool  # the patch convolution has a bias
    class_token: bool  # a learned class embedding before the patches, with a position of its own
    bucketed_positions: bool  # position ids from bucketed fractional coordinates (Idefics3), else 0, 1, 2, ...
    pre_norm: bool  # a layer norm over the embeddings (CLIP's ``pre_layrnorm``)
    post_norm: bool  # the last layer's output goes through ``post_layernorm`` (CLIP's features are read before it)


SIGLIP = EncoderStyle(patch_bias=True, class_token=False, bucketed_positions=True, pre_norm=False, post_norm=True)
CLIP = EncoderStyle(patch_bias=False, class_token=True, bucketed_positions=False, pre_norm=True, post_norm=False)


class LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


def full_tile_position_ids(side: int) -> torch.Tensor:
    """The position ids transformers' Idefics3 gives a tile whose every patch is real: its bucketized fractional
    coordinates, computed as it computes them (so float rounding lands patches in the same buckets; for some
    sides, 19 and 25 among them, that is not 0, 1, 2, ...)."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    coords = torch.clamp(torch.arange(side, dtype=torch.float32) * (1.0 / torch.tensor(float(side))),
                         max=1.0 - 1e-6)
    buckets = torch.bucketize(coords, boundaries, right=True)
    return (buckets[:, None] * side + buckets[None, :]).reshape(-1)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        size = config.hidden_size
        self.qkv_proj = Linear(size, [size, size, size], bias=True)
        self.out_proj = Linear(size, [size], bias=True)
        # q, k, v [N, heads, P, head_dim] -> [N, heads, P, head_dim]: the op table's dense attention once the
        # weights are processed (the CPU's own kernel), torch's SDPA until then.
        self.attend: DenseAttentionFn = F.scaled_dot_product_attention

    def process_weights_after_loading(self, ops: Ops) -> None:
        self.attend = ops.dense_attention

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, P, D]: every patch of a tile attends to every patch of the same tile (no mask)."""
        n, p, d = hidden.shape
        qkv = self.qkv_proj(hidden).view(n, p, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = self.attend(qkv[0], qkv[1], qkv[2])  # [N, heads, P, head_dim]
        return self.out_proj(out.transpose(1, 2).reshape(n, p, d))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = Linear(config.hidden_size, [config.intermediate_size], bias=True)
        self.fc2 = Linear(config.intermediate_size, [config.hidden_size], bias=True)
        self.act = config.hidden_act
        # gelu_pytorch_tanh (SigLIP's): the op table's once the weights are processed (the CPU's own kernel, which
        # writes over fc1's output).
        self.gelu_tanh: Callable[[torch.Tensor], torch.Tensor] = functools.partial(F.gelu, approximate="tanh")

    def process_weights_after_loading(self, ops: Ops) -> None:
        self.gelu_tanh = ops.gelu_tanh

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.fc1(hidden)
        if self.act == "quick_gelu":  # CLIP's: x * sigmoid(1.702 x)
            hidden = hidden * torch.sigmoid(1.702 * hidden)
        elif self.act == "gelu_pytorch_tanh":
            hidden = self.gelu_tanh(hidden)
        else:
            hidden = F.gelu(hidden)
        return self.fc2(hidden)


class VisionEncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.layer_norm1(hidden))
        return hidden + self.mlp(self.layer_norm2(hidden))


class VisionEncoder(nn.Module):
    """Tiles -> hidden states: ``num_layers`` of the config's layers (all by default; a model that reads an
    earlier layer's features builds only the layers up to it)."""

    def __init__(self, config: VisionConfig, style: EncoderStyle, num_layers: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.style = style
        size = config.hidden_size
        num_patches = config.patches_per_side ** 2
        # The conv's [D, C, p, p] weight flattened to [D, C * p * p]: unfold orders a patch's values (c, y, x).
        self.patch_embedding = Linear(config.num_channels * config.patch_size ** 2, [size], bias=style.patch_bias)
        self.class_embedding = nn.Parameter(torch.empty(size), requires_grad=False) if style.class_token else None
        num_positions = num_patches + (1 if style.class_token else 0)
        self.position_embedding = nn.Parameter(torch.empty(num_positions, size), requires_grad=False)
        position_ids = (full_tile_position_ids(config.patches_per_side) if style.bucketed_positions
                        else torch.arange(num_positions))
        self.register_buffer("position_ids", position_ids, persistent=False)
        self.pre_layrnorm = LayerNorm(size, config.layer_norm_eps) if style.pre_norm else None
        count = config.num_hidden_layers if num_layers is None else num_layers
        self.layers = nn.ModuleList(VisionEncoderLayer(config) for _ in range(count))
        self.post_layernorm = LayerNorm(size, config.layer_norm_eps) if style.post_norm else None

    @property
    def dtype(self) -> torch.dtype:
        return self.position_embedding.dtype

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, S, S] -> [N, P, D] with P = (S / patch_size) ** 2 patches a tile (one more, first,
        for the class token)."""
        p = self.config.patch_size
        hidden = self.patch_embedding(F.unfold(pixel_values, kernel_size=p, stride=p).transpose(1, 2))
        if self.class_embedding is not None:
            hidden = torch.cat((self.class_embedding.expand(hidden.shape[0], 1, -1), hidden), dim=1)
        hidden = hidden + self.position_embedding[self.position_ids]
        if self.pre_layrnorm is not None:
            hidden = self.pre_layrnorm(hidden)
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden if self.post_layernorm is None else self.post_layernorm(hidden)

    def load_weight(self, name: str, tensor: torch.Tensor, loaded: set[str], prefix: str) -> None:
        """One checkpoint tensor, named as transformers names it within the vision model (``prefix`` is what
        stood before, for errors): q/k/v into their shard of the fused ``qkv_proj``, the rest into its
        parameter; a layer this encoder does not build, or a final norm it does not apply, is skipped.
        ``loaded`` records what was filled (``missing_weights`` reads it)."""
        name = name.replace("encoder.layers.", "layers.").removeprefix("embeddings.")
        if name.startswith("layers.") and int(name.split(".")[1]) >= len(self.layers):
            return  # past the feature layer
        if name.startswith("post_layernorm.") and self.post_layernorm is None:
            return  # after the last layer, which the features never reach
        if name == "position_embedding.weight":
            name = "position_embedding"
        elif name == "patch_embedding.weight":
            tensor = tensor.reshape(tensor.shape[0], -1)
        module_name, _, kind = name.rpartition(".")
        projection = module_name.rpartition(".")[2]
        if projection in QKV_SHARDS:
            fused, shard = module_name.rpartition(".")[0] + ".qkv_proj", QKV_SHARDS[projection]
            self.get_submodule(fused).load_shard(kind, shard, tensor)
            loaded.add(f"{fused}.{kind}#{shard}")
            return
        param = dict(self.named_parameters()).get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor '{prefix}{name}' has no place in the vision tower")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor '{prefix}{name}' has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        param.data.copy_(tensor)
        loaded.add(name)

    def missing_weights(self, loaded: set[str]) -> list[str]:
        """The parameters (and q/k/v shards) no ``load_weight`` filled."""
        missing = [name for name, _ in self.named_parameters() if name not in loaded and ".qkv_proj." not in name]
        return missing + [f"{name}.{kind}#{shard}" for name, module in self.named_modules()
                          if name.endswith("qkv_proj") for kind in ("weight", "bias")
                          if getattr(module, kind, None) is not None
                          for shard in QKV_SHARDS.values() if f"{name}.{kind}#{shard}" not in loaded]


class WrapsLanguageModel:
    """What a vision-language model shares around its ``language_model``: the image rows (``embed_images``)
    replace their tokens' embeddings, and the rest is the text model's as it is (logits, the hidden-state
    layers EAGLE-3 reads, the C++ layer stack's preparation)."""

    language_model: nn.Module

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: AttentionMetadata,
                multimodal_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions [T]; ``multimodal_embeddings``: (flat token indices [M], rows [M, H]) that
        replace those tokens' embeddings -> final hidden states [T, H]."""
        embeds = self.language_model.embed_tokens(input_ids)
        if multimodal_embeddings is not None:
            index, rows = multimodal_embeddings
            embeds = embeds.index_copy(0, index, rows.to(embeds.dtype))
        return self.language_model(input_ids, positions, kv_caches, metadata, inputs_embeds=embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    @property
    def aux_hidden_state_layers(self) -> tuple[int, ...]:
        return self.language_model.aux_hidden_state_layers

    @aux_hidden_state_layers.setter
    def aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.language_model.aux_hidden_state_layers = layers

    def prepare_layer_stack(self) -> None:
        self.language_model.prepare_layer_stack()

"""Idefics3 (SmolVLM): a SigLIP vision encoder, a pixel-shuffle connector and a Llama text model.

An image arrives as tiles (kvloom/multimodal/idefics3.py: its splits and a global view), each a square of
``image_size`` pixels. The encoder turns each tile's ``(image_size / patch_size) ** 2`` patches into as many
hidden states (non-causal attention within the tile); the connector folds every ``scale_factor`` x
``scale_factor`` patches into one row (pixel shuffle) and projects it to the text model's width, so a tile
gives ``image_seq_len`` rows. Those rows take the place of the ``<image>`` tokens' embeddings in the
prompt; the text model (models/llama.py, unchanged) runs over them like over any tokens. No device code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.layers.linear import Linear
from kvloom.loader.model_config import ModelConfig
from kvloom.models.llama import LlamaForCausalLM
from kvloom.ops.metadata import AttentionMetadata
from kvloom.ops.table import Ops


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


class LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class VisionEmbeddings(nn.Module):
    """Patches -> rows: the patch convolution as one GEMM over unfolded patches, plus position embeddings."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        patch_values = config.num_channels * config.patch_size ** 2
        # The conv's [D, C, p, p] weight flattened to [D, C * p * p]: unfold orders a patch's values (c, y, x).
        self.patch_embedding = Linear(patch_values, [config.hidden_size], bias=True)
        self.position_embedding = nn.Parameter(torch.empty(config.patches_per_side ** 2, config.hidden_size),
                                               requires_grad=False)
        self.register_buffer("position_ids", full_tile_position_ids(config.patches_per_side), persistent=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, S, S] -> [N, P, D] with P = (S / patch_size) ** 2 patches a tile."""
        p = self.config.patch_size
        patches = F.unfold(pixel_values, kernel_size=p, stride=p).transpose(1, 2)  # [N, P, C * p * p]
        return self.patch_embedding(patches) + self.position_embedding[self.position_ids]


def full_tile_position_ids(side: int) -> torch.Tensor:
    """The position ids transformers gives a tile whose every patch is real: its bucketized fractional
    coordinates, computed as it computes them (so float rounding lands patches in the same buckets)."""
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

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, P, D]: every patch of a tile attends to every patch of the same tile (no mask)."""
        n, p, d = hidden.shape
        qkv = self.qkv_proj(hidden).view(n, p, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # [N, heads, P, head_dim]
        return self.out_proj(out.transpose(1, 2).reshape(n, p, d))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = Linear(config.hidden_size, [config.intermediate_size], bias=True)
        self.fc2 = Linear(config.intermediate_size, [config.hidden_size], bias=True)
        self.act = config.hidden_act

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.fc1(hidden)
        if self.act == "quick_gelu":  # CLIP's: x * sigmoid(1.702 x)
            hidden = hidden * torch.sigmoid(1.702 * hidden)
        else:
            hidden = F.gelu(hidden, approximate="tanh" if self.act == "gelu_pytorch_tanh" else "none")
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


class VisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        self.layers = nn.ModuleList(VisionEncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.post_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, S, S] -> [N, P, D]."""
        hidden = self.embeddings(pixel_values)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.post_layernorm(hidden)


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[N, P, D] -> [N, P / scale^2, D * scale^2]: each scale x scale block of the tile's patch grid becomes one
    row, its patches side by side in transformers' order."""
    n, seq, dim = x.shape
    side = int(seq ** 0.5)
    x = x.view(n, side, side // scale, dim * scale).permute(0, 2, 1, 3)
    x = x.reshape(n, side // scale, side // scale, dim * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(n, seq // (scale * scale), dim * scale * scale)


class WrapsLanguageModel:
    """What a vision-language model hands to its ``language_model`` as it is: the hidden-state layers EAGLE-3
    reads and the C++ layer stack's preparation (Idefics3 and LLaVA alike)."""

    language_model: nn.Module

    @property
    def aux_hidden_state_layers(self) -> tuple[int, ...]:
        return self.language_model.aux_hidden_state_layers

    @aux_hidden_state_layers.setter
    def aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.language_model.aux_hidden_state_layers = layers

    def prepare_layer_stack(self) -> None:
        self.language_model.prepare_layer_stack()


class Idefics3ForConditionalGeneration(WrapsLanguageModel, nn.Module):
    """The runner's model interface (forward, compute_logits, load_weights) plus ``embed_images``: tiles ->
    the rows that replace the image tokens. ``forward`` takes those rows with the flat token indices they
    belong at (``multimodal_embeddings``)."""

    supports_int8 = False  # the vision tower's projections are float; int8 runs the text-only families
    smoothable = False

    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        if config.multimodal is None:
            raise ValueError(f"{config.architecture} needs a vision_config")
        self.config = config
        self.vision_config = VisionConfig.from_hf_dict(config.multimodal["vision_config"])
        self.scale_factor = config.multimodal["scale_factor"]
        self.image_token_id = config.multimodal["image_token_id"]
        if self.vision_config.patches_per_side % self.scale_factor:
            raise ValueError(f"the vision tower's {self.vision_config.patches_per_side} patches a side do not "
                             f"divide by scale_factor {self.scale_factor}")
        self.image_seq_len = self.vision_config.patches_per_side ** 2 // self.scale_factor ** 2
        self.vision_model = VisionTransformer(self.vision_config)
        self.modality_projection = Linear(self.vision_config.hidden_size * self.scale_factor ** 2,
                                          [config.hidden_size], bias=False)
        text_config = dataclasses.replace(config, architecture=config.multimodal["text_architecture"], multimodal=None)
        self.language_model = LlamaForCausalLM(text_config, ops)

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, S, S] (N tiles, any images) -> [N * image_seq_len, H] rows, tile by tile."""
        hidden = self.vision_model(pixel_values.to(self.modality_projection_dtype))
        rows = self.modality_projection(pixel_shuffle(hidden, self.scale_factor))
        return rows.reshape(-1, rows.shape[-1])

    @property
    def modality_projection_dtype(self) -> torch.dtype:
        return self.vision_model.post_layernorm.weight.dtype

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

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names: model.vision_model.*, model.connector.modality_projection.proj.weight, model.text_model.*,
        lm_head.weight. Every parameter of the vision side must be covered (the text side checks its own)."""
        vision_params = dict(self.vision_model.named_parameters())
        loaded: set[str] = set()
        qkv = {"q_proj": 0, "k_proj": 1, "v_proj": 2}

        def text_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("model.text_model."):
                    yield "model." + name.removeprefix("model.text_model."), tensor
                elif name == "lm_head.weight":
                    yield name, tensor
                elif name == "model.connector.modality_projection.proj.weight":
                    self.modality_projection.load_shard("weight", 0, tensor)
                    loaded.add("modality_projection")
                elif name.startswith("model.vision_model."):
                    self._load_vision(name.removeprefix("model.vision_model."), tensor, vision_params, qkv, loaded)
                else:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")

        self.language_model.load_weights(text_weights())
        missing = [n for n in vision_params if n not in loaded and not n.endswith("qkv_proj.weight")
                   and not n.endswith("qkv_proj.bias")]
        missing += [f"{n}#{i}" for n, _ in self.vision_model.named_modules() if n.endswith("qkv_proj")
                    for i in range(3) if f"{n}#{i}" not in loaded]
        if "modality_projection" not in loaded:
            missing.append("connector.modality_projection.proj.weight")
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} vision tensor(s), e.g. {missing[:4]}")

    def _load_vision(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter],
                     qkv: dict[str, int], loaded: set[str]) -> None:
        name = name.replace("encoder.layers.", "layers.")
        if name == "embeddings.position_embedding.weight":
            name = "embeddings.position_embedding"
        elif name == "embeddings.patch_embedding.weight":
            tensor = tensor.reshape(tensor.shape[0], -1)
        load_tower_tensor(self.vision_model, "model.vision_model.", name, tensor, params, qkv, loaded)


def load_tower_tensor(tower: nn.Module, prefix: str, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter],
                      qkv: dict[str, int], loaded: set[str]) -> None:
    """One vision-tower tensor (its name within the tower, already renamed) into ``tower``: q/k/v into their
    shard of the fused ``qkv_proj`` (``qkv``: projection -> shard), anything else into its parameter; ValueError
    naming ``prefix + name`` when it has no place or the wrong shape. ``loaded`` records what was filled."""
    module_name, _, kind = name.rpartition(".")
    projection = module_name.rpartition(".")[2]
    if projection in qkv:
        fused = module_name.rpartition(".")[0] + ".qkv_proj"
        tower.get_submodule(fused).load_shard(kind, qkv[projection], tensor)
        loaded.add(f"{fused}#{qkv[projection]}" if kind == "weight" else f"{fused}.{kind}#{qkv[projection]}")
        return
    param = params.get(name)
    if param is None:
        raise ValueError(f"checkpoint tensor '{prefix}{name}' has no place in the vision tower")
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor '{prefix}{name}' has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(param.shape)}")
    param.data.copy_(tensor)
    loaded.add(name)

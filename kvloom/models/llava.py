"""LLaVA: a CLIP vision tower, a two-layer MLP projector and a Llama / Mistral text model.

An image is one square tile (kvloom/multimodal/clip.py: resized, center-cropped). The tower embeds its
``(image_size / patch_size) ** 2`` patches after a class token, runs its encoder layers (the layers of
models/idefics3.py with CLIP's quick GELU) and hands over the hidden states of ``vision_feature_layer`` (-2:
the one before the last), without the class token (strategy "default") or with it ("full"); the projector maps
each to the text model's width. Those rows replace the prompt's ``<image>`` tokens. No device code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.layers.linear import Linear
from kvloom.loader.model_config import ModelConfig
from kvloom.models.idefics3 import LayerNorm, VisionConfig, VisionEncoderLayer, WrapsLanguageModel, load_tower_tensor
from kvloom.models.llama import LlamaForCausalLM, MistralForCausalLM
from kvloom.ops.metadata import AttentionMetadata
from kvloom.ops.table import Ops

_TEXT_MODELS = {"LlamaForCausalLM": LlamaForCausalLM, "MistralForCausalLM": MistralForCausalLM}


class ClipVisionTower(nn.Module):
    def __init__(self, config: VisionConfig, num_layers: int) -> None:
        super().__init__()
        self.config = config
        patch_values = config.num_channels * config.patch_size ** 2
        self.patch_embedding = Linear(patch_values, [config.hidden_size], bias=False)
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.position_embedding = nn.Parameter(torch.empty(config.patches_per_side ** 2 + 1, config.hidden_size),
                                               requires_grad=False)
        self.pre_layrnorm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        # Only the layers up to the feature layer run (the rest would be computed for nothing).
        self.layers = nn.ModuleList(VisionEncoderLayer(config) for _ in range(num_layers))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, S, S] -> the feature layer's hidden states [N, 1 + P, D] (class token first)."""
        p = self.config.patch_size
        patches = self.patch_embedding(F.unfold(pixel_values, kernel_size=p, stride=p).transpose(1, 2))
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        hidden = self.pre_layrnorm(torch.cat((cls, patches), dim=1) + self.position_embedding)
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


class LlavaForConditionalGeneration(WrapsLanguageModel, nn.Module):
    """The runner's model interface plus ``embed_images`` (tiles -> the rows that replace image tokens)."""

    supports_int8 = False
    smoothable = False

    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        mm = config.multimodal
        if mm is None:
            raise ValueError(f"{config.architecture} needs a vision_config")
        self.config = config
        self.vision_config = VisionConfig.from_hf_dict(mm["vision_config"])
        layer = mm["vision_feature_layer"]
        total = self.vision_config.num_hidden_layers
        if not isinstance(layer, int) or not -total - 1 <= layer <= total:
            raise ValueError(f"vision_feature_layer must be one layer index in [{-total - 1}, {total}], got {layer!r} "
                             f"(several feature layers are not supported)")
        if mm["vision_feature_select_strategy"] not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {mm['vision_feature_select_strategy']!r} is not "
                             f"supported; supported: default, full")
        if mm["projector_hidden_act"] != "gelu":
            raise ValueError(f"projector_hidden_act {mm['projector_hidden_act']!r} is not supported; supported: gelu")
        self.drop_class_token = mm["vision_feature_select_strategy"] == "default"
        self.image_token_id = mm["image_token_id"]
        self.image_seq_len = self.vision_config.patches_per_side ** 2 + (0 if self.drop_class_token else 1)
        # hidden_states[i] is the output of i layers (0: the embeddings), so layer -2 of 24 is 23 layers.
        self.vision_tower = ClipVisionTower(self.vision_config, layer if layer >= 0 else total + 1 + layer)
        bias = mm["multimodal_projector_bias"]
        self.linear_1 = Linear(self.vision_config.hidden_size, [config.hidden_size], bias=bias)
        self.linear_2 = Linear(config.hidden_size, [config.hidden_size], bias=bias)
        text_config = dataclasses.replace(config, architecture=mm["text_architecture"], multimodal=None)
        self.language_model = _TEXT_MODELS[mm["text_architecture"]](text_config, ops)

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, S, S] -> [N * image_seq_len, H] rows, image by image."""
        hidden = self.vision_tower(pixel_values.to(self.class_dtype))
        if self.drop_class_token:
            hidden = hidden[:, 1:]
        rows = self.linear_2(F.gelu(self.linear_1(hidden)))
        return rows.reshape(-1, rows.shape[-1])

    @property
    def class_dtype(self) -> torch.dtype:
        return self.vision_tower.class_embedding.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: AttentionMetadata,
                multimodal_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As Idefics3ForConditionalGeneration.forward: the image rows replace their tokens' embeddings."""
        embeds = self.language_model.embed_tokens(input_ids)
        if multimodal_embeddings is not None:
            index, rows = multimodal_embeddings
            embeds = embeds.index_copy(0, index, rows.to(embeds.dtype))
        return self.language_model(input_ids, positions, kv_caches, metadata, inputs_embeds=embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names, as the hub's checkpoints write them (vision_tower.vision_model.*, multi_modal_projector.*,
        language_model.model.*, language_model.lm_head.weight) or as transformers 5 saves them (vision_tower.*,
        model.*-prefixed); the tower's layers past the feature layer are skipped."""
        tower_params = dict(self.vision_tower.named_parameters())
        loaded: set[str] = set()
        qkv = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
        num_layers = len(self.vision_tower.layers)

        def text_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.removeprefix("model.") if name.startswith(("model.vision_tower", "model.language_model",
                                                                      "model.multi_modal_projector")) else name
                if name.startswith("language_model."):
                    rest = name.removeprefix("language_model.")
                    yield (rest if rest.startswith(("model.", "lm_head.")) else "model." + rest), tensor
                elif name == "lm_head.weight":
                    yield name, tensor
                elif name.startswith("multi_modal_projector."):
                    module, _, kind = name.removeprefix("multi_modal_projector.").partition(".")
                    if module not in ("linear_1", "linear_2"):
                        raise ValueError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")
                    getattr(self, module).load_shard(kind, 0, tensor)
                    loaded.add(f"{module}.{kind}")
                elif name.startswith("vision_tower."):
                    rest = name.removeprefix("vision_tower.").removeprefix("vision_model.")
                    self._load_tower(rest, tensor, tower_params, qkv, num_layers, loaded)
                else:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")

        self.language_model.load_weights(text_weights())
        missing = [n for n in tower_params if n not in loaded and ".qkv_proj." not in n]
        missing += [f"{n}#{i}" for n, _ in self.vision_tower.named_modules() if n.endswith("qkv_proj")
                    for i in range(3) if f"{n}#{i}" not in loaded]
        missing += [f"{m}.weight" for m in ("linear_1", "linear_2") if f"{m}.weight" not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} vision tensor(s), e.g. {missing[:4]}")

    def _load_tower(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter], qkv: dict[str, int],
                    num_layers: int, loaded: set[str]) -> None:
        name = name.replace("encoder.layers.", "layers.").removeprefix("embeddings.")
        if name.startswith("layers.") and int(name.split(".")[1]) >= num_layers:
            return  # past the feature layer
        if name == "post_layernorm.weight" or name == "post_layernorm.bias":
            return  # after the last layer, which the features never reach
        if name == "position_embedding.weight":
            name = "position_embedding"
        elif name == "patch_embedding.weight":
            name, tensor = "patch_embedding.weight", tensor.reshape(tensor.shape[0], -1)
        load_tower_tensor(self.vision_tower, "vision_tower.", name, tensor, params, qkv, loaded)

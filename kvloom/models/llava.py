"""LLaVA: a CLIP vision tower, a two-layer MLP projector and a Llama / Mistral text model.

An image is one square tile (kvloom/multimodal/clip.py: resized, center-cropped). The CLIP tower
(models/vision_encoder.py) embeds its ``(image_size / patch_size) ** 2`` patches after a class token, runs
its encoder layers and hands over the hidden states of ``vision_feature_layer`` (-2:
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
from kvloom.models.llama import LlamaForCausalLM, MistralForCausalLM
from kvloom.models.vision_encoder import CLIP, VisionConfig, VisionEncoder, WrapsLanguageModel
from kvloom.ops.table import Ops

_TEXT_MODELS = {"LlamaForCausalLM": LlamaForCausalLM, "MistralForCausalLM": MistralForCausalLM}


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
        self.vision_tower = VisionEncoder(self.vision_config, CLIP, layer if layer >= 0 else total + 1 + layer)
        bias = mm["multimodal_projector_bias"]
        self.linear_1 = Linear(self.vision_config.hidden_size, [config.hidden_size], bias=bias)
        self.linear_2 = Linear(config.hidden_size, [config.hidden_size], bias=bias)
        text_config = dataclasses.replace(config, architecture=mm["text_architecture"], multimodal=None)
        self.language_model = _TEXT_MODELS[mm["text_architecture"]](text_config, ops)

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, S, S] -> [N * image_seq_len, H] rows, image by image."""
        hidden = self.vision_tower(pixel_values.to(self.vision_tower.dtype))
        if self.drop_class_token:
            hidden = hidden[:, 1:]
        rows = self.linear_2(F.gelu(self.linear_1(hidden)))
        return rows.reshape(-1, rows.shape[-1])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names, as the hub's checkpoints write them (vision_tower.vision_model.*, multi_modal_projector.*,
        language_model.model.*, language_model.lm_head.weight) or as transformers 5 saves them (vision_tower.*,
        model.*-prefixed); the tower's layers past the feature layer are skipped."""
        loaded: set[str] = set()

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
                    self.vision_tower.load_weight(rest, tensor, loaded, "vision_tower.")
                else:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")

        self.language_model.load_weights(text_weights())
        missing = self.vision_tower.missing_weights(loaded)
        missing += [f"{m}.weight" for m in ("linear_1", "linear_2") if f"{m}.weight" not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} vision tensor(s), e.g. {missing[:4]}")

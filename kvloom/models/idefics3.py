"""Idefics3 (SmolVLM): a SigLIP vision encoder, a pixel-shuffle connector and a Llama text model.

An image arrives as tiles (kvloom/multimodal/idefics3.py: its splits and a global view), each a square of
``image_size`` pixels. The SigLIP encoder (models/vision_encoder.py) turns each tile's
``(image_size / patch_size) ** 2`` patches into as many hidden states (non-causal attention within the
tile); the connector folds every ``scale_factor`` x
``scale_factor`` patches into one row (pixel shuffle) and projects it to the text model's width, so a tile
gives ``image_seq_len`` rows. Those rows take the place of the ``<image>`` tokens' embeddings in the
prompt; the text model (models/llama.py, unchanged) runs over them like over any tokens. No device code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from kvloom.layers.linear import Linear
from kvloom.loader.model_config import ModelConfig
from kvloom.models.llama import LlamaForCausalLM
from kvloom.models.vision_encoder import SIGLIP, VisionConfig, VisionEncoder, WrapsLanguageModel
from kvloom.ops.table import Ops


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[N, P, D] -> [N, P / scale^2, D * scale^2]: each scale x scale block of the tile's patch grid becomes one
    row, its patches side by side in transformers' order."""
    n, seq, dim = x.shape
    side = int(seq ** 0.5)
    x = x.view(n, side, side // scale, dim * scale).permute(0, 2, 1, 3)
    x = x.reshape(n, side // scale, side // scale, dim * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(n, seq // (scale * scale), dim * scale * scale)


class Idefics3ForConditionalGeneration(WrapsLanguageModel, nn.Module):
    """The runner's model interface (forward, compute_logits, load_weights) plus ``embed_images``: tiles ->
    the rows that replace the image tokens. ``forward`` takes those rows with the flat token indices they
    belong at (``multimodal_embeddings``)."""

    # quantization="int8": the text model's projections as the dense families', and the vision tower's and the
    # connector's too (load_weights), W8A8 on a CPU with int8 activations: the tower's time is its GEMMs.
    supports_int8 = True
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
        self.vision_model = VisionEncoder(self.vision_config, SIGLIP)
        self.modality_projection = Linear(self.vision_config.hidden_size * self.scale_factor ** 2,
                                          [config.hidden_size], bias=False)
        text_config = dataclasses.replace(config, architecture=config.multimodal["text_architecture"], multimodal=None)
        self.language_model = LlamaForCausalLM(text_config, ops)

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, S, S] (N tiles, any images) -> [N * image_seq_len, H] rows, tile by tile."""
        hidden = self.vision_model(pixel_values.to(self.vision_model.dtype))
        rows = self.modality_projection(pixel_shuffle(hidden, self.scale_factor))
        return rows.reshape(-1, rows.shape[-1])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names: model.vision_model.*, model.connector.modality_projection.proj.weight, model.text_model.*,
        lm_head.weight. Every parameter of the vision side must be covered (the text side checks its own)."""
        loaded: set[str] = set()

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
                    self.vision_model.load_weight(name.removeprefix("model.vision_model."), tensor, loaded,
                                                  "model.vision_model.")
                else:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")

        self.language_model.load_weights(text_weights())
        missing = self.vision_model.missing_weights(loaded)
        if "modality_projection" not in loaded:
            missing.append("connector.modality_projection.proj.weight")
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} vision tensor(s), e.g. {missing[:4]}")
        if self.vision_model.layers and self.vision_model.layers[0].self_attn.qkv_proj.quantized:
            # quantization="int8" quantizes the tensors it knows by name as read (q/k/v here); the tower's other
            # projections (patch embedding, out_proj, fc1, fc2) and the connector follow, per output row.
            for module in (*self.vision_model.modules(), self.modality_projection):
                if isinstance(module, Linear) and not module.quantized:
                    module.quantize()

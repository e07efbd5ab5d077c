"""LLaVA's CLIP image preprocessing with Pillow, equal to transformers' CLIP image processor (PIL backend).

An image is converted to RGB (transparency composited on white), its shortest edge resized to
``size["shortest_edge"]`` (BICUBIC by default, the other edge in proportion, rounded down), center-cropped to
``crop_size``, rescaled (x 1/255) and normalized with CLIP's mean and std: one tile. The prompt's ``<image>``
placeholder becomes ``image_seq_len`` ``<image>`` tokens (one per patch, and one more for the class token
under the "full" strategy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvloom.multimodal.image_processing import (
    IMAGE_TOKEN,
    ImageProcessing,
    PreprocessedImage,
    load_image_processor_dict,
)

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(kw_only=True)
class ClipImageProcessing(ImageProcessing):
    """``tile_size``: the crop's side (``crop_size``, square)."""

    shortest_edge: int = 224
    tile_size: int = 224
    do_center_crop: bool = True
    resample: int = 3  # BICUBIC
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD

    def __post_init__(self) -> None:
        if self.do_resize and self.shortest_edge < self.tile_size:
            raise ValueError(f"size.shortest_edge {self.shortest_edge} is smaller than crop_size {self.tile_size}: "
                             f"the crop would pad, which is not supported")

    @classmethod
    def from_pretrained(cls, path: str) -> ClipImageProcessing:
        d = load_image_processor_dict(path)
        kwargs = cls.options_from(d, ("do_center_crop",))
        size = d.get("size") or {}
        if "shortest_edge" in size:
            kwargs["shortest_edge"] = int(size["shortest_edge"])
        elif "height" in size:
            raise ValueError(f"{path}: a square resize (size.height/width) is not supported; use shortest_edge")
        crop = d.get("crop_size") or {}
        if crop:
            if int(crop["height"]) != int(crop["width"]):
                raise ValueError(f"crop_size must be square for LLaVA's tower, got {crop['height']}x{crop['width']}")
            kwargs["tile_size"] = int(crop["height"])
        return cls(**kwargs)

    def preprocess(self, image: Any) -> PreprocessedImage:
        from PIL import Image

        image = self.rgb(image)
        width, height = image.size
        if self.do_resize:
            size = self.shortest_edge
            if width <= height:
                width, height = size, int(size * height / width)
            else:
                width, height = int(size * width / height), size
            image = image.resize((width, height), resample=Image.Resampling(self.resample))
        crop = self.tile_size
        if self.do_center_crop:
            if width < crop or height < crop:
                raise ValueError(f"the image is {width}x{height} pixels after resizing, smaller than the {crop}-pixel "
                                 f"crop")
            top, left = (height - crop) // 2, (width - crop) // 2
            image = image.crop((left, top, left + crop, top + crop))
        elif (width, height) != (crop, crop):
            raise ValueError(f"without center cropping the image must be {crop}x{crop} after resizing, "
                             f"got {width}x{height}")
        return PreprocessedImage(self.to_pixels([image]), 0, 0)

    @staticmethod
    def prompt_replacement(image: PreprocessedImage, image_seq_len: int) -> str:
        return IMAGE_TOKEN * image_seq_len

"""LLaVA's CLIP image preprocessing with Pillow, equal to transformers' CLIP image processor (PIL backend).

An image is converted to RGB (transparency composited on white), its shortest edge resized to
``size["shortest_edge"]`` (BICUBIC by default, the other edge in proportion, rounded down), center-cropped to
``crop_size``, rescaled (x 1/255) and normalized with CLIP's mean and std: one tile. The prompt's ``<image>``
placeholder becomes ``image_seq_len`` ``<image>`` tokens (one per patch, and one more for the class token
under the "full" strategy).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvloom.multimodal.idefics3 import IMAGE_TOKEN, PreprocessedImage, load_image_processor_dict, to_pixels, to_rgb

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ClipImageProcessing:
    def __init__(self, *, shortest_edge: int = 224, crop_height: int = 224, crop_width: int = 224,
                 do_resize: bool = True, do_center_crop: bool = True, resample: int = 3, do_rescale: bool = True,
                 rescale_factor: float = 1 / 255, do_normalize: bool = True,
                 image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN, image_std: tuple[float, ...] = OPENAI_CLIP_STD,
                 do_convert_rgb: bool = True) -> None:
        if crop_height != crop_width:
            raise ValueError(f"crop_size must be square for LLaVA's tower, got {crop_height}x{crop_width}")
        if do_resize and shortest_edge < crop_height:
            raise ValueError(f"size.shortest_edge {shortest_edge} is smaller than crop_size {crop_height}: the crop "
                             f"would pad, which is not supported")
        self.shortest_edge = shortest_edge
        self.tile_size = crop_height
        self.do_resize = do_resize
        self.do_center_crop = do_center_crop
        self.resample = resample
        self.do_rescale = do_rescale
        self.rescale_factor = rescale_factor
        self.do_normalize = do_normalize
        self.image_mean = np.array(image_mean, dtype=np.float32)
        self.image_std = np.array(image_std, dtype=np.float32)
        self.do_convert_rgb = do_convert_rgb

    @classmethod
    def from_pretrained(cls, path: str) -> ClipImageProcessing:
        d = load_image_processor_dict(path)
        kwargs: dict[str, Any] = {}
        size = d.get("size") or {}
        if "shortest_edge" in size:
            kwargs["shortest_edge"] = int(size["shortest_edge"])
        elif "height" in size:
            raise ValueError(f"{path}: a square resize (size.height/width) is not supported; use shortest_edge")
        crop = d.get("crop_size") or {}
        if crop:
            kwargs["crop_height"], kwargs["crop_width"] = int(crop["height"]), int(crop["width"])
        for name in ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb"):
            if name in d:
                kwargs[name] = bool(d[name])
        if "resample" in d:
            kwargs["resample"] = int(d["resample"])
        if "rescale_factor" in d:
            kwargs["rescale_factor"] = float(d["rescale_factor"])
        for name in ("image_mean", "image_std"):
            if name in d:
                value = d[name]
                kwargs[name] = tuple(float(v) for v in (value if isinstance(value, list) else [value] * 3))
        return cls(**kwargs)

    def preprocess(self, image: Any) -> PreprocessedImage:
        from PIL import Image

        image = to_rgb(image) if self.do_convert_rgb else image
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
        return PreprocessedImage(to_pixels([image], self), 0, 0)

    @staticmethod
    def prompt_replacement(image: PreprocessedImage, image_seq_len: int) -> str:
        return IMAGE_TOKEN * image_seq_len

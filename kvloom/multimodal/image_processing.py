"""What the image processors share (transformers' ``BaseImageProcessor`` options): RGB conversion, the resampling
filter, rescale and normalize, read from a saved ``preprocessor_config.json``. Each model's processor
(``idefics3.py``, ``clip.py``) adds how it resizes and cuts an image into tiles. No torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

IMAGE_TOKEN = "<image>"


@dataclass(frozen=True)
class PreprocessedImage:
    """An image's tiles (float32 [tiles, 3, size, size]) and its split grid (0 x 0: one unsplit tile)."""

    pixel_values: np.ndarray
    num_rows: int
    num_cols: int


def load_image_processor_dict(path: str) -> dict[str, Any]:
    """``path``/preprocessor_config.json, or the ``image_processor`` of its processor_config.json (as
    transformers 5 saves a processor)."""
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        config_path = os.path.join(path, name)
        if os.path.isfile(config_path):
            with open(config_path) as f:
                d = json.load(f)
            if key is None:
                return d
            if isinstance(d.get(key), dict):
                return d[key]
    raise ValueError(f"{path} has no preprocessor_config.json (nor a processor_config.json with an "
                     f"image_processor): a vision-language model needs its saved image processor beside its weights")


@dataclass(kw_only=True)
class ImageProcessing:
    """The options every processor has. ``tile_size``: the side of the square tiles the vision tower takes."""

    tile_size: int
    do_resize: bool = True
    resample: int  # a PIL.Image.Resampling value
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    do_convert_rgb: bool = True

    @staticmethod
    def options_from(d: dict[str, Any], flags: tuple[str, ...] = ()) -> dict[str, Any]:
        """The shared options a saved processor dict sets (``flags``: the processor's own booleans besides
        do_resize, do_rescale, do_normalize and do_convert_rgb); transformers' defaults where it is silent."""
        options: dict[str, Any] = {name: bool(d[name]) for name in ("do_resize", "do_rescale", "do_normalize",
                                                                    "do_convert_rgb", *flags) if name in d}
        if "resample" in d:
            options["resample"] = int(d["resample"])
        if "rescale_factor" in d:
            options["rescale_factor"] = float(d["rescale_factor"])
        for name in ("image_mean", "image_std"):
            if name in d:
                value = d[name]
                options[name] = tuple(float(v) for v in (value if isinstance(value, list) else [value] * 3))
        return options

    def rgb(self, image: Any) -> Any:
        return to_rgb(image) if self.do_convert_rgb else image

    def to_pixels(self, tiles: list[Any]) -> np.ndarray:
        """PIL tiles -> float32 [tiles, 3, size, size]: rescaled (in float64, then float32, as transformers does)
        and normalized ((x - mean) / std)."""
        pixels = np.stack([np.asarray(t, dtype=np.uint8) for t in tiles]).transpose(0, 3, 1, 2)
        if self.do_rescale:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        else:
            pixels = pixels.astype(np.float32)
        if self.do_normalize:
            mean = np.array(self.image_mean, dtype=np.float32)[:, None, None]
            std = np.array(self.image_std, dtype=np.float32)[:, None, None]
            pixels = (pixels - mean) / std
        return np.ascontiguousarray(pixels, dtype=np.float32)


def to_rgb(image: Any) -> Any:
    """RGB, with any transparency composited onto white (transformers' convert_to_rgb)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")

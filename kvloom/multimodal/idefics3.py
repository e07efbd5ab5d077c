"""SmolVLM / Idefics3 image preprocessing with Pillow, equal to transformers' Idefics3 image processor.

An image is converted to RGB (transparency composited on white), its longest edge resized to
``size["longest_edge"]`` (never past 4096), then, with ``do_image_splitting``, resized up to whole
multiples of the tile size (``max_image_size["longest_edge"]``) and cut into rows x cols tiles read row by
row, followed by a global view (the whole image resized to one tile); without splitting it becomes one
tile. Every resize is Pillow's on uint8 pixels (LANCZOS by default), as transformers' PIL backend does;
then each tile is rescaled (x 1/255, in float64 then float32) and normalized ((x - mean) / std).

The prompt's ``<image>`` placeholder becomes, per image, ``<fake_token_around_image><row_i_col_j>`` and
``image_seq_len`` ``<image>`` tokens per tile (a newline after each row), then ``\\n<fake_token_around_image>
<global-img>`` + the global view's tokens + ``<fake_token_around_image>``; an unsplit image is only the last
part (without the leading newline).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_IMAGE_SIZE = 4096  # transformers' cap on a resized image's longest edge
IMAGE_TOKEN = "<image>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
IMAGENET_STANDARD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class PreprocessedImage:
    """An image's tiles (float32 [tiles, 3, size, size]) and its split grid (0 x 0: one unsplit tile)."""

    pixel_values: np.ndarray
    num_rows: int
    num_cols: int


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect_ratio = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect_ratio)
        if height % 2 != 0:
            height += 1
    else:
        height = max_len
        width = int(height * aspect_ratio)
        if width % 2 != 0:
            width += 1
    return max(height, 1), max(width, 1)


def _scale_below_upper_bound(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect_ratio = width / height
    if width >= height and width > max_len:
        width = max_len
        height = int(width / aspect_ratio)
    elif height > width and height > max_len:
        height = max_len
        width = int(height * aspect_ratio)
    return max(height, 1), max(width, 1)


def load_image_processor_dict(path: str) -> dict[str, Any]:
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


class Idefics3ImageProcessing:
    """The preprocessing a saved Idefics3 processor describes (its preprocessor_config.json)."""

    def __init__(self, *, longest_edge: int = 4 * 364, tile_size: int = 364, do_resize: bool = True,
                 do_image_splitting: bool = True, resample: int = 1, do_rescale: bool = True,
                 rescale_factor: float = 1 / 255, do_normalize: bool = True,
                 image_mean: tuple[float, ...] = IMAGENET_STANDARD, image_std: tuple[float, ...] = IMAGENET_STANDARD,
                 do_convert_rgb: bool = True) -> None:
        self.longest_edge = longest_edge
        self.tile_size = tile_size
        self.do_resize = do_resize
        self.do_image_splitting = do_image_splitting
        self.resample = resample
        self.do_rescale = do_rescale
        self.rescale_factor = rescale_factor
        self.do_normalize = do_normalize
        self.image_mean = np.array(image_mean, dtype=np.float32)
        self.image_std = np.array(image_std, dtype=np.float32)
        self.do_convert_rgb = do_convert_rgb

    @classmethod
    def from_pretrained(cls, path: str) -> Idefics3ImageProcessing:
        """From ``path``/preprocessor_config.json, or the ``image_processor`` of its processor_config.json (as
        transformers 5 saves a processor); transformers' defaults where it is silent."""
        d = load_image_processor_dict(path)
        kwargs: dict[str, Any] = {}
        if "size" in d:
            kwargs["longest_edge"] = int(d["size"]["longest_edge"])
        if "max_image_size" in d:
            kwargs["tile_size"] = int(d["max_image_size"]["longest_edge"])
        for name in ("do_resize", "do_image_splitting", "do_rescale", "do_normalize", "do_convert_rgb"):
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

    def num_tiles(self, num_rows: int, num_cols: int) -> int:
        return num_rows * num_cols + 1 if num_rows or num_cols else 1

    def preprocess(self, image: Any) -> PreprocessedImage:
        """A PIL image -> its tiles and grid."""
        from PIL import Image

        image = to_rgb(image) if self.do_convert_rgb else image
        resample = Image.Resampling(self.resample)
        width, height = image.size
        if self.do_resize:
            height, width = _rescale_to_max_len(height, width, self.longest_edge)
            height, width = _scale_below_upper_bound(height, width, MAX_IMAGE_SIZE)
            image = image.resize((width, height), resample=resample)
        tile = self.tile_size
        tiles: list[Any] = []
        rows = cols = 0
        if self.do_image_splitting:
            aspect_ratio = width / height
            if width >= height:
                width = math.ceil(width / tile) * tile
                height = math.ceil(int(width / aspect_ratio) / tile) * tile
            else:
                height = math.ceil(height / tile) * tile
                width = math.ceil(int(height * aspect_ratio) / tile) * tile
            image = image.resize((width, height), resample=resample)
            if height > tile or width > tile:
                rows = (height - tile) // tile + 1
                cols = (width - tile) // tile + 1
                tiles = [image.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile))
                         for r in range(rows) for c in range(cols)]
                tiles.append(image.resize((tile, tile), resample=resample))
            else:
                tiles = [image]
        else:
            tiles = [image.resize((tile, tile), resample=resample)]
        return PreprocessedImage(to_pixels(tiles, self), rows, cols)

    @staticmethod
    def prompt_replacement(image: PreprocessedImage, image_seq_len: int) -> str:
        """The text one ``<image>`` placeholder becomes (transformers' Idefics3Processor.replace_image_token)."""
        image_tokens = IMAGE_TOKEN * image_seq_len
        global_view = FAKE_IMAGE_TOKEN + GLOBAL_IMAGE_TOKEN + image_tokens + FAKE_IMAGE_TOKEN
        if image.num_rows == 0 and image.num_cols == 0:
            return global_view
        text = ""
        for row in range(image.num_rows):
            for col in range(image.num_cols):
                text += f"{FAKE_IMAGE_TOKEN}<row_{row + 1}_col_{col + 1}>{image_tokens}"
            text += "\n"
        return text + "\n" + global_view


def to_pixels(tiles: list[Any], options: Any) -> np.ndarray:
    """PIL tiles -> float32 [tiles, 3, size, size]: rescaled (in float64, then float32, as transformers does) and
    normalized as ``options`` (do_rescale, rescale_factor, do_normalize, image_mean, image_std) say."""
    pixels = np.stack([np.asarray(t, dtype=np.uint8) for t in tiles]).transpose(0, 3, 1, 2)
    if options.do_rescale:
        pixels = (pixels.astype(np.float64) * options.rescale_factor).astype(np.float32)
    else:
        pixels = pixels.astype(np.float32)
    if options.do_normalize:
        pixels = (pixels - options.image_mean[:, None, None]) / options.image_std[:, None, None]
    return np.ascontiguousarray(pixels, dtype=np.float32)


def to_rgb(image: Any) -> Any:
    """RGB, with any transparency composited onto white (transformers' convert_to_rgb)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")

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

import math
from dataclasses import dataclass
from typing import Any

from kvloom.multimodal.image_processing import (
    IMAGE_TOKEN,
    ImageProcessing,
    PreprocessedImage,
    load_image_processor_dict,
)

MAX_IMAGE_SIZE = 4096  # transformers' cap on a resized image's longest edge
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
IMAGENET_STANDARD = (0.5, 0.5, 0.5)


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


@dataclass(kw_only=True)
class Idefics3ImageProcessing(ImageProcessing):
    """The preprocessing a saved Idefics3 processor describes (its preprocessor_config.json)."""

    longest_edge: int = 4 * 364
    tile_size: int = 364
    do_image_splitting: bool = True
    resample: int = 1  # LANCZOS
    image_mean: tuple[float, ...] = IMAGENET_STANDARD
    image_std: tuple[float, ...] = IMAGENET_STANDARD

    @classmethod
    def from_pretrained(cls, path: str) -> Idefics3ImageProcessing:
        """From the processor saved at ``path``; transformers' defaults where it is silent."""
        d = load_image_processor_dict(path)
        kwargs = cls.options_from(d, ("do_image_splitting",))
        if "size" in d:
            kwargs["longest_edge"] = int(d["size"]["longest_edge"])
        if "max_image_size" in d:
            kwargs["tile_size"] = int(d["max_image_size"]["longest_edge"])
        return cls(**kwargs)

    def num_tiles(self, num_rows: int, num_cols: int) -> int:
        return num_rows * num_cols + 1 if num_rows or num_cols else 1

    def preprocess(self, image: Any) -> PreprocessedImage:
        """A PIL image -> its tiles and grid."""
        from PIL import Image

        image = self.rgb(image)
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
        return PreprocessedImage(self.to_pixels(tiles), rows, cols)

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


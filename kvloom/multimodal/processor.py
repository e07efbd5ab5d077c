"""A prompt and its images -> the prompt's token ids and an ``ImageFeature`` per image.

The prompt holds one ``<image>`` placeholder per image (``LLM.chat`` and the server write them from image
content parts); each becomes the model's expansion (SmolVLM: tiles, tags and ``image_seq_len`` image tokens
per tile), and the image's rows go to its image tokens' positions. The preprocessing (resizing, tiling) runs
on a thread pool, so a caller on the server's event loop or several images of one prompt are not serialized
behind one large image; Pillow releases the GIL while it resizes.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvloom.multimodal.clip import ClipImageProcessing
from kvloom.multimodal.idefics3 import IMAGE_TOKEN, Idefics3ImageProcessing, PreprocessedImage
from kvloom.multimodal.inputs import ImageFeature
from kvloom.multimodal.media import MAX_IMAGE_PIXELS, MediaConnector

# Images preprocessed at once; resizing a large image is a few hundred ms of mostly GIL-free Pillow work.
PREPROCESS_THREADS = max(1, min(4, os.cpu_count() or 1))
DEFAULT_IMAGE_LIMIT = 1  # vLLM's default limit_mm_per_prompt for an image model


def image_content_hash(image: Any) -> str:
    """The image's pixels and mode, hashed (two equal images from different files share it)."""
    digest = hashlib.sha256()
    digest.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


class PreparedImage:
    """An image preprocessed ahead of the prompt (the server does it on the pool while it parses the request)."""

    __slots__ = ("content_hash", "preprocessed")

    def __init__(self, content_hash: str, preprocessed: PreprocessedImage) -> None:
        self.content_hash = content_hash
        self.preprocessed = preprocessed


class MultiModalProcessor:
    """Images for one model: its preprocessing, its placeholder expansion, its limit of images a prompt."""

    placeholder = IMAGE_TOKEN

    def __init__(self, image_processing: Idefics3ImageProcessing | ClipImageProcessing, image_seq_len: int,
                 image_token_id: int,
                 tile_size: int, tokenizer: Any, limit_per_prompt: int = DEFAULT_IMAGE_LIMIT) -> None:
        if image_processing.tile_size != tile_size:
            raise ValueError(f"the image processor cuts {image_processing.tile_size}-pixel tiles but the vision "
                             f"tower takes {tile_size}-pixel images")
        self.image_processing = image_processing
        self.image_seq_len = image_seq_len
        self.image_token_id = image_token_id
        self.tokenizer = tokenizer
        self.limit_per_prompt = limit_per_prompt
        # Where chat image_url parts may be loaded from (set by the engine from its config).
        self.media = MediaConnector()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(PREPROCESS_THREADS, thread_name_prefix="kvloom-image")
        return self._pool

    # ---- images ------------------------------------------------------------------------------------------
    def prepare(self, image: Any) -> PreparedImage:
        """Check, hash and preprocess one image (a PIL image); ValueError naming what is wrong."""
        check_image(image)
        return PreparedImage(f"{image_content_hash(image)}:{self.image_processing.tile_size}",
                             self.image_processing.preprocess(image))

    def submit(self, image: Any) -> Future[PreparedImage]:
        """``prepare`` on the pool."""
        return self.pool.submit(self.prepare, image)

    def prefetch(self, prompts: list[Any]) -> list[Any]:
        """The prompts with every image of their ``multi_modal_data`` submitted to the pool at once (a batch's
        images preprocessed side by side rather than prompt by prompt); the caller's dicts are not changed."""
        prefetched = []
        for prompt in prompts:
            data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
            images = data.get("image") if isinstance(data, dict) else None
            if images is None or (isinstance(images, (list, tuple)) and len(images) > self.limit_per_prompt):
                prefetched.append(prompt)  # nothing to do, or refused by process() without any work
                continue
            images = list(images) if isinstance(images, (list, tuple)) else [images]
            submitted = [self.submit(image) for image in images]
            prefetched.append(dict(prompt, multi_modal_data=dict(data, image=submitted)))
        return prefetched

    def check_count(self, num_images: int) -> None:
        if num_images > self.limit_per_prompt:
            raise ValueError(f"the prompt has {num_images} images but at most {self.limit_per_prompt} are "
                             f"allowed per prompt (limit_mm_per_prompt={{'image': {self.limit_per_prompt}}})")

    # ---- prompts -----------------------------------------------------------------------------------------
    def process(self, prompt: str, images: Sequence[Any], add_special_tokens: bool = True
                ) -> tuple[list[int], tuple[ImageFeature, ...]]:
        """Text with one ``<image>`` per image, and the images (PIL images or PreparedImages) -> token ids and
        features. ValueError when the counts differ or an image is not usable."""
        self.check_count(len(images))
        num_placeholders = prompt.count(self.placeholder)
        if num_placeholders != len(images):
            raise ValueError(f"the prompt has {num_placeholders} '{self.placeholder}' placeholders for "
                             f"{len(images)} images; put one '{self.placeholder}' where each image goes")
        futures = [image if isinstance(image, (PreparedImage, Future)) else self.submit(image) for image in images]
        prepared = [item.result() if isinstance(item, Future) else item for item in futures]
        pieces = prompt.split(self.placeholder)
        text = pieces[0]
        for image, piece in zip(prepared, pieces[1:]):
            text += self.image_processing.prompt_replacement(image.preprocessed, self.image_seq_len) + piece
        token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        positions = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        features = []
        start = 0
        for image in prepared:
            pixels = image.preprocessed.pixel_values
            count = pixels.shape[0] * self.image_seq_len
            if start + count > len(positions):
                raise ValueError("the prompt's text holds fewer image tokens than its images fill; do not write "
                                 f"the model's image tokens yourself, only one '{self.placeholder}' per image")
            features.append(ImageFeature(image.content_hash, tuple(positions[start:start + count]), pixels,
                                         image.preprocessed.num_rows, image.preprocessed.num_cols))
            start += count
        if start != len(positions):
            raise ValueError(f"the prompt holds {len(positions) - start} image tokens that belong to no image; "
                             f"write one '{self.placeholder}' per image and no image tokens of your own")
        return token_ids, tuple(features)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def check_image(image: Any) -> None:
    """A PIL image of a usable size; ValueError otherwise."""
    try:
        from PIL import Image
    except ImportError:
        raise ValueError("images need Pillow: pip install pillow") from None
    if not isinstance(image, Image.Image):
        raise ValueError(f"an image must be a PIL.Image.Image, got {type(image).__name__}")
    width, height = image.size
    if width < 1 or height < 1:
        raise ValueError(f"the image is empty ({width}x{height} pixels)")
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"the image has {width}x{height} pixels; at most {MAX_IMAGE_PIXELS} pixels are allowed")


def build_multimodal_processor(model_config: Any, model_path: str, tokenizer: Any,
                               limit_mm_per_prompt: dict[str, int] | None) -> MultiModalProcessor | None:
    """The processor of a vision-language model (None for a text model, whose prompts may hold no images)."""
    mm = getattr(model_config, "multimodal", None)
    if mm is None:
        if limit_mm_per_prompt and any(limit_mm_per_prompt.values()):
            raise ValueError(f"limit_mm_per_prompt={limit_mm_per_prompt}: {model_config.architecture} is a "
                             f"text-only model; it takes no images")
        return None
    limits = dict(limit_mm_per_prompt or {})
    unknown = set(limits) - {"image"}
    if unknown:
        raise ValueError(f"limit_mm_per_prompt names {sorted(unknown)}; this model takes only 'image'")
    limit = limits.get("image", DEFAULT_IMAGE_LIMIT)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise ValueError(f"limit_mm_per_prompt['image'] must be an integer >= 0, got {limit!r}")
    vision = mm["vision_config"]
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    if model_config.architecture == "LlavaForConditionalGeneration":
        image_seq_len = patches + (1 if mm["vision_feature_select_strategy"] == "full" else 0)
        image_processing: Any = ClipImageProcessing.from_pretrained(model_path)
    else:
        image_seq_len = patches // mm["scale_factor"] ** 2
        image_processing = Idefics3ImageProcessing.from_pretrained(model_path)
    return MultiModalProcessor(image_processing, image_seq_len, mm["image_token_id"], vision["image_size"], tokenizer,
                               limit)


def multimodal_processor(resolved: Any, tokenizer: Any) -> MultiModalProcessor | None:
    """``build_multimodal_processor`` for an engine's resolved config, refusing what a vision-language model
    does not run with (tensor parallelism, speculative decoding)."""
    engine = resolved.engine
    if resolved.model.multimodal is not None:
        if engine.tensor_parallel_size > 1:
            raise ValueError(f"{resolved.model.architecture} runs on one rank: tensor_parallel_size must be 1, "
                             f"got {engine.tensor_parallel_size}")
        if engine.speculative is not None:
            raise ValueError(f"speculative decoding is not supported for {resolved.model.architecture}")
    processor = build_multimodal_processor(resolved.model, resolved.source.path, tokenizer,
                                           engine.limit_mm_per_prompt)
    if processor is not None:
        processor.media = MediaConnector(engine.allowed_local_media_path, engine.allowed_media_domains)
    return processor

"""Images in, before the model: preprocessing equal to transformers' Idefics3 processor (tiles, pixels, the
expanded prompt's token ids), image loading with its allowances and limits, chat image parts, and the prefix
cache naming blocks by image content."""

from __future__ import annotations

import base64
import io
import os

import numpy as np
import pytest

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402
from tiny_vision import build_tiny_idefics3, load_hf_processor  # noqa: E402

from kvloom.engine.kv_cache_manager import KVCacheManager  # noqa: E402
from kvloom.engine.request import Request  # noqa: E402
from kvloom.loader.tokenizer import load_tokenizer  # noqa: E402
from kvloom.loader.weights import load_model_config, resolve_model  # noqa: E402
from kvloom.multimodal import media  # noqa: E402
from kvloom.multimodal.chat import split_image_parts, template_takes_parts  # noqa: E402
from kvloom.multimodal.idefics3 import Idefics3ImageProcessing  # noqa: E402
from kvloom.multimodal.inputs import ImageFeature  # noqa: E402
from kvloom.multimodal.media import MediaConnector  # noqa: E402
from kvloom.multimodal.processor import build_multimodal_processor  # noqa: E402
from kvloom.sampling_params import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_idefics3(str(tmp_path_factory.mktemp("tiny_idefics3")))


@pytest.fixture(scope="module")
def unsplit_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_idefics3(str(tmp_path_factory.mktemp("tiny_idefics3_unsplit")), do_image_splitting=False)


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = 4 if mode == "RGBA" else 3
    image = Image.fromarray(rng.integers(0, 256, (height, width, channels), dtype=np.uint8),
                            "RGBA" if channels == 4 else "RGB")
    return image if mode in ("RGB", "RGBA") else image.convert(mode)


SHAPES = [(40, 20, "RGB"), (20, 70, "RGB"), (64, 64, "RGBA"), (10, 10, "L"), (33, 17, "P"), (100, 30, "RGB"),
          (32, 32, "RGB"), (200, 150, "RGB")]


@pytest.mark.parametrize("splitting", [True, False])
def test_pixels_and_grid_equal_transformers(model_dir: str, unsplit_dir: str, splitting: bool) -> None:
    path = model_dir if splitting else unsplit_dir
    hf = load_hf_processor(path)
    ours = Idefics3ImageProcessing.from_pretrained(path)
    for index, (width, height, mode) in enumerate(SHAPES):
        image = random_image(width, height, mode, seed=index)
        expected = hf.image_processor(image, return_tensors="np", return_row_col_info=True)
        got = ours.preprocess(image)
        assert got.pixel_values.dtype == np.float32
        np.testing.assert_allclose(got.pixel_values, expected["pixel_values"][0], rtol=0, atol=1e-6)
        assert (got.num_rows, got.num_cols) == (expected["rows"][0][0], expected["cols"][0][0])


def test_expanded_prompt_token_ids_equal_transformers(model_dir: str) -> None:
    hf = load_hf_processor(model_dir)
    processor = build_multimodal_processor(load_model_config(resolve_model(model_dir)), model_dir,
                                           load_tokenizer(resolve_model(model_dir)), {"image": 3})
    images = [random_image(40, 20, seed=1), random_image(64, 64, seed=2), random_image(20, 20, seed=3)]
    text = "Look:<image> then<image>and <image> done"
    expected = hf(text=text, images=images)["input_ids"][0]
    token_ids, features = processor.process(text, images)
    assert token_ids == expected
    # Each image's rows go to its own <image> tokens, in order, and no image token is left over.
    image_positions = [i for i, t in enumerate(token_ids) if t == processor.image_token_id]
    assert [p for f in features for p in f.embed_positions] == image_positions
    assert [f.pixel_values.shape[0] for f in features] == [3, 5, 5]  # 1 x 2, 2 x 2, 2 x 2 (upscaled) + global
    assert [f.num_embeds for f in features] == [3 * 4, 5 * 4, 5 * 4]
    # The same pixels hash alike; other pixels differ.
    again, _ = processor.process(text, images)
    assert again == token_ids
    assert features[0].content_hash == processor.prepare(random_image(40, 20, seed=1)).content_hash
    assert features[0].content_hash != features[1].content_hash


def test_placeholder_and_limit_errors(model_dir: str) -> None:
    processor = build_multimodal_processor(load_model_config(resolve_model(model_dir)), model_dir,
                                           load_tokenizer(resolve_model(model_dir)), {"image": 1})
    image = random_image(20, 20)
    with pytest.raises(ValueError, match="at most 1 are allowed per prompt"):
        processor.process("<image><image>", [image, image])
    with pytest.raises(ValueError, match="1 '<image>' placeholders for 0 images"):
        processor.process("<image> hi", [])
    with pytest.raises(ValueError, match="must be a PIL.Image.Image"):
        processor.process("<image> hi", ["not an image"])
    with pytest.raises(ValueError, match="text-only model"):
        build_multimodal_processor(load_model_config(resolve_model(model_dir)).__class__(
            architecture="LlamaForCausalLM", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
            num_attention_heads=1, num_key_value_heads=1, head_dim=8), model_dir, None, {"image": 1})


def png_data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_media_urls_and_their_limits(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    image = random_image(30, 20)
    connector = MediaConnector()
    loaded = connector.load_image(png_data_url(image))
    assert loaded.size == (30, 20) and np.array_equal(np.asarray(loaded), np.asarray(image))
    with pytest.raises(ValueError, match="not valid base64"):
        connector.load_image("data:image/png;base64,@@@@")
    with pytest.raises(ValueError, match="could not be decoded"):
        connector.load_image("data:image/png;base64," + base64.b64encode(b"not a png at all").decode())
    with pytest.raises(ValueError, match="data:image/<type>;base64"):
        connector.load_image("data:text/plain;base64,aGk=")
    with pytest.raises(ValueError, match="scheme 'ftp' is not supported"):
        connector.load_image("ftp://example.com/a.png")
    with pytest.raises(ValueError, match="host 'example.com' is not allowed"):
        connector.load_image("https://example.com/a.png")
    with pytest.raises(ValueError, match="local image files are not allowed"):
        connector.load_image("file:///etc/hostname")
    # Local files: only under the allowed directory, links and .. resolved first.
    allowed = tmp_path / "media"
    allowed.mkdir()
    image.save(allowed / "a.png")
    outside = tmp_path / "secret.png"
    image.save(outside)
    os.symlink(outside, allowed / "link.png")
    local = MediaConnector(allowed_local_media_path=str(allowed))
    assert local.load_image(f"file://{allowed}/a.png").size == (30, 20)
    for url in (f"file://{outside}", f"file://{allowed}/../secret.png", f"file://{allowed}/link.png"):
        with pytest.raises(ValueError, match="outside the allowed local media path"):
            local.load_image(url)
    # Size and pixel limits (lowered here, so the test needs no huge image).
    monkeypatch.setattr(media, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ValueError, match="30x20 pixels; at most 100"):
        connector.load_image(png_data_url(image))
    monkeypatch.setattr(media, "MAX_IMAGE_BYTES", 10)
    with pytest.raises(ValueError, match="over 10 bytes|at most 10 are allowed"):
        connector.load_image(png_data_url(image))


def test_chat_parts_become_placeholders_or_template_parts() -> None:
    image = random_image(8, 8)
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "what is"},
                                             {"type": "image_url", "image_url": {"url": "data:..."}},
                                             {"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": "this?"}]}]
    rendered, images = split_image_parts(messages, "<image>", takes_parts=False)
    assert rendered[1]["content"] == "what is\n<image>\n<image>\nthis?"
    assert images == [("url", "data:..."), ("pil", image)]
    rendered, _ = split_image_parts(messages, "<image>", takes_parts=True)
    assert rendered[1]["content"][1:3] == [{"type": "image"}, {"type": "image"}]
    assert template_takes_parts("{% for line in message['content'] %}{{ line['text'] }}{% endfor %}")
    assert not template_takes_parts("{{ message['content'] }}")
    with pytest.raises(ValueError, match="text, image_url or image_pil"):
        split_image_parts([{"role": "user", "content": [{"type": "input_audio"}]}], "<image>", False)


def feature(content_hash: str, positions: range) -> ImageFeature:
    return ImageFeature(content_hash, tuple(positions), None)


def test_prefix_cache_names_blocks_by_image_content() -> None:
    """Same tokens, different image: no shared block from the image's first block on; same image: shared."""
    tokens = list(range(10, 14)) + [99] * 8 + [5, 6, 7, 8, 9]  # 17 tokens, the image at positions 4..11
    kv = KVCacheManager(num_blocks=32, block_size=4)

    def run(request_id: str, image_hash: str) -> int:
        request = Request(request_id, tokens, SamplingParams(max_tokens=1), mm_features=(
            feature(image_hash, range(4, 12)),))
        hits, num_hit_tokens = kv.get_computed_blocks(request)
        assert kv.allocate_slots(request, len(tokens) - num_hit_tokens, hits)
        request.num_computed_tokens = len(tokens)
        kv.free(request)
        return num_hit_tokens

    assert run("a", "cat") == 0
    assert run("b", "cat") == 16  # every full block (the last token is always computed)
    assert run("c", "dog") == 4  # only the text block before the image
    text_only = Request("d", tokens, SamplingParams(max_tokens=1))
    assert kv.get_computed_blocks(text_only)[1] == 4  # image tokens without an image match no image's blocks

"""Incremental detokenization equals decoding the whole output, with no half-decoded characters on the way."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import tiny_models

from kvloom.engine.detokenizer import IncrementalDetokenizer
from kvloom.loader.tokenizer import Tokenizer, load_tokenizer
from kvloom.loader.weights import resolve_model

TEXTS = [
    "Hello there! Café naïve résumé, Zürich and Ångström.",
    "Emoji: 😀🎉🚀 👍🏽 ❤️ 🇫🇷 👨‍👩‍👧‍👦 done",
    "日本語のテキスト、中文文本、한국어 텍스트。",
    "Math ∑ x² ≤ ∞ → λ; money € £ ¥.",
    "  spaces   and\ttabs\n\nnewlines  ",
]
PROMPT = "<|im_start|>user\nWrite something 😀<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    fixture = "tiny_llama_dir" if request.param == "tiny" else "smollm2_gguf_path"
    return load_tokenizer(resolve_model(request.getfixturevalue(fixture)))


def _stream(
    detokenizer: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None
) -> list[str]:
    """step() over ids in chunks of 1 (or 1-3 with rng, as speculative decoding delivers them)."""
    chunks, start = [], 0
    while start < len(ids):
        size = rng.randint(1, 3) if rng else 1
        chunks.append(detokenizer.step(ids[start:start + size]))
        start += size
    return chunks


def _byte_heavy_ids(tokenizer: Tokenizer, rng: random.Random, count: int) -> list[int]:
    """Random ids, many of them single bytes of multi-byte characters, so UTF-8 is split and broken."""
    pieces = [tokenizer.encode(char, add_special_tokens=False) for char in "é日😀€한"]
    ids: list[int] = []
    while len(ids) < count:
        if rng.random() < 0.4:
            piece = rng.choice(pieces)
            ids.extend(piece[: rng.randint(1, len(piece))])  # sometimes only part of a character
        else:
            ids.append(rng.randrange(tokenizer.vocab_size))
    return ids[:count]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_streams_without_replacement_characters(tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    prompt_ids = tokenizer.encode(PROMPT)
    for text in TEXTS:
        ids = tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)
        expected = tokenizer.decode(ids, skip_special_tokens)
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        for token_id in ids:
            detokenizer.step([token_id])
            assert "\ufffd" not in detokenizer.output_text
            assert expected.startswith(detokenizer.output_text)
        assert detokenizer.flush() == ""
        assert detokenizer.output_text == expected
        assert expected.endswith("<|im_end|>") != skip_special_tokens


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_stream_to_the_full_decode(tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    rng = random.Random(1234)
    for _ in range(150):
        prompt_ids = _byte_heavy_ids(tokenizer, rng, rng.randint(0, 8))  # may end inside a character
        ids = _byte_heavy_ids(tokenizer, rng, rng.randint(1, 24))
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        streamed = "".join(_stream(detokenizer, ids, rng)) + detokenizer.flush()
        expected = tokenizer.decode(ids, skip_special_tokens)
        assert streamed == detokenizer.output_text == expected, (prompt_ids, ids)


def test_output_that_ends_inside_a_character_is_held_until_flush(tokenizer: Tokenizer) -> None:
    crab = tokenizer.encode("🦀", add_special_tokens=False)  # a rare emoji: several byte tokens
    ids = tokenizer.encode("ok ", add_special_tokens=False) + crab[:1]
    assert tokenizer.decode(ids).endswith("\ufffd")
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert "".join(_stream(detokenizer, ids)) == detokenizer.output_text == "ok "
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.output_text == tokenizer.decode(ids)
    assert detokenizer.step([]) == ""


def test_sentencepiece_first_token_keeps_its_leading_space(tmp_path: Path) -> None:
    """With the prompt as context, " Paris" streams as " Paris", not the "Paris" that decoding the
    output alone gives (the sentencepiece decoder strips the first token's space)."""
    path = tiny_models.write_sentencepiece_gguf(str(tmp_path / "spm.gguf"))
    tokenizer = load_tokenizer(resolve_model(path))
    prompt = "The capital of France is"
    full = tokenizer.encode(prompt + " Paris, the city of light.")
    prompt_ids = tokenizer.encode(prompt)
    assert full[: len(prompt_ids)] == prompt_ids
    output_ids = full[len(prompt_ids):]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    streamed = "".join(_stream(detokenizer, output_ids)) + detokenizer.flush()
    assert streamed == " Paris, the city of light."
    assert streamed == tokenizer.decode(full)[len(tokenizer.decode(prompt_ids)):]
    assert tokenizer.decode(output_ids) == "Paris, the city of light."


def test_a_long_run_of_broken_bytes_streams_as_it_comes(tokenizer: Tokenizer) -> None:
    """Bytes that never become a character (a random model repeating one byte) are emitted as U+FFFD
    along the way, as decode() renders them, rather than held, and re-decoded, until the end."""
    crab = tokenizer.encode("🦀", add_special_tokens=False)
    lead, continuation = crab[0], crab[-1]  # alone, each is a broken sequence
    rng = random.Random(7)
    ids = [rng.choice([lead, continuation]) for _ in range(2000)]
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("ok"))
    streamed = _stream(detokenizer, ids)
    assert len("".join(streamed)) >= len(tokenizer.decode(ids)) - 8  # all but the last few ids' text
    assert "".join(streamed) + detokenizer.flush() == detokenizer.output_text == tokenizer.decode(ids)
    ids = ids[:50] + crab + tokenizer.encode(" ok", add_special_tokens=False)  # then a whole character
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert "".join(_stream(detokenizer, ids, rng)) + detokenizer.flush() == tokenizer.decode(ids)

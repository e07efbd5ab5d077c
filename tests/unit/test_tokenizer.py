"""Tokenizer: ids, text and chat prompts equal transformers' AutoTokenizer for the same files."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import tiny_models

from kvloom.loader.tokenizer import Tokenizer, load_tokenizer
from kvloom.loader.weights import resolve_model

TEXTS = [
    "Hello world", " Hello world", "Hello, world! How are you doing today?",
    "def f(x):\n    return x * 2  # double\n\n\tprint('tab')",
    "1234567890 3.14159 1,000,000 2024-01-01 12:30 ½ ² ①",
    "   leading spaces and   runs   of spaces   \n\n\n trailing  ",
    "Café naïve résumé façade jalapeño Zürich Ångström",
    "日本語のテキスト、中文文本、한국어 텍스트",
    "Emoji 😀🎉🚀 👍🏽 ❤️ 🇫🇷 👨‍👩‍👧‍👦",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|endoftext|>", "I'm you're we've they'll she'd IT'S",
    "\r\n\r\nwindows\r\nlines", "", " ", "\n", "a" * 50, "über-long-word-with-dashes_and_underscores",
    "Math: ∑ x² ≤ ∞, α β γ → λ", "<html><body>Tag soup</body></html>", "{'json': [1, 2, {\"k\": null}]}",
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3? Answer in 日本語 😀"},
]


def _transformers_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return AutoTokenizer.from_pretrained(path)


def _assert_same_as_transformers(tokenizer: Tokenizer, reference: Any, texts: list[str] = TEXTS) -> None:
    for text in texts:
        for add_special_tokens in (True, False):
            expected = reference(text, add_special_tokens=add_special_tokens)["input_ids"]
            assert tokenizer.encode(text, add_special_tokens) == expected, (text, add_special_tokens)
        ids = reference(text)["input_ids"]
        for skip in (True, False):
            expected = reference.decode(ids, skip_special_tokens=skip)
            assert tokenizer.decode(ids, skip) == expected, (text, skip)
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 24))]
        for skip in (True, False):
            assert tokenizer.decode(ids, skip) == reference.decode(ids, skip_special_tokens=skip), (ids, skip)
    assert tokenizer.vocab_size == len(reference)
    assert tokenizer.bos_token_id == reference.bos_token_id
    assert tokenizer.eos_token_id == reference.eos_token_id
    assert tokenizer.pad_token_id == reference.pad_token_id
    assert set(reference.all_special_ids) <= tokenizer.all_special_ids
    for token_id in (0, 1, 2, 100, tokenizer.vocab_size - 1):
        token = tokenizer.id_to_token(token_id)
        assert token == reference.convert_ids_to_tokens(token_id)
        assert tokenizer.token_to_id(token) == token_id
    assert tokenizer.id_to_token(tokenizer.vocab_size + 10) is None


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_llama_dir: str) -> Tokenizer:
    return load_tokenizer(resolve_model(tiny_llama_dir))


@pytest.fixture(scope="module")
def smollm2_tokenizers(smollm2_gguf_path: str) -> tuple[Tokenizer, Any]:
    """(ours, transformers') for the default model's GGUF; transformers' takes seconds to build."""
    return load_tokenizer(resolve_model(smollm2_gguf_path)), _transformers_tokenizer(smollm2_gguf_path)


# ---------------------------------------------------------------------------------------------
# HF directories


def test_hf_dir_tokenizer_matches_transformers(tiny_llama_dir: str, tiny_tokenizer: Tokenizer) -> None:
    _assert_same_as_transformers(tiny_tokenizer, _transformers_tokenizer(tiny_llama_dir))
    assert tiny_tokenizer.bos_token_id == tiny_models.BOS_ID
    assert tiny_tokenizer.eos_token_ids == {tiny_models.EOS_ID}
    assert tiny_tokenizer.all_special_ids == {0, 1, 2}
    # no BOS: neither tokenizer.json's post-processor nor tokenizer_config.json asks for one
    assert tiny_tokenizer.encode("Hello")[0] != tiny_models.BOS_ID


def test_bos_from_tokenizer_json_post_processor(tmp_path: Path) -> None:
    tiny_models.save_tokenizer(str(tmp_path), add_bos_token=True)
    tokenizer = load_tokenizer(resolve_model(_with_config(tmp_path)))
    _assert_same_as_transformers(tokenizer, _transformers_tokenizer(str(tmp_path)), TEXTS[:4])
    assert tokenizer.encode("Hello")[0] == tiny_models.BOS_ID
    assert tokenizer.encode("Hello", add_special_tokens=False)[0] != tiny_models.BOS_ID


def _with_config(path: Path) -> str:
    """A tokenizer-only directory made resolvable as a model directory."""
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return str(path)


def test_generation_config_eos_ids_join_eos_token_ids(tmp_path: Path) -> None:
    tiny_models.save_tokenizer(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tokenizer = load_tokenizer(resolve_model(_with_config(tmp_path)))
    assert tokenizer.eos_token_id == 2
    assert tokenizer.eos_token_ids == {0, 2}


def test_chat_template_matches_transformers(tiny_llama_dir: str, tiny_tokenizer: Tokenizer) -> None:
    reference = _transformers_tokenizer(tiny_llama_dir)
    for messages in (CONVERSATION, CONVERSATION[1:]):  # with and without a system message
        for add_generation_prompt in (True, False):
            expected = reference.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
            assert tiny_tokenizer.apply_chat_template(messages, add_generation_prompt) == expected


def test_chat_template_accepts_openai_text_parts(tiny_tokenizer: Tokenizer) -> None:
    content = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    parts = [{"role": "user", "content": content}]
    plain = [{"role": "user", "content": "Hello\nthere"}]
    assert tiny_tokenizer.apply_chat_template(parts) == tiny_tokenizer.apply_chat_template(plain)


def test_chat_template_file_takes_precedence(tiny_llama_dir: str, tmp_path: Path) -> None:
    model_dir = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] | tojson }}\n{% endfor %}"
                "{{ bos_token }}")
    (model_dir / "chat_template.jinja").write_text(template)
    tokenizer = load_tokenizer(resolve_model(str(model_dir)))
    assert tokenizer.chat_template == template
    expected = _transformers_tokenizer(str(model_dir)).apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.apply_chat_template(CONVERSATION) == expected
    assert '"And 3+3? Answer in 日本語 😀"' in expected  # tojson keeps non-ASCII as is


@pytest.mark.parametrize(("messages", "error"), [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    (["hi"], r"messages\[0\] must be a dict"),
    ([{"role": "robot", "content": "hi"}], "role 'robot'.*allowed roles"),
    ([{"role": "user"}], r"messages\[0\] \(user\) has no 'content'"),
    ([{"role": "user", "content": 3}], "must be a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "only text is supported"),
])
def test_malformed_messages_are_value_errors(tiny_tokenizer: Tokenizer, messages: Any, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        tiny_tokenizer.apply_chat_template(messages)


def test_chat_template_errors_are_value_errors(tiny_tokenizer: Tokenizer, tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="no roles allowed"):
        tiny_tokenizer.apply_chat_template(messages,
                                           chat_template="{{ raise_exception('no roles allowed') }}")
    with pytest.raises(ValueError, match="not valid Jinja"):
        tiny_tokenizer.apply_chat_template(messages, chat_template="{% for %}")
    path = tiny_models.write_sentencepiece_gguf(str(tmp_path / "t.gguf"))
    no_template = load_tokenizer(resolve_model(path))
    assert no_template.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template(messages)
    assert no_template.apply_chat_template(messages, chat_template="{{ messages[0]['content'] }}") == "hi"


def test_hf_dir_without_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(resolve_model(_with_config(tmp_path)))


# ---------------------------------------------------------------------------------------------
# GGUF


def test_tiny_gguf_tokenizer_matches_transformers(tiny_gguf_path: str, tiny_tokenizer: Tokenizer) -> None:
    tokenizer = load_tokenizer(resolve_model(tiny_gguf_path))
    _assert_same_as_transformers(tokenizer, _transformers_tokenizer(tiny_gguf_path))
    # the same vocabulary as the HF directory it was written from gives the same ids
    assert all(tokenizer.encode(text) == tiny_tokenizer.encode(text) for text in TEXTS)


@pytest.mark.parametrize("pre", ["qwen2", "deepseek-r1-qwen", "qwen35", "gpt-4o", "llama-bpe"])
def test_gguf_pre_tokenizer_split_matches_transformers(tiny_gguf_path: str, tiny_llama_dir: str, tmp_path: Path,
                                                       pre: str) -> None:
    """A byte-level file's tokenizer.ggml.pre picks the split transformers and llama.cpp apply to it (Qwen2.5's
    files say "qwen2": single digits, case-blind contractions), not GPT-2's."""
    path = tiny_models.write_tiny_gguf(str(tmp_path / f"{pre}.gguf"), tiny_llama_dir, pre=pre)
    tokenizer = load_tokenizer(resolve_model(path))
    texts = [*TEXTS, "Tokens 2024 and 31337, I'VE HE'S You'Re x1y22z333", "Ａｂｃ 12 ｘ３４ é\u0301 e\u0301t\u00e9"]
    _assert_same_as_transformers(tokenizer, _transformers_tokenizer(path), texts)
    gpt2_split = load_tokenizer(resolve_model(tiny_gguf_path))  # "smollm": GPT-2's split
    assert any(tokenizer.encode(text) != gpt2_split.encode(text) for text in texts), pre


def test_gguf_tokenizer_comes_back_from_its_cache_entry_the_same(tiny_gguf_path: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from kvloom.loader import tokenizer as tokenizer_module

    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path / "cache"))
    path = shutil.copy(tiny_gguf_path, tmp_path / "t.gguf")
    built = tokenizer_module._build_gguf(str(path))
    first = load_tokenizer(resolve_model(str(path)))  # builds and writes the entry
    entries = list((tmp_path / "cache" / "tokenizers").glob("*.json"))
    assert len(entries) == 1
    monkeypatch.setattr(tokenizer_module, "_build_gguf", lambda p: pytest.fail("built again, not read back"))
    cached = load_tokenizer(resolve_model(str(path)))
    for tokenizer in (first, cached):
        for text in TEXTS:
            for add_special_tokens in (True, False):
                assert tokenizer.encode(text, add_special_tokens) == built.encode(text, add_special_tokens)
            assert tokenizer.decode(built.encode(text), False) == built.decode(built.encode(text), False)
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.eos_token_ids,
                tokenizer.all_special_ids, tokenizer.vocab_size, tokenizer.special_tokens) == (
            built.bos_token_id, built.eos_token_id, built.pad_token_id, built.eos_token_ids, built.all_special_ids,
            built.vocab_size, built.special_tokens)
        assert tokenizer.apply_chat_template(CONVERSATION) == built.apply_chat_template(CONVERSATION)
    monkeypatch.undo()
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path / "cache"))
    entries[0].write_text("{not json")  # a broken entry is rebuilt and rewritten
    assert load_tokenizer(resolve_model(str(path))).encode(TEXTS[2]) == built.encode(TEXTS[2])
    assert json.loads(entries[0].read_text())["special"] == built.special_tokens
    os.utime(path, ns=(1, 1))  # the file changed: another entry
    load_tokenizer(resolve_model(str(path)))
    assert len(list((tmp_path / "cache" / "tokenizers").glob("*.json"))) == 2


def test_sentencepiece_gguf_tokenizer_matches_transformers(tmp_path: Path) -> None:
    path = tiny_models.write_sentencepiece_gguf(str(tmp_path / "spm.gguf"))
    tokenizer = load_tokenizer(resolve_model(path))
    _assert_same_as_transformers(tokenizer, _transformers_tokenizer(path),
                                 [*TEXTS, f"call {tiny_models.USER_DEFINED_TOKEN} now <s> </s>"])
    assert tokenizer.encode("Hello")[0] == 1  # llama.cpp's default for sentencepiece vocabularies: add BOS
    user_defined = tokenizer.token_to_id(tiny_models.USER_DEFINED_TOKEN)
    assert user_defined in tokenizer.encode(f"a {tiny_models.USER_DEFINED_TOKEN} b")
    assert user_defined not in tokenizer.all_special_ids


def test_smollm2_gguf_tokenizer_matches_transformers(smollm2_tokenizers: tuple[Tokenizer, Any]) -> None:
    tokenizer, reference = smollm2_tokenizers
    _assert_same_as_transformers(tokenizer, reference)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    assert tokenizer.eos_token_ids == {2}
    assert tokenizer.vocab_size == 49152
    assert tokenizer.encode("<|im_start|>user")[0] == 1  # special tokens are matched whole, no BOS added


def test_smollm2_chat_template_matches_transformers(smollm2_tokenizers: tuple[Tokenizer, Any]) -> None:
    tokenizer, reference = smollm2_tokenizers
    for messages in (CONVERSATION, CONVERSATION[1:]):
        expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer.apply_chat_template(messages) == expected
    assert tokenizer.apply_chat_template(CONVERSATION[1:2]).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM")

"""Fill-in-the-middle prompts (kvloom/entrypoints/openai/fim.py) against llama.cpp's own algorithm.

The oracle is ``llama_cpp_format_prompt_infill`` below: llama.cpp's ``format_prompt_infill``
(tools/server/server-common.cpp) re-stated line by line, its FIM ids read from the GGUF with the ``gguf``
package's reader in llama-vocab.cpp's key order, not through kvloom's tokenizer. Only the text -> ids step
(llama.cpp's ``common_tokenize(vocab, text, false, false)``) is the tokenizer under test's, since both sides
must tokenize alike for the ids to be comparable.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from kvloom.entrypoints.openai.fim import FimTokens, InfillUnsupportedError, format_prompt_infill
from kvloom.loader.tokenizer import Tokenizer, load_tokenizer
from kvloom.loader.weights import resolve_model

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tiny_models  # noqa: E402

LLAMA_TOKEN_NULL = -1


class LlamaVocab:
    """The llama_vocab calls format_prompt_infill makes, from the GGUF's metadata as llama-vocab.cpp reads it::

        { LLM_KV_TOKENIZER_FIM_PRE_ID, special_fim_pre_id },
        { LLM_KV_TOKENIZER_FIM_SUF_ID, special_fim_suf_id },
        { LLM_KV_TOKENIZER_FIM_MID_ID, special_fim_mid_id },
        { LLM_KV_TOKENIZER_FIM_PAD_ID, special_fim_pad_id },
        { LLM_KV_TOKENIZER_FIM_REP_ID, special_fim_rep_id },
        { LLM_KV_TOKENIZER_FIM_SEP_ID, special_fim_sep_id },

        // deprecated
        { LLM_KV_TOKENIZER_PREFIX_ID, special_fim_pre_id },
        { LLM_KV_TOKENIZER_SUFFIX_ID, special_fim_suf_id },
        { LLM_KV_TOKENIZER_MIDDLE_ID, special_fim_mid_id },
        ...
        for (const auto & it : special_token_types) { ... if (!ml.get_key(std::get<0>(it), new_id, false)) continue;
            ... id = new_id; }
        ...
        if (ml.get_key(LLM_KV_TOKENIZER_ADD_BOS, temp, false)) { add_bos = temp; }
    """

    KEYS = (("pre", "fim_pre_token_id"), ("suf", "fim_suf_token_id"), ("mid", "fim_mid_token_id"),
            ("pad", "fim_pad_token_id"), ("rep", "fim_rep_token_id"), ("sep", "fim_sep_token_id"),
            ("pre", "prefix_token_id"), ("suf", "suffix_token_id"), ("mid", "middle_token_id"))

    def __init__(self, path: str, tokenizer: Tokenizer) -> None:
        import gguf

        reader = gguf.GGUFReader(path)

        def value(key: str) -> Any:
            field = reader.get_field(f"tokenizer.ggml.{key}")
            return None if field is None else field.contents()

        self.ids = {role: LLAMA_TOKEN_NULL for role, _ in self.KEYS}
        for role, key in self.KEYS:
            if value(key) is not None:
                self.ids[role] = int(value(key))
        self.add_bos = bool(value("add_bos_token")) if value("add_bos_token") is not None else False
        self.bos = int(value("bos_token_id"))
        self.tokenizer = tokenizer

    def common_tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        assert not add_special and not parse_special  # the only form format_prompt_infill uses
        return self.tokenizer.encode_plain(text)

    def tokenize_mixed(self, value: Any) -> list[int]:
        """tokenize_mixed(vocab, json_prompt, false, false): strings tokenized, ids kept, laid end to end."""
        if isinstance(value, str):
            return self.common_tokenize(value, False, False)
        tokens: list[int] = []
        for p in value:
            tokens += self.common_tokenize(p, False, False) if isinstance(p, str) else [p]
        return tokens


def llama_cpp_format_prompt_infill(vocab: LlamaVocab, input_prefix: Any, input_suffix: Any,
                                   input_extra: list[dict[str, Any]], n_batch: int, n_predict: int, n_ctx: int,
                                   spm_infill: bool, tokens_prompt: list[int]) -> list[int]:
    """llama.cpp's format_prompt_infill, statement by statement::

        auto tokens_prefix = tokenize_mixed(vocab, input_prefix, false, false);
        auto tokens_suffix = tokenize_mixed(vocab, input_suffix, false, false);
        if (llama_vocab_fim_rep(vocab) != LLAMA_TOKEN_NULL) {
            static const auto k_fim_repo = common_tokenize(vocab, "myproject\\n", false, false);
            extra_tokens.push_back(llama_vocab_fim_rep(vocab));
            extra_tokens.insert(extra_tokens.end(), k_fim_repo.begin(), k_fim_repo.end());
        }
        for (const auto & chunk : input_extra) {
            const std::string text     = json_value(chunk, "text",     std::string());
            const std::string filename = json_value(chunk, "filename", std::string("tmp"));
            if (llama_vocab_fim_sep(vocab) != LLAMA_TOKEN_NULL) {
                const auto k_fim_file = common_tokenize(vocab, filename + "\\n", false, false);
                extra_tokens.insert(extra_tokens.end(), llama_vocab_fim_sep(vocab));
                extra_tokens.insert(extra_tokens.end(), k_fim_file.begin(), k_fim_file.end());
            } else {
                // chunk separator in binary form to avoid confusing the AI
                static const char k_chunk_prefix_str[] = {0x0a, 0x0a, 0x2d, 0x2d, 0x2d, 0x20, 0x73, 0x6e,
                    0x69, 0x70, 0x70, 0x65, 0x74, 0x20, 0x2d, 0x2d, 0x2d, 0x0a, 0x0a, 0x00};
                static const auto k_chunk_prefix_tokens = common_tokenize(vocab, k_chunk_prefix_str, false, false);
                extra_tokens.insert(extra_tokens.end(), k_chunk_prefix_tokens.begin(), k_chunk_prefix_tokens.end());
            }
            const auto chunk_tokens = common_tokenize(vocab, text, false, false);
            extra_tokens.insert(extra_tokens.end(), chunk_tokens.begin(), chunk_tokens.end());
        }
        if (llama_vocab_fim_sep(vocab) != LLAMA_TOKEN_NULL) {
            static const auto k_fim_file = common_tokenize(vocab, "filename\\n", false, false);
            extra_tokens.insert(extra_tokens.end(), llama_vocab_fim_sep(vocab));
            extra_tokens.insert(extra_tokens.end(), k_fim_file.begin(), k_fim_file.end());
        }
        const int n_prefix_take = std::min<int>(tokens_prefix.size(),                3*(n_batch/4));
        const int n_suffix_take = std::min<int>(tokens_suffix.size(),
                                                std::max<int>(0, (n_batch/4) - (2 + tokens_prompt.size())));
        const int n_extra_take = std::min<int>(std::max<int>(0, n_ctx - (n_batch) - 2*n_predict), extra_tokens.size());
        tokens_prefix.erase(tokens_prefix.begin(), tokens_prefix.begin() + tokens_prefix.size() - n_prefix_take);
        tokens_suffix.resize(n_suffix_take);
        tokens_prefix.insert(tokens_prefix.begin(), llama_vocab_fim_pre(vocab));
        tokens_prefix.insert(tokens_prefix.end(),   tokens_prompt.begin(), tokens_prompt.end());
        tokens_suffix.insert(tokens_suffix.begin(), llama_vocab_fim_suf(vocab));
        auto embd_inp = spm_infill ? tokens_suffix : tokens_prefix;
        auto embd_end = spm_infill ? tokens_prefix : tokens_suffix;
        if (llama_vocab_get_add_bos(vocab)) {
            embd_inp.insert(embd_inp.begin(), llama_vocab_bos(vocab));
        }
        embd_inp.insert(embd_inp.begin(), extra_tokens.end() - n_extra_take, extra_tokens.end());
        embd_inp.insert(embd_inp.end(), embd_end.begin(), embd_end.end());
        embd_inp.push_back(llama_vocab_fim_mid(vocab));
        return embd_inp;
    """
    extra_tokens: list[int] = []
    tokens_prefix = vocab.tokenize_mixed(input_prefix)
    tokens_suffix = vocab.tokenize_mixed(input_suffix)
    if vocab.ids["rep"] != LLAMA_TOKEN_NULL:
        k_fim_repo = vocab.common_tokenize("myproject\n", False, False)
        extra_tokens.append(vocab.ids["rep"])
        extra_tokens.extend(k_fim_repo)
    for chunk in input_extra:
        text = chunk.get("text", "")
        filename = chunk.get("filename", "tmp")
        if vocab.ids["sep"] != LLAMA_TOKEN_NULL:
            k_fim_file = vocab.common_tokenize(filename + "\n", False, False)
            extra_tokens.append(vocab.ids["sep"])
            extra_tokens.extend(k_fim_file)
        else:
            k_chunk_prefix_str = bytes([0x0a, 0x0a, 0x2d, 0x2d, 0x2d, 0x20, 0x73, 0x6e, 0x69, 0x70, 0x70, 0x65, 0x74,
                                        0x20, 0x2d, 0x2d, 0x2d, 0x0a, 0x0a]).decode()
            extra_tokens.extend(vocab.common_tokenize(k_chunk_prefix_str, False, False))
        extra_tokens.extend(vocab.common_tokenize(text, False, False))
    if vocab.ids["sep"] != LLAMA_TOKEN_NULL:
        k_fim_file = vocab.common_tokenize("filename\n", False, False)
        extra_tokens.append(vocab.ids["sep"])
        extra_tokens.extend(k_fim_file)

    def cpp_div(a: int, b: int) -> int:  # C++ integer division truncates toward zero
        return int(a / b)

    n_prefix_take = min(len(tokens_prefix), 3 * cpp_div(n_batch, 4))
    n_suffix_take = min(len(tokens_suffix), max(0, cpp_div(n_batch, 4) - (2 + len(tokens_prompt))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))
    del tokens_prefix[:len(tokens_prefix) - n_prefix_take]
    del tokens_suffix[n_suffix_take:]
    tokens_prefix.insert(0, vocab.ids["pre"])
    tokens_prefix.extend(tokens_prompt)
    tokens_suffix.insert(0, vocab.ids["suf"])
    embd_inp = list(tokens_suffix if spm_infill else tokens_prefix)
    embd_end = list(tokens_prefix if spm_infill else tokens_suffix)
    if vocab.add_bos:
        embd_inp.insert(0, vocab.bos)
    embd_inp[0:0] = extra_tokens[len(extra_tokens) - n_extra_take:]
    embd_inp.extend(embd_end)
    embd_inp.append(vocab.ids["mid"])
    return embd_inp


def write_fim_gguf(path: str, fim_keys: dict[str, str], *, extra_tokens: list[str], add_bos: bool) -> str:
    """A tokenizer-only GGUF (llama.cpp's "gpt2" model) of the tiny BPE plus ``extra_tokens`` as control tokens;
    ``fim_keys``: tokenizer.ggml.<key> -> the extra token it names."""
    import gguf

    spec = tiny_models.train_tokenizer()
    vocab = spec.get_vocab(with_added_tokens=True)
    special = set(tiny_models.SPECIAL_TOKENS)
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])] + extra_tokens
    import json

    merges = json.loads(spec.to_str())["model"]["merges"]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in special or token in extra_tokens else 1 for token in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tiny_models.BOS_ID)
    writer.add_eos_token_id(tiny_models.EOS_ID)
    writer.add_add_bos_token(add_bos)
    for key, token in fim_keys.items():
        writer.add_uint32(f"tokenizer.ggml.{key}", tokens.index(token))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Token spellings no text lookup knows: the ids can only come from the keys.
REPO_LEVEL_KEYS = {"fim_pre_token_id": "<|a|>", "fim_suf_token_id": "<|b|>", "fim_mid_token_id": "<|c|>",
                   "fim_pad_token_id": "<|d|>", "fim_rep_token_id": "<|e|>", "fim_sep_token_id": "<|f|>"}
DEPRECATED_KEYS = {"prefix_token_id": "<|a|>", "suffix_token_id": "<|b|>", "middle_token_id": "<|c|>"}
EXTRA = ["<|a|>", "<|b|>", "<|c|>", "<|d|>", "<|e|>", "<|f|>"]

PREFIX = "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    "
SUFFIX = "\nfor i in range(10):\n    print(i, fibonacci(i))\n"
INPUT_EXTRA = [{"filename": "utils.py", "text": "The quick brown fox jumps over the lazy dog.\n"},
               {"text": "x = {\"key\": \"value\", \"list\": [1, 2, 3]}\n"}]


def _both(path: str, input_prefix: Any, input_suffix: Any, input_extra: list[dict[str, Any]], n_batch: int,
          n_predict: int, n_ctx: int, spm_infill: bool, prompt: str) -> tuple[list[int], list[int]]:
    tokenizer = load_tokenizer(resolve_model(path))
    prompt_tokens = tokenizer.encode(prompt, add_special_tokens=False)
    ours = format_prompt_infill(tokenizer, FimTokens.of(tokenizer), input_prefix, input_suffix, input_extra,
                                n_batch, n_predict, n_ctx, spm_infill, prompt_tokens)
    theirs = llama_cpp_format_prompt_infill(LlamaVocab(path, tokenizer), input_prefix, input_suffix, input_extra,
                                            n_batch, n_predict, n_ctx, spm_infill, prompt_tokens)
    return ours, theirs


@pytest.mark.parametrize(("n_batch", "n_predict", "n_ctx", "spm_infill"), [
    (2048, -1, 4096, False),   # llama-server's defaults: nothing cut
    (2048, -1, 512, False),    # a context smaller than a batch: no extra context
    (16, -1, 40, False),       # prefix cut to its last 12 tokens, suffix to none, extra to its last 26
    (32, 2, 60, False),        # the suffix keeps a few, n_predict shrinks the extra budget
    (2048, -1, 4096, True),    # --spm-infill: suffix first
], ids=["defaults", "small-context", "tight-batch", "tight-suffix", "spm"])
def test_repo_level_prompt_is_llama_cpps_token_for_token(tmp_path: Any, n_batch: int, n_predict: int, n_ctx: int,
                                                         spm_infill: bool) -> None:
    """A Qwen2.5-Coder-style file (pre/suf/mid/pad/rep/sep by GGUF key): repo name, file separators and names,
    truncation of prefix, suffix and extra context, BOS off."""
    path = write_fim_gguf(str(tmp_path / "fim.gguf"), REPO_LEVEL_KEYS, extra_tokens=EXTRA, add_bos=False)
    ours, theirs = _both(path, PREFIX, SUFFIX, INPUT_EXTRA, n_batch, n_predict, n_ctx, spm_infill, prompt="if n")
    assert ours == theirs
    ids = {token: index for index, token in enumerate(load_tokenizer(resolve_model(path)).vocabulary())}
    assert ours[-1] == ids["<|c|>"] and ours.count(ids["<|a|>"]) == ours.count(ids["<|b|>"]) == 1
    if n_ctx - n_batch - 2 * n_predict >= len(ours):
        assert ours[0] == ids["<|e|>"] and ours.count(ids["<|f|>"]) == 3  # repo, two files and the current one


@pytest.mark.parametrize("spm_infill", [False, True])
def test_snippet_separators_and_bos_as_llama_cpp_without_repo_tokens(tmp_path: Any, spm_infill: bool) -> None:
    """A CodeLlama-style file (only the deprecated prefix/suffix/middle keys, add_bos_token true): extra chunks
    joined by llama.cpp's "--- snippet ---" separator, BOS after the extra context and before the first part."""
    path = write_fim_gguf(str(tmp_path / "old.gguf"), DEPRECATED_KEYS, extra_tokens=EXTRA[:3], add_bos=True)
    ours, theirs = _both(path, PREFIX, SUFFIX, INPUT_EXTRA, 2048, -1, 4096, spm_infill, prompt="")
    assert ours == theirs
    tokenizer = load_tokenizer(resolve_model(path))
    assert tokenizer.bos_token_id in ours and "--- snippet ---" in tokenizer.decode(ours, skip_special_tokens=False)


def test_mixed_inputs_and_special_spellings_in_code(tmp_path: Any) -> None:
    """Prefix and suffix as lists of text and token ids; a FIM token's spelling inside the code stays text, as
    llama.cpp tokenizes them with parse_special=false."""
    path = write_fim_gguf(str(tmp_path / "fim.gguf"), REPO_LEVEL_KEYS, extra_tokens=EXTRA, add_bos=False)
    ours, theirs = _both(path, ["x = '<|a|>' + ", 42, "y"], [7, "\nprint(x)"], [], 2048, -1, 4096, False,
                         prompt="")
    assert ours == theirs
    pre = load_tokenizer(resolve_model(path)).fim_token_ids["pre"]
    assert ours.count(pre) == 1


def test_deprecated_keys_are_read_after_the_fim_keys(tmp_path: Any) -> None:
    """llama.cpp reads tokenizer.ggml.prefix_token_id after fim_pre_token_id, so the older key wins."""
    keys = {"fim_pre_token_id": "<|a|>", "fim_suf_token_id": "<|b|>", "fim_mid_token_id": "<|c|>",
            "prefix_token_id": "<|d|>"}
    path = write_fim_gguf(str(tmp_path / "both.gguf"), keys, extra_tokens=EXTRA, add_bos=False)
    tokenizer = load_tokenizer(resolve_model(path))
    vocab = LlamaVocab(path, tokenizer)
    assert tokenizer.fim_token_ids == {"pre": vocab.ids["pre"], "suf": vocab.ids["suf"], "mid": vocab.ids["mid"]}
    assert tokenizer.vocabulary()[tokenizer.fim_token_ids["pre"]] == "<|d|>"


def _with_tokens(tokens: list[str]) -> Tokenizer:
    backend = tiny_models.train_tokenizer()
    backend.add_special_tokens(tokens)
    return Tokenizer(backend, bos_token="<|im_start|>", eos_token="<|endoftext|>")


@pytest.mark.parametrize(("tokens", "expected"), [
    (["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"],
     {"pre": "<|fim_prefix|>", "suf": "<|fim_suffix|>", "mid": "<|fim_middle|>", "pad": "<|fim_pad|>",
      "rep": "<|repo_name|>", "sep": "<|file_sep|>"}),
    (["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<reponame>", "<file_sep>"],
     {"pre": "<fim_prefix>", "suf": "<fim_suffix>", "mid": "<fim_middle>", "pad": "<fim_pad>", "rep": "<reponame>"}),
    (["\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>", "\u2581<EOT>"],
     {"pre": "\u2581<PRE>", "suf": "\u2581<SUF>", "mid": "\u2581<MID>"}),
    (["<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"],
     {"pre": "<\uff5cfim\u2581begin\uff5c>", "suf": "<\uff5cfim\u2581hole\uff5c>",
      "mid": "<\uff5cfim\u2581end\uff5c>"}),
    (["<|prefix|>", "<|suffix|>", "<|middle|>", "[PAD]"],
     {"pre": "<|prefix|>", "suf": "<|suffix|>", "mid": "<|middle|>", "pad": "[PAD]"}),
], ids=["qwen2.5-coder", "starcoder", "codellama", "deepseek-coder", "falcon-h1-tiny-coder-kimi-k2-pad"])
def test_known_fim_token_sets_are_found_by_text(tokens: list[str], expected: dict[str, str]) -> None:
    """Without GGUF keys (an HF tokenizer), each role is found by llama-vocab.cpp's spellings; StarCoder's
    <file_sep> is not one of them, so it has no file separator (as in llama.cpp)."""
    tokenizer = _with_tokens(tokens)
    found = {role: tokenizer.id_to_token(token_id) for role, token_id in tokenizer.fim_token_ids.items()}
    assert found == expected
    fim = FimTokens.of(tokenizer)
    assert (fim.pre, fim.suf, fim.mid) == tuple(tokenizer.token_to_id(expected[r]) for r in ("pre", "suf", "mid"))


def test_a_vocabulary_without_fim_tokens_is_refused_in_llama_servers_words() -> None:
    with pytest.raises(InfillUnsupportedError, match=r"Infill is not supported by this model: prefix token is "
                                                      r"missing\. suffix token is missing\. middle token is missing"):
        FimTokens.of(_with_tokens([]))
    with pytest.raises(InfillUnsupportedError, match=r"model: middle token is missing\. \("):
        FimTokens.of(_with_tokens(["<|fim_prefix|>", "<|fim_suffix|>"]))

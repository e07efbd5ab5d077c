"""The tokenizer: a `tokenizers.Tokenizer` plus the special tokens and chat template around it.

Built from a HF directory's tokenizer.json (+ tokenizer_config.json, special_tokens_map.json,
generation_config.json, chat_template.jinja) or from a GGUF's tokenizer metadata, and made to give
the same ids, text and chat prompts as transformers' AutoTokenizer for the same files. transformers
itself is not imported here: it is slow to import, and only the tests' oracle.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from kvloom.loader.gguf import read_gguf
from kvloom.loader.weights import ModelSource

CHAT_ROLES = ("system", "user", "assistant", "tool")
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

# Fill-in-the-middle tokens, by llama.cpp's names (llama-vocab.cpp's special_fim_*_id).
FIM_ROLES = ("pre", "suf", "mid", "pad", "rep", "sep")
# The GGUF keys of each, in the order llama.cpp reads them (a later key overwrites an earlier): the fim_*
# keys, then the deprecated prefix / suffix / middle ones.
FIM_GGUF_KEYS = (("pre", "tokenizer.ggml.fim_pre_token_id"), ("suf", "tokenizer.ggml.fim_suf_token_id"),
                 ("mid", "tokenizer.ggml.fim_mid_token_id"), ("pad", "tokenizer.ggml.fim_pad_token_id"),
                 ("rep", "tokenizer.ggml.fim_rep_token_id"), ("sep", "tokenizer.ggml.fim_sep_token_id"),
                 ("pre", "tokenizer.ggml.prefix_token_id"), ("suf", "tokenizer.ggml.suffix_token_id"),
                 ("mid", "tokenizer.ggml.middle_token_id"))
# A role no key named is found by the token's text (llama-vocab.cpp's "auto-detect special tokens by text"):
# Qwen2.5-Coder, StarCoder / Granite, DeepSeek-Coder, CodeLlama, GLM-4.5, Falcon-H1-Tiny-Coder and Kimi-K2
# spellings.
FIM_TOKEN_TEXTS: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>", "\u2581<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>", "\u2581<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>", "\u2581<MID>",
            "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}


class Tokenizer:
    """Encode, decode and render chat prompts; ids match transformers' AutoTokenizer for the same model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        fim_token_ids: dict[str, int] | None = None,
    ) -> None:
        """``fim_token_ids``: the fill-in-the-middle tokens a GGUF's keys name, by role (FIM_ROLES); a role
        none names is looked up by its token's text (``fim_token_ids``)."""
        self.backend = backend
        named = {"bos_token": bos_token, "eos_token": eos_token, "unk_token": unk_token,
                 "pad_token": pad_token}
        # Named special tokens, offered to chat templates as variables (bos_token, eos_token, ...).
        self.special_tokens: dict[str, str] = {name: tok for name, tok in named.items() if tok is not None}
        self.chat_template = chat_template
        self._bos_token_id = self._special_id("bos_token")
        self._eos_token_id = self._special_id("eos_token")
        self._pad_token_id = self._special_id("pad_token")
        self._eos_token_ids = {i for i in (self._eos_token_id, *extra_eos_token_ids) if i is not None}
        added = backend.get_added_tokens_decoder()
        self._all_special_ids = {i for i, token in added.items() if token.special}
        self._all_special_ids |= {i for i in map(self._special_id, self.special_tokens) if i is not None}
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._named_fim_token_ids = dict(fim_token_ids or {})
        self._fim_token_ids: dict[str, int] | None = None
        self._plain_backend: tokenizers.Tokenizer | None = None

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: the eos token and generation_config.json's / GGUF's eot ids."""
        return set(self._eos_token_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (transformers' len(tokenizer))."""
        return self._vocab_size

    @property
    def all_special_ids(self) -> set[int]:
        """Ids of the named special tokens and of every added token marked special (skipped by decode)."""
        return set(self._all_special_ids)

    @property
    def add_bos_token(self) -> bool:
        """Whether encoding with special tokens puts BOS first (llama.cpp's llama_vocab_get_add_bos)."""
        bos = self._bos_token_id
        return bos is not None and self.encode("a", add_special_tokens=True)[:1] == [bos] != self.encode(
            "a", add_special_tokens=False)[:1]

    @property
    def fim_token_ids(self) -> dict[str, int]:
        """The fill-in-the-middle tokens, role (FIM_ROLES: pre, suf, mid, pad, rep, sep) -> id, as llama.cpp finds
        them: a GGUF's tokenizer.ggml.fim_*_token_id keys (and the deprecated prefix / suffix / middle ones), then
        by text for each role still missing (FIM_TOKEN_TEXTS; of several, the lowest id). Roles not found are
        absent."""
        if self._fim_token_ids is None:
            found = dict(self._named_fim_token_ids)
            vocab = self.backend.get_vocab(with_added_tokens=True)
            for role, texts in FIM_TOKEN_TEXTS.items():
                if role not in found:
                    ids = [vocab[text] for text in texts if text in vocab]
                    if ids:
                        found[role] = min(ids)
            self._fim_token_ids = found
        return dict(self._fim_token_ids)

    def encode_plain(self, text: str) -> list[int]:
        """``text`` as ids with no BOS / EOS added and special tokens' spellings read as plain text (llama.cpp's
        common_tokenize with parse_special=false: code that holds "<|fim_prefix|>" is not a FIM token)."""
        if self._plain_backend is None:
            # A second backend: the switch is per tokenizer, and the first one serves other threads.
            plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            self._plain_backend = plain
        return self._plain_backend.encode(text, add_special_tokens=False).ids

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def vocabulary(self) -> list[str]:
        """Every token as the vocabulary stores it (byte-level 'Ġ' for a space, sentencepiece '▁'), by
        id; "" for an id no token has. Grammar backends build their token tables from this."""
        encoded = [""] * self._vocab_size
        for token, token_id in self.backend.get_vocab(with_added_tokens=True).items():
            if 0 <= token_id < self._vocab_size:
                encoded[token_id] = token
        return encoded

    def backend_json(self) -> str:
        """The tokenizers library's JSON of the whole tokenizer (model, pre-tokenizer, decoder): how its
        vocabulary is encoded, for grammar backends to detect."""
        return self.backend.to_str()

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt for a conversation, rendered like transformers' apply_chat_template(tokenize=False).

        template_kwargs are extra template variables (e.g. enable_thinking=False).
        """
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError("this model has no chat template; pass chat_template=... or send a plain "
                             "prompt instead of chat messages")
        context = {**self.special_tokens, **template_kwargs}
        checked = _validate_messages(messages)
        compiled = _compile_chat_template(template)
        knows_calls, knows_results = template_tool_sections(template)
        try:
            return compiled.render(messages=tool_history_as_text(checked, knows_calls, knows_results), tools=tools,
                                   documents=None, add_generation_prompt=add_generation_prompt, **context)
        except _jinja_errors() as e:
            error = e
        if (knows_calls or knows_results) and _has_tool_history(checked):
            # A template's own tool section may refuse a history (Llama 3.1's allows one call per turn): the
            # history is rendered again with its tool calls and results written as text.
            try:
                return compiled.render(messages=tool_history_as_text(checked, False, False), tools=tools,
                                       documents=None, add_generation_prompt=add_generation_prompt, **context)
            except _jinja_errors():
                pass
        raise ValueError(f"chat template failed to render: {error}") from None


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages as the template expects them: role + string content, None-valued keys dropped."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be a dict with 'role' and 'content', "
                             f"got {type(message).__name__}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{index}] has role {role!r}; allowed roles: {list(CHAT_ROLES)}")
        # Like transformers: OpenAI clients send content=None / tool_calls=None, which templates mishandle.
        message = {key: value for key, value in message.items() if value is not None}
        content = message.get("content")
        if isinstance(content, list):
            # Image parts ({"type": "image"}, from kvloom.multimodal.chat) stay parts: the template places them.
            message["content"] = content if any(isinstance(p, dict) and p.get("type") == "image" for p in content) \
                else _join_text_parts(content, index)
        elif content is None:
            if not (role == "assistant" and message.get("tool_calls")):
                raise ValueError(f"messages[{index}] ({role}) has no 'content'")
        elif not isinstance(content, str):
            raise ValueError(f"messages[{index}] content must be a string or a list of text parts, "
                             f"got {type(content).__name__}")
        if role == "assistant" and "tool_calls" in message:
            message = _checked_tool_calls(message, index)
        checked.append(message)
    return checked


def _checked_tool_calls(message: dict[str, Any], index: int) -> dict[str, Any]:
    """An assistant message with tool calls as templates expect it: content "" when the client sent none (OpenAI
    sends null), each call's arguments a dict (transformers' convention; OpenAI sends a JSON string)."""
    calls = message["tool_calls"]
    if not isinstance(calls, list):
        raise ValueError(f"messages[{index}].tool_calls must be a list of {{'id', 'type': 'function', "
                         f"'function': {{'name', 'arguments'}}}}, got {type(calls).__name__}")
    if not calls:
        message = {key: value for key, value in message.items() if key != "tool_calls"}
        return {**message, "content": message.get("content", "")}
    checked_calls = []
    for number, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"messages[{index}].tool_calls[{number}] must be {{'id', 'type': 'function', "
                             f"'function': {{'name': str, 'arguments': str}}}}, got {call!r:.120}")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                pass  # kept as the client's text: the model may have written broken JSON, and it is history
        checked_calls.append({**call, "type": call.get("type", "function"),
                              "function": {**function, "arguments": arguments}})
    return {**message, "content": message.get("content", ""), "tool_calls": checked_calls}


def template_tool_sections(template: str) -> tuple[bool, bool]:
    """(whether the template writes an assistant's ``tool_calls``, whether it writes ``role: "tool"`` results),
    read from its source: the names it tests for."""
    knows_calls = "tool_calls" in template
    knows_results = re.search(r"""(['"])(tool|ipython|tool_results?)\1""", template) is not None
    return knows_calls, knows_results


def _has_tool_history(messages: list[dict[str, Any]]) -> bool:
    return any(message["role"] == "tool" or "tool_calls" in message for message in messages)


def tool_history_as_text(messages: list[dict[str, Any]], knows_calls: bool,
                         knows_results: bool) -> list[dict[str, Any]]:
    """The history for a template without a tool section, in the Hermes format (what ``--tool-call-parser
    hermes`` reads back): an assistant's calls appended to its content as ``<tool_call>\\n{"name": ...,
    "arguments": {...}}\\n</tool_call>`` blocks; tool results as a user message of ``<tool_response>\\n...\\n
    </tool_response>`` blocks, consecutive results (and a user message right after them) in one message so that
    templates which want user and assistant turns to alternate accept it."""
    if knows_calls and knows_results:
        return messages
    rendered: list[dict[str, Any]] = []
    merge_into_previous = False  # the previous message is a user message made of tool results
    for message in messages:
        if not knows_calls and message["role"] == "assistant" and "tool_calls" in message:
            blocks = [f"<tool_call>\n{_call_json(call)}\n</tool_call>" for call in message["tool_calls"]]
            content = message.get("content") or ""
            text = "\n".join([content, *blocks] if content else blocks)
            message = {key: value for key, value in message.items() if key != "tool_calls"}
            message["content"] = text
        elif not knows_results and message["role"] == "tool":
            text = f"<tool_response>\n{message.get('content', '')}\n</tool_response>"
            if merge_into_previous:
                rendered[-1] = {**rendered[-1], "content": rendered[-1]["content"] + "\n" + text}
            else:
                rendered.append({"role": "user", "content": text})
            merge_into_previous = True
            continue
        elif merge_into_previous and message["role"] == "user" and isinstance(message.get("content"), str):
            rendered[-1] = {**rendered[-1], "content": rendered[-1]["content"] + "\n" + message["content"]}
            merge_into_previous = False
            continue
        merge_into_previous = False
        rendered.append(message)
    return rendered


def _call_json(call: dict[str, Any]) -> str:
    function = call["function"]
    arguments = function.get("arguments", {})
    return json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)


def _join_text_parts(parts: list[Any], index: int) -> str:
    """OpenAI content parts [{"type": "text", "text": ...}, ...] -> one string, newline-joined like vLLM."""
    texts = []
    for part in parts:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise ValueError(f"messages[{index}] content parts must be {{'type': 'text', 'text': str}}; "
                             f"only text is supported, got {part!r:.80}")
        texts.append(part["text"])
    return "\n".join(texts)


def _jinja_errors() -> tuple[type[Exception], ...]:
    import jinja2

    return (jinja2.TemplateError,)


@lru_cache(maxsize=16)
def _compile_chat_template(template: str) -> Any:
    """A compiled template in the environment transformers renders chat templates in."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson HTML-escapes; chat templates want plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template is not valid Jinja: {e}") from None


def load_tokenizer(source: ModelSource) -> Tokenizer:
    if source.kind == "hf_dir":
        return _load_hf_dir(source.path)
    if source.kind == "gguf":
        return _load_gguf(source.path)
    raise ValueError(f"unknown model source kind {source.kind!r}; expected 'hf_dir' or 'gguf'")


# ---------------------------------------------------------------------------------------------
# HF directories


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            value = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    return value if isinstance(value, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _load_hf_dir(path: str) -> Tokenizer:
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        raise ValueError(f"{path} has no tokenizer.json; kvloom needs a fast (tokenizers-library) tokenizer")
    try:
        backend = tokenizers.Tokenizer.from_file(tokenizer_file)
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception for any parse error
        raise ValueError(f"{tokenizer_file} is not a valid tokenizers-library tokenizer ({e}); it may be "
                         "truncated or corrupt") from None
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    special_map = _read_json(os.path.join(path, "special_tokens_map.json"))
    special = {name: _token_content(config.get(name, special_map.get(name))) for name in _SPECIAL_TOKEN_NAMES}

    # Whether BOS/EOS are added is tokenizer.json's post-processor's call alone: transformers 5 ignores
    # tokenizer_config.json's add_bos_token/add_eos_token when a tokenizer.json exists.
    generation = _read_json(os.path.join(path, "generation_config.json"))
    generation_eos = generation.get("eos_token_id")
    extra_eos = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
    return Tokenizer(backend, **special, extra_eos_token_ids=extra_eos,
                     chat_template=_hf_chat_template(path, config))


def _hf_chat_template(path: str, config: dict[str, Any]) -> str | None:
    """chat_template.jinja, else chat_template.json's, else tokenizer_config.json's ("default" if named)."""
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = _read_json(os.path.join(path, "chat_template.json")).get(
        "chat_template", config.get("chat_template"))
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _bos_eos_processor(
    backend: tokenizers.Tokenizer, bos: str | None, eos: str | None
) -> processors.PostProcessor:
    """[bos] $A [eos], as transformers' TokenizersBackend.update_post_processor builds it."""
    bos_id = backend.token_to_id(bos) if bos is not None else None
    eos_id = backend.token_to_id(eos) if eos is not None else None
    add_bos, add_eos = bos_id is not None, eos_id is not None
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
    special = [(bos, bos_id)] if add_bos else []
    special += [(eos, eos_id)] if add_eos else []
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


# ---------------------------------------------------------------------------------------------
# GGUF
#
# A GGUF stores the vocabulary, merges and special ids as metadata under llama.cpp's names. We build
# the tokenizer transformers builds from them (integrations/gguf/gguf_tokenizer_mapping.py).

_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED = 3, 4

# Pre-tokenizer splits for tokenizer.ggml.pre values of byte-level BPE files; anything else
# gets GPT-2's split. SmolLM's ("smollm") is GPT-2's plus single digits, which its vocabulary
# (no multi-digit tokens) already implies.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2 / Qwen2.5 (and the distills on their vocabulary): Llama 3's split with single digits.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5: Qwen2's with combining marks kept in words.
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o's o200k split (Llama 4, MiniMax-M2).
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> split, as llama.cpp's llama-vocab.cpp groups the names.
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
}


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells every token with these)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# Built GGUF tokenizers kept on disk (KVLOOM_CACHE_DIR/tokenizers/<digest>.json), the newest this many.
GGUF_CACHE_KEEP = 8


def _load_gguf(path: str) -> Tokenizer:
    """The GGUF's tokenizer; built once per file and kept in kvloom's cache: building a 128k vocabulary's BPE from
    the header's token and merge lists takes ~0.3-0.5 s of a start, reading it back as JSON a third of that."""
    entry = _gguf_cache_entry(path)
    if entry is not None and entry.is_file():
        try:
            spec = json.loads(entry.read_text(encoding="utf-8"))
            return Tokenizer(tokenizers.Tokenizer.from_str(spec["backend"]), **spec["special"],
                             extra_eos_token_ids=spec["extra_eos_token_ids"], chat_template=spec["chat_template"],
                             fim_token_ids=spec["fim_token_ids"])
        except Exception:  # noqa: BLE001 - a partial or foreign entry (tokenizers raises a bare Exception): rebuild
            pass
    tokenizer = _build_gguf(path)
    if entry is not None:
        _store_gguf_entry(entry, tokenizer)
    return tokenizer


def _gguf_cache_entry(path: str) -> Path | None:
    """The cache file of a GGUF's tokenizer: keyed by the file (real path, size, modification time), this module's
    source and the versions of kvloom and tokenizers; None when the file cannot be read."""
    from kvloom import envs
    from kvloom.version import __version__

    try:
        stat = os.stat(path)
        with open(__file__, "rb") as f:
            source = f.read()
    except OSError:
        return None
    key = json.dumps([os.path.realpath(path), stat.st_size, stat.st_mtime_ns, __version__, tokenizers.__version__,
                      hashlib.sha256(source).hexdigest()])
    return envs.cache_dir() / "tokenizers" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _store_gguf_entry(entry: Path, tokenizer: Tokenizer) -> None:
    """Write the entry whole (a temporary file renamed) and keep the newest GGUF_CACHE_KEEP; a cache that cannot be
    written (read-only, full) is skipped: the next start builds the tokenizer again."""
    spec = {"backend": tokenizer.backend.to_str(), "special": tokenizer.special_tokens,
            "extra_eos_token_ids": sorted(tokenizer.eos_token_ids - {tokenizer.eos_token_id}),
            "chat_template": tokenizer.chat_template, "fim_token_ids": tokenizer._named_fim_token_ids}
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        partial = entry.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(spec), encoding="utf-8")
        partial.replace(entry)
        entries = sorted(entry.parent.glob("*.json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in entries[GGUF_CACHE_KEEP:]:
            old.unlink(missing_ok=True)
    except OSError:
        pass


def _build_gguf(path: str) -> Tokenizer:
    meta = read_gguf(path).metadata
    tokens: list[str] | None = meta.get("tokenizer.ggml.tokens")
    kind = meta.get("tokenizer.ggml.model")
    if not tokens:
        raise ValueError(f"{path}: GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported; "
                         "supported: ['gpt2', 'llama']")
    # Older files have no add_bos flag, and llama.cpp adds BOS to sentencepiece vocabularies by default.
    add_bos_default = kind == "llama"

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    special = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
               "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")}
    try:
        backend = _byte_level_bpe(tokens, meta) if kind == "gpt2" else _sentencepiece_bpe(tokens, meta)
        _add_special_tokens(backend, tokens, meta, kind, [t for t in special.values() if t is not None])
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception when it refuses
        raise ValueError(f"{path}: the GGUF tokenizer is corrupt ({e})") from None
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = _bos_eos_processor(
        backend, special["bos_token"] if add_bos else None, special["eos_token"] if add_eos else None)
    # llama.cpp also stops on end-of-turn / end-of-message tokens (Llama 3's <|eot_id|>, <|eom_id|>).
    extra_eos = [meta[key] for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                 if key in meta]
    return Tokenizer(backend, **special, extra_eos_token_ids=extra_eos,
                     chat_template=meta.get("tokenizer.chat_template"), fim_token_ids=_gguf_fim_token_ids(meta, tokens))


def _gguf_fim_token_ids(meta: dict[str, Any], tokens: list[str]) -> dict[str, int]:
    """The FIM tokens the GGUF's keys name (FIM_GGUF_KEYS, in llama.cpp's order); an id outside the vocabulary is
    skipped, as llama.cpp does ("bad special token")."""
    found: dict[str, int] = {}
    for role, key in FIM_GGUF_KEYS:
        token_id = meta.get(key)
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            found[role] = token_id
    return found


def _merges(meta: dict[str, Any]) -> list[tuple[str, str]] | None:
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        return None
    pairs = [merge.split(" ") for merge in merges]
    return [(pair[0], pair[1]) for pair in pairs if len(pair) == 2]


def _byte_level_bpe(tokens: list[str], meta: dict[str, Any]) -> tokenizers.Tokenizer:
    """GPT-2-style byte-level BPE (llama.cpp's "gpt2" tokenizer model: SmolLM, Llama 3, ...)."""
    spelling = _byte_to_unicode()
    alphabet = set(spelling.values())
    # A token written outside the byte alphabet (a raw space, say) is respelled in it, as transformers does.
    vocab = {
        (tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))): index
        for index, tok in enumerate(tokens)
    }
    merges = _merges(meta)
    if merges is None:
        raise ValueError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None,
                                              continuing_subword_prefix="", end_of_word_suffix="",
                                              fuse_unk=False))
    split = _PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], meta: dict[str, Any]) -> tokenizers.Tokenizer:
    """SentencePiece-style BPE with byte fallback (llama.cpp's "llama" tokenizer model: Llama 2, Mistral)."""
    vocab = {tok: index for index, tok in enumerate(tokens)}
    merges = _merges(meta)
    if merges is None:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ValueError("GGUF sentencepiece tokenizer has neither merges nor one score per token")
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                                              dropout=None))
    # Llama 2 and Mistral prefix the text with a space; Gemma's files say not to (add_space_prefix false).
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", split=False,
                                                     prepend_scheme="first" if prefix else "never")
    backend.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(content=" ", left=1)] if prefix else []),
    ])
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a sentencepiece vocabulary implies: each split of a token into two tokens, best first.

    Same order as transformers' generate_merges, ties included (Python's sort is stable).
    """
    merges = []
    for merge, score in scores.items():
        local = [(merge[:i], merge[i:], score) for i in range(1, len(merge))
                 if merge[:i] in vocab and merge[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(backend: tokenizers.Tokenizer, tokens: list[str], meta: dict[str, Any], kind: str,
                        named: list[str]) -> None:
    """Control tokens (and the named bos/eos/unk/pad) become special added tokens, user-defined ones
    plain added tokens, so both are matched whole in text instead of being cut into pieces."""
    # Files without token types have no control or user-defined tokens to add.
    token_types = meta.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError("GGUF tokenizer.ggml.token_type does not have one entry per token")
    # In a byte-level vocabulary a "control" token spelled outside the byte alphabet is a llama.cpp
    # mislabel; transformers skips it, and so do we.
    alphabet = set(_byte_to_unicode().values()) if kind == "gpt2" else None
    control = [tok for tok, kind_id in zip(tokens, token_types, strict=True)
               if kind_id == _TOKEN_TYPE_CONTROL and (alphabet is None or set(tok) <= alphabet)]
    backend.add_special_tokens([AddedToken(tok, normalized=False, special=True)
                                for tok in dict.fromkeys([*control, *named])])
    vocab = backend.get_vocab()
    user_defined = [AddedToken(tok, normalized=False, special=False)
                    for tok, kind_id in zip(tokens, token_types, strict=True)
                    if kind_id == _TOKEN_TYPE_USER_DEFINED and tok in vocab]
    if user_defined:
        backend.add_tokens(user_defined)

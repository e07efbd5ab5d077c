"""The xgrammar backend: JSON schemas, regexes, choices, EBNF grammars and structural tags.

xgrammar needs the vocabulary as bytes: its TokenizerInfo is built from kvloom's tokenizer (HF
tokenizer.json or a GGUF's vocabulary, both held as a ``tokenizers.Tokenizer``), with the model's
logits width as the vocabulary size and the engine's EOS ids as the grammar's stop tokens.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from kvloom.loader.tokenizer import Tokenizer
from kvloom.sampling_params import StructuredOutputsParams
from kvloom.structured_output.backend import GrammarMatcher, StructuredOutputBackend


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of ``tokenizer``: the vocabulary type (byte-level BPE, byte-fallback
    sentencepiece, raw) is detected from the tokenizer's JSON as ``TokenizerInfo.from_huggingface``
    does for a fast tokenizer. ``vocab_size``: the model's logits width (ids past the tokenizer's are
    never allowed)."""
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend_json())
    return xgr.TokenizerInfo(tokenizer.vocabulary(), metadata["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=stop_token_ids or None,
                             add_prefix_space=metadata["add_prefix_space"])


def _json_text(value: str | dict[str, Any]) -> str:
    if isinstance(value, dict):
        return json.dumps(value)
    try:
        json.loads(value)
    except json.JSONDecodeError as error:
        raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
    return value


def choice_grammar(choices: list[str]) -> str:
    """EBNF for "exactly one of the strings" (each as a JSON-escaped literal, which EBNF reads alike)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


class XgrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for accepted, token_id in enumerate(token_ids):
            if not self.matcher.accept_token(token_id):
                if accepted:
                    self.matcher.rollback(accepted)
                return False
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)


# xgrammar (0.2.8) writes a length-bounded string's characters (minLength / maxLength) as [^"\\\r\n], which lets
# control characters through, where JSON allows none unescaped (its unbounded strings exclude \0-\x1f): a
# sampled tab or \x01 then made output json.loads refuses. The class is rewritten in the grammar's EBNF.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


def json_schema_grammar(schema: str, any_whitespace: bool) -> xgr.Grammar:
    """The grammar of a JSON schema whose every string character is one JSON allows unescaped."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace)
    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        # One compile thread inside xgrammar: the manager already compiles off the engine thread, and
        # the machine's cores belong to the model.
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _grammar(self, params: StructuredOutputsParams) -> xgr.Grammar | str:
        """The xgrammar Grammar of the constraint (parsing only), or "json_object" for the builtin."""
        kind = params.kind
        whitespace = not params.disable_any_whitespace
        try:
            if kind == "json":
                return json_schema_grammar(_json_text(params.json), whitespace)
            if kind == "json_object":
                return json_schema_grammar('{"type": "object"}', whitespace)
            if kind == "regex":
                return xgr.Grammar.from_regex(params.regex)
            if kind == "choice":
                return xgr.Grammar.from_ebnf(choice_grammar(list(params.choice)))
            if kind == "grammar":
                return xgr.Grammar.from_ebnf(params.grammar)
            return xgr.Grammar.from_structural_tag(params.structural_tag)
        except ValueError:
            raise
        except Exception as error:  # noqa: BLE001 - xgrammar reports every parse error as a RuntimeError
            raise ValueError(f"structured_outputs.{kind} is not valid: {_clean(error)}") from None

    def validate(self, params: StructuredOutputsParams) -> None:
        self._grammar(params)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        grammar = self._grammar(params)
        try:
            return self.compiler.compile_grammar(grammar)
        except Exception as error:  # noqa: BLE001 - as above
            raise ValueError(f"structured_outputs.{params.kind} does not compile: {_clean(error)}") from None

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> XgrammarMatcher:
        return XgrammarMatcher(xgr.GrammarMatcher(compiled))


def _clean(error: BaseException) -> str:
    """xgrammar's message without its log prefix ("[time] path/file.cc:123: ")."""
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(error).strip())

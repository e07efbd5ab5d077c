"""SamplingParams: vLLM's fields, defaults and validation."""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field, fields
from typing import Any

from kvloom.pooling_params import PoolingParams

# vLLM's max_logprobs default: the most logprobs / prompt_logprobs a request may ask for, offline (LLM)
# and served (the default of the server's --max-logprobs).
MAX_LOGPROBS = 20

_SAMPLING_EPS = 1e-5


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's names): exactly one of json (a JSON schema, as a dict or its
    JSON text), regex, choice (the output is one of the strings), grammar (EBNF as xgrammar reads it),
    json_object (any JSON object) or structural_tag (xgrammar's structural tag, as JSON text)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    # JSON output without the optional whitespace between tokens (vLLM's name).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {list(STRUCTURED_OUTPUT_KINDS)}, "
                             f"got {given or 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or JSON text), "
                             f"got {type(value).__name__}")
        if kind in ("regex", "grammar", "structural_tag") and (not isinstance(value, str) or not value):
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got {value!r}")
        if kind == "choice" and (not isinstance(value, (list, tuple)) or not value
                                 or not all(isinstance(c, str) for c in value)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {value!r}")
        if kind == "json_object" and value is not True:
            raise ValueError(f"structured_outputs.json_object must be True, got {value!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be True or False, "
                             f"got {self.disable_any_whitespace!r}")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of STRUCTURED_OUTPUT_KINDS."""
        return next(name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False))


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names)."""

    CUMULATIVE = 0  # everything so far, at every step
    DELTA = 1  # only what this step added: new token ids, new text, new logprobs
    FINAL_ONLY = 2  # one output, the whole completion, when the request finishes


@dataclass
class SamplingParams:
    """How to sample one request's completions (vLLM's names, defaults and meanings).

    temperature 0 means greedy; top_k -1 or 0 means off; top_p 1 means off; min_p 0 means off.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Logits processors (vLLM's fields): token id -> bias added to its logit (OpenAI's -100..100); the only
    # token ids a completion may take; words whose last token is banned where the output ends with the
    # rest of the word's tokens (with and without a leading space).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    # bad_words tokenized (InputProcessor.process fills it: the tokenizer lives there): each a token id
    # sequence whose last token is banned after its prefix.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False)
    # An embedding request (LLM.embed, /v1/embeddings) is a one-token greedy request whose prompt's hidden
    # states the runner pools: its resolved PoolingParams (kvloom/pooling_params.py); None for generation.
    pooling: PoolingParams | None = field(default=None, init=False, repr=False)
    # stop_token_ids as a set, for the per-token stop check and the min_tokens mask.
    all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)

    def __new__(cls, *args: Any, **kwargs: Any) -> SamplingParams:
        # An unknown keyword is a user error with a clear message, not a TypeError from dataclasses.
        unknown = sorted(set(kwargs) - _FIELD_NAMES)
        if unknown:
            raise ValueError(f"SamplingParams got unknown argument(s) {unknown}; allowed: {sorted(_FIELD_NAMES)}")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        self.stop = _str_list("stop", self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 1 << 31:
            self.top_k = 0  # larger than any vocabulary: no filtering
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other knobs would not change the argmax.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.all_stop_token_ids = set(self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def _verify(self) -> None:
        _int("n", self.n, 1)
        _num("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _num("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _num("repetition_penalty", self.repetition_penalty, 0.0, None, low_open=True)
        _num("temperature", self.temperature, 0.0, None)
        _num("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k!r}")
        _num("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _int("seed", self.seed, None)
            if not -(1 << 63) <= self.seed < (1 << 63):
                raise ValueError(f"seed must fit in a signed 64-bit integer, got {self.seed}")
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1)
        _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, 0)
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"stop_token_ids must be a list of non-negative integers, "
                                 f"got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, "
                             f"got {type(self.structured_outputs).__name__}")
        self._verify_logits_processors()
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    def _verify_logits_processors(self) -> None:
        """logit_bias, allowed_token_ids and bad_words (their vocabulary bounds: InputProcessor.process)."""
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias in [-100, 100], got {bias!r}")
            for token, value in bias.items():
                if not _is_token_id(token):
                    raise ValueError(f"logit_bias keys must be non-negative integer token ids, got {token!r}")
                if (not isinstance(value, (int, float)) or isinstance(value, bool) or value != value
                        or not -100 <= value <= 100):
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} "
                                     f"for token {token}")
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, (list, tuple)) or not allowed
                                    or not all(_is_token_id(t) for t in allowed)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of non-negative integer token ids, "
                             f"got {allowed!r}")
        words = self.bad_words
        if words is not None and (not isinstance(words, (list, tuple))
                                  or not all(isinstance(w, str) and w.strip() for w in words)):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {words!r}")

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether every prompt position must be computed (no prefix-cache hit): prompt logprobs, and MEAN /
        CLS pooling (LAST reads the last position, which a prefix-cache hit always recomputes)."""
        return self.prompt_logprobs is not None or (self.pooling is not None
                                                    and self.pooling.pooling_type != "LAST")

    @property
    def has_logits_processors(self) -> bool:
        """Whether logit_bias, allowed_token_ids or bad_words change this request's logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.init)
        return f"SamplingParams({shown})"


def _str_list(name: str, value: Any) -> list[str]:
    """None, a string or a list/tuple of strings, as a list; each string non-empty."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if items is None or not all(isinstance(item, str) and item for item in items):
        raise ValueError(f"{name} must be a non-empty string or a list of non-empty strings, got {value!r}")
    return items


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _int(name: str, value: Any, minimum: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


def _num(name: str, value: Any, low: float | None, high: float | None, low_open: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        bound = f"greater than {low}" if low_open else f"at least {low}"
        raise ValueError(f"{name} must be {bound}" + (f" and at most {high}" if high is not None else "")
                         + f", got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be at most {high}, got {value}")


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams) if f.init)

"""Speculative decoding's settings (vLLM's ``speculative_config``), validated into one frozen object."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvloom.config.compat import speculative_values


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``): which proposer, and how many tokens it drafts.

    Every proposer runs in the model runner after each step: ``ngram`` looks drafts up in the request's own
    tokens; ``draft_model``, ``eagle`` and ``eagle3`` run a second model (``model``).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 1
    model: str | None = None  # the draft model or EAGLE head (a HF directory or .gguf file)
    max_model_len: int | None = None  # no drafts proposed at or past this position (the draft's own limit)
    # No drafts in a step while this many requests (or more) are running (vLLM's key). Without it the policy's
    # cost model decides (spec_decode/policy.py), which at large batches comes to the same.
    disable_by_batch_size: int | None = None
    # "int8": the draft model's or EAGLE head's projections (and a head's own LM head) stored as int8 per row,
    # quantized as loaded: a guess at batch 1 reads half the bytes.
    quantization: str | None = None

    METHODS = ("ngram", "draft_model", "eagle", "eagle3")
    MODEL_METHODS = ("draft_model", "eagle", "eagle3")
    NOT_YET = ("medusa", "mtp")

    @property
    def uses_draft_model(self) -> bool:
        """True when the drafts come from a second model (whose own KV needs lookahead slots), not n-gram lookup."""
        return self.method in self.MODEL_METHODS

    @classmethod
    def from_engine_args(cls, config: dict[str, Any] | str | None, speculative_model: str | None,
                         num_speculative_tokens: int | None, speculative_max_model_len: int | None = None,
                         speculative_disable_by_batch_size: int | None = None) -> SpeculativeConfig | None:
        """vLLM's dict / JSON, or the seeds' ``speculative_model`` + ``num_speculative_tokens`` (+
        ``speculative_max_model_len``, ``speculative_disable_by_batch_size``); None: off."""
        if isinstance(config, str):
            try:
                config = json.loads(config) if config.strip() else None
            except json.JSONDecodeError:
                raise ValueError(f"speculative_config must be a JSON object such as "
                                 f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}', "
                                 f"got {config!r}") from None
        if config is not None and not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict or a JSON object, got {type(config).__name__}")
        values = speculative_values(config, speculative_model, num_speculative_tokens, speculative_max_model_len,
                                    speculative_disable_by_batch_size)
        if not values:
            return None
        allowed = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
                   "max_model_len", "disable_by_batch_size", "quantization"}
        unknown = sorted(set(values) - allowed)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
        model = values.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError(f"speculative_config: model must be a path to a draft model or EAGLE head, got {model!r}")
        method = values.get("method")
        if method is None and model is not None:
            method = _method_from_model_name(model)  # vLLM's shorthand: a model without a method
        if method in cls.NOT_YET:
            raise ValueError(f"speculative_config: method {method!r} is not supported yet; supported: "
                             f"{list(cls.METHODS)}")
        if method not in cls.METHODS:
            raise ValueError(f"speculative_config: method must be one of {list(cls.METHODS)}, got {method!r}")
        k = values.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        max_len = values.get("max_model_len")
        if max_len is not None and (not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1):
            raise ValueError(f"speculative_config: max_model_len (speculative_max_model_len) must be an integer "
                             f">= 1, got {max_len!r}")
        disable = values.get("disable_by_batch_size")
        if disable is not None and (not isinstance(disable, int) or isinstance(disable, bool) or disable < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size (speculative_disable_by_batch_size) must "
                             f"be an integer >= 1, got {disable!r}")
        quantization = values.get("quantization")
        if quantization is not None and quantization != "int8":
            raise ValueError(f"speculative_config: quantization must be 'int8' (the draft's projections stored as "
                             f"int8 per row) or absent, got {quantization!r}")
        if method != "ngram":
            if model is None:
                raise ValueError(f"speculative_config: method {method!r} needs 'model', the path of the "
                                 f"{'draft model' if method == 'draft_model' else 'EAGLE head'}")
            for key in ("prompt_lookup_max", "prompt_lookup_min"):
                if key in values:
                    raise ValueError(f"speculative_config: {key} is for method 'ngram' only, not {method!r}")
            return cls(method, k, model=model, max_model_len=max_len, disable_by_batch_size=disable,
                       quantization=quantization)
        if model is not None or quantization is not None:
            raise ValueError(f"speculative_config: method 'ngram' takes no {'model' if model else 'quantization'!r} "
                             f"(it looks drafts up in the request's own tokens)")
        lookup_max = values.get("prompt_lookup_max", k)
        lookup_min = values.get("prompt_lookup_min", 1)
        for name, value in (("prompt_lookup_max", lookup_max), ("prompt_lookup_min", lookup_min)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
        if lookup_min > lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lookup_min}) must not exceed "
                             f"prompt_lookup_max ({lookup_max})")
        return cls(method, k, lookup_max, lookup_min, max_model_len=max_len, disable_by_batch_size=disable)


def _method_from_model_name(model: str) -> str:
    """vLLM's guess when only a model is named: an EAGLE-3 or EAGLE head by its name, else a draft model."""
    name = model.lower()
    if "eagle3" in name or "eagle-3" in name:
        return "eagle3"
    if "eagle" in name:
        return "eagle"
    return "draft_model"

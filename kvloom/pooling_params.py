"""PoolingParams (vLLM's name) and the model's pooler configuration; no torch.

An embedding request is a prompt whose final hidden states [T, H] are pooled into one vector [H]:

    LAST  the last prompt token's row (vLLM's default for decoder language models)
    MEAN  the mean of every prompt row
    CLS   the first row

then, where asked, truncated to ``dimensions`` (Matryoshka models only) and L2-normalized. A classification
request (``task="classify"``, a sequence classifier's: ``LLM.classify``, ``LLM.score``, /v1/rerank) pools LAST,
as transformers' ``...ForSequenceClassification`` does, and the model's ``score`` head turns the row into label
logits, activated where asked (``use_activation``, default on: a sigmoid for one label, else a softmax). A model
directory laid out for sentence-transformers (``modules.json`` naming a ``Pooling`` module, its
``1_Pooling/config.json``, an optional ``Normalize`` module) sets the pooling type and whether to
normalize; ``config.json``'s ``matryoshka_dimensions`` / ``is_matryoshka`` say whether ``dimensions`` is
allowed (vLLM's rule).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS")
POOLING_TASKS = ("embed", "classify")

# sentence-transformers' 1_Pooling/config.json keys -> kvloom's pooling type.
_SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                                "pooling_mode_cls_token": "CLS"}


@dataclass
class PoolingParams:
    """How to pool one embedding request (vLLM's names).

    ``normalize`` (vLLM's older name; ``use_activation`` is its newer one): L2-normalize the vector; None
    means the model's default (True, unless its sentence-transformers modules leave out Normalize).
    ``dimensions``: keep the first ``dimensions`` values (Matryoshka models only), before normalizing.
    """

    normalize: bool | None = None
    dimensions: int | None = None
    use_activation: bool | None = None
    # Filled by the engine's front (LLM.embed, the server) from the model's PoolerConfig.
    pooling_type: str = field(default="LAST", init=False)
    # What the runner makes of the pooled row: an embedding, or a classifier's label scores (its ``score`` head).
    task: str = field(default="embed", init=False)

    def __post_init__(self) -> None:
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be True, False or None, got {value!r}")
        if self.normalize is not None and self.use_activation is not None and self.normalize != self.use_activation:
            raise ValueError("normalize and use_activation are one setting (vLLM's old and new names); "
                             "give one of them")
        if self.normalize is None:
            self.normalize = self.use_activation
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")


@dataclass(frozen=True)
class PoolerConfig:
    """What a model says about pooling: its type, whether to normalize by default, and its Matryoshka
    dimensions (None: ``dimensions`` is refused; an empty tuple: any size up to hidden_size)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    hidden_size: int = 0
    matryoshka_dimensions: tuple[int, ...] | None = None

    def resolve(self, params: PoolingParams | None, task: str = "embed") -> PoolingParams:
        """A request's PoolingParams checked against the model, defaults filled: a copy. ``task``: "embed", or
        "classify" (a sequence classifier's labels: LAST pooling, activated unless use_activation=False)."""
        params = PoolingParams() if params is None else params
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        if task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {list(POOLING_TASKS)}, got {task!r}")
        if task == "classify":
            if params.dimensions is not None:
                raise ValueError("dimensions is for embeddings; a classifier's scores have one value per label")
            resolved = PoolingParams(normalize=True if params.normalize is None else params.normalize)
            resolved.task = "classify"
            return resolved
        dimensions = params.dimensions
        if dimensions is not None:
            if self.matryoshka_dimensions is None:
                raise ValueError("dimensions is only allowed for a model trained for Matryoshka truncation "
                                 "(its config.json has is_matryoshka or matryoshka_dimensions); this one is not")
            if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
                raise ValueError(f"dimensions must be one of {list(self.matryoshka_dimensions)}, got {dimensions}")
            if self.hidden_size and dimensions > self.hidden_size:
                raise ValueError(f"dimensions must be at most the model's hidden size {self.hidden_size}, "
                                 f"got {dimensions}")
        resolved = PoolingParams(normalize=self.normalize if params.normalize is None else params.normalize,
                                 dimensions=dimensions)
        resolved.pooling_type = self.pooling_type
        return resolved


def load_pooler_config(model_path: str, hidden_size: int, pooling_type: str | None = None) -> PoolerConfig:
    """The pooler configuration of a model directory (a GGUF file has none: LAST, normalized).

    ``pooling_type`` overrides what the directory says (one of POOLING_TYPES)."""
    kind, normalize = "LAST", True
    matryoshka: tuple[int, ...] | None = None
    if os.path.isdir(model_path):
        kind, normalize = _sentence_transformers_pooling(model_path, kind, normalize)
        config = _read_json(os.path.join(model_path, "config.json")) or {}
        dims = config.get("matryoshka_dimensions")
        if isinstance(dims, list) and all(isinstance(d, int) for d in dims):
            matryoshka = tuple(dims)
        elif config.get("is_matryoshka") is True:
            matryoshka = ()
    if pooling_type is not None:
        if pooling_type.upper() not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {list(POOLING_TYPES)}, got {pooling_type!r}")
        kind = pooling_type.upper()
    return PoolerConfig(kind, normalize, hidden_size, matryoshka)


def _sentence_transformers_pooling(model_dir: str, kind: str, normalize: bool) -> tuple[str, bool]:
    """modules.json's Pooling module (its config's pooling_mode_*) and whether a Normalize module follows."""
    modules = _read_json(os.path.join(model_dir, "modules.json"))
    if not isinstance(modules, list):
        return kind, normalize
    types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
    normalize = any(t.endswith("Normalize") for t in types)
    for module in modules:
        if isinstance(module, dict) and str(module.get("type", "")).endswith("Pooling"):
            config = _read_json(os.path.join(model_dir, str(module.get("path", "")), "config.json")) or {}
            modes = [mode for key, mode in _SENTENCE_TRANSFORMERS_MODES.items() if config.get(key)]
            others = [key for key, value in config.items()
                      if key.startswith("pooling_mode_") and value and key not in _SENTENCE_TRANSFORMERS_MODES]
            if others or len(modes) > 1:
                raise ValueError(f"{model_dir}: the sentence-transformers pooling {others or modes} is not "
                                 f"supported; kvloom pools with one of {list(POOLING_TYPES)}")
            if modes:
                kind = modes[0]
    return kind, normalize


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)

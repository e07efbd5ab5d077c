"""kvloom: an LLM inference and serving engine with vLLM's API.

Names load on first use, so ``kvloom --help`` and light imports do not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvloom.version import __version__


def _cap_torch_cpu_level() -> None:
    """KVLOOM_CPU_ISA reaches torch's own kernels only if set before torch's first CPU op: now."""
    from kvloom import cpu_capability

    try:
        cpu_capability.apply_to_torch()
    except ValueError:  # a level this CPU lacks: the engine says so when it starts
        pass


_cap_torch_cpu_level()

_EXPORTS = {
    "LLM": "kvloom.llm",
    "SamplingParams": "kvloom.sampling_params",
    "RequestOutput": "kvloom.outputs",
    "CompletionOutput": "kvloom.outputs",
    "Logprob": "kvloom.outputs",
    "EngineConfig": "kvloom.config",
    "PoolingParams": "kvloom.pooling_params",
    "EmbeddingRequestOutput": "kvloom.outputs",
    "EmbeddingOutput": "kvloom.outputs",
    "ScoringRequestOutput": "kvloom.outputs",
    "ScoringOutput": "kvloom.outputs",
    "ClassificationRequestOutput": "kvloom.outputs",
    "ClassificationOutput": "kvloom.outputs",
    "LoRARequest": "kvloom.lora.request",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    from kvloom.config import EngineConfig  # noqa: F401
    from kvloom.llm import LLM  # noqa: F401
    from kvloom.lora.request import LoRARequest  # noqa: F401
    from kvloom.outputs import (  # noqa: F401
        ClassificationOutput,
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        Logprob,
        RequestOutput,
        ScoringOutput,
        ScoringRequestOutput,
    )
    from kvloom.pooling_params import PoolingParams  # noqa: F401
    from kvloom.sampling_params import SamplingParams  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvloom' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

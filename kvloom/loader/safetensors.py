"""HF checkpoint directories: config.json and single or sharded *.safetensors files."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

SAFETENSORS_INDEX = "model.safetensors.index.json"

# Buffers that old checkpoints saved next to the weights; the engine computes them itself.
_NON_WEIGHT_SUFFIXES = (".rotary_emb.inv_freq",)


def read_config_json(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{model_dir} has no config.json; a HF model directory needs one") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got a {type(config).__name__}")
    return config


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's .safetensors files: the shards its index names, or the single file(s) present."""
    index_path = os.path.join(model_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                index = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{index_path} is not valid JSON: {e}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index_path} must hold a \"weight_map\" object from tensor names to shard "
                             "file names")
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not os.path.isfile(os.path.join(model_dir, name))]
        if missing:
            raise ValueError(f"{model_dir}: shards named in {SAFETENSORS_INDEX} are missing: {missing}")
    else:
        files = sorted(name for name in os.listdir(model_dir) if name.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors weights "
                         "(only safetensors checkpoints are supported)")
    return [os.path.join(model_dir, name) for name in files]


def iter_safetensors_weights(
    model_dir: str, skip: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint in its stored dtype, shard by shard, except the names in `skip`.

    A truncated or corrupt file is a ValueError naming it (the safetensors library's own error names none).
    """
    for path in safetensors_files(model_dir):
        with _corrupt_file_error(path):
            handle = safe_open(path, framework="pt")
            names = [name for name in handle.keys() if name not in skip and not name.endswith(_NON_WEIGHT_SUFFIXES)]
        for name in names:
            with _corrupt_file_error(path):
                tensor = handle.get_tensor(name)
            yield name, tensor


@contextlib.contextmanager
def _corrupt_file_error(path: str) -> Iterator[None]:
    """The safetensors library's error (which names no file) as a ValueError naming the file."""
    try:
        yield
    except SafetensorError as e:
        raise ValueError(f"{path} is not a valid safetensors file ({e}); it may be truncated or corrupt: "
                         "download it again") from None

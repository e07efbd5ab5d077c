"""HF checkpoint directories: config.json and single or sharded *.safetensors files."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

SAFETENSORS_INDEX = "model.safetensors.index.json"

# Buffers that old checkpoints saved next to the weights; the engine computes them itself.
_NON_WEIGHT_SUFFIXES = (".rotary_emb.inv_freq",)


def read_config_json(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{model_dir} has no config.json; a HF model directory needs one") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's .safetensors files: the shards its index names, or the single file(s) present."""
    index_path = os.path.join(model_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f).get("weight_map", {})
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
    """Every tensor of the checkpoint in its stored dtype, shard by shard, except the names in `skip`."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name in skip or name.endswith(_NON_WEIGHT_SUFFIXES):
                    continue
                yield name, f.get_tensor(name)

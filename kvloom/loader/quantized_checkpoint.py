"""A quantized checkpoint (``quantized_checkpoint_path``): the int8 model written once as safetensors and
read back at later starts without quantizing again (NxD Inference's ``quantized_checkpoints_path``).

The file's metadata holds a fingerprint of what produced it (the source model's files, its config, the
quantization settings). A file whose fingerprint differs, or that cannot be read, is quantized again
and replaced; one log line says which happened.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger("kvloom")

FORMAT = "kvloom-int8-v1"


def fingerprint(source_path: str, model_config: dict, settings: dict) -> str:
    """What the checkpoint depends on: the source files (names, sizes, mtimes), the config and the settings."""
    root = Path(source_path)
    files = sorted(root.iterdir()) if root.is_dir() else [root]
    parts = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files
             if f.suffix in (".safetensors", ".gguf", ".json")]
    blob = json.dumps([FORMAT, parts, model_config, settings], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def load(path: str, expected: str) -> dict[str, torch.Tensor] | None:
    """The stored tensors if the file exists and matches ``expected``; None (after one log line) otherwise."""
    from safetensors import SafetensorError, safe_open

    if not os.path.exists(path):
        logger.info("Quantized checkpoint %s does not exist yet: quantizing, then writing it", path)
        return None
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != FORMAT or metadata.get("fingerprint") != expected:
                logger.info("Quantized checkpoint %s was made from another model or settings: quantizing again "
                            "and replacing it", path)
                return None
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        logger.warning("Quantized checkpoint %s is unreadable (%s): quantizing again and replacing it", path, e)
        return None
    logger.info("Loaded the quantized checkpoint %s (%d tensors, no quantization)", path, len(tensors))
    return tensors


def save(path: str, tensors: dict[str, torch.Tensor], expected: str) -> None:
    """Write atomically (a temporary file renamed over the target), so a reader never sees half a file."""
    from safetensors.torch import save_file

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    save_file({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, str(temporary),
              metadata={"format": FORMAT, "fingerprint": expected})
    os.replace(temporary, target)
    logger.info("Wrote the quantized checkpoint %s (%.1f MB)", path, target.stat().st_size / 1e6)

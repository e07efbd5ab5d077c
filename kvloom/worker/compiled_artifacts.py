"""Compiled kernels kept on disk and reused across restarts (the seeds' NEURON_COMPILED_ARTIFACTS).

On CUDA what a start compiles is Triton kernels (one binary per kernel and shape specialisation). Their
store is ``KVLOOM_COMPILED_ARTIFACTS`` (or ``override_backend_config={"compiled_artifacts": DIR}``;
default ``KVLOOM_CACHE_DIR/compiled``), laid out as

    DIR/manifest.json   what the store was compiled for (versions, GPU, model shapes, dtype, buckets)
                        and a checksum of every file, written once a start has finished compiling
                        (kernels compiled later for new shapes join the folder, unlisted)
    DIR/triton/         Triton's cache (TRITON_CACHE_DIR points here)

A start whose configuration matches the manifest and whose files pass their checksums compiles nothing;
one that does not match, or finds a corrupt or half-written store, empties it and compiles anew. One
log line says which happened. (CUDA graphs hold device addresses, so they are captured at every start.)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from kvloom import envs
from kvloom.config import ResolvedConfig
from kvloom.version import __version__

logger = logging.getLogger("kvloom")

MANIFEST = "manifest.json"


def store_dir(config: ResolvedConfig) -> Path:
    chosen = config.engine.backend.compiled_artifacts
    if chosen:
        return Path(chosen).expanduser()
    return envs.cache_dir() / "compiled"


def store_key(config: ResolvedConfig, buckets: list[int] | None) -> dict[str, Any]:
    """Everything the compiled kernels depend on."""
    import triton

    mc = config.model
    device = config.device
    return {
        "kvloom": __version__, "torch": torch.__version__, "triton": triton.__version__,
        "gpu": torch.cuda.get_device_name(device), "capability": list(torch.cuda.get_device_capability(device)),
        "dtype": str(config.dtype).removeprefix("torch."), "block_size": config.block_size,
        "model": {"architecture": mc.architecture, "hidden_size": mc.hidden_size, "num_heads": mc.num_attention_heads,
                  "num_kv_heads": mc.num_key_value_heads, "head_dim": mc.head_dim,
                  "intermediate_size": mc.intermediate_size, "sliding_window": mc.sliding_window},
        "token_gen_buckets": buckets,
    }


def _checksums(directory: Path) -> dict[str, str]:
    return {str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def _intact(directory: Path, files: dict[str, str]) -> bool:
    """Every file the manifest lists is there with its checksum (kernels compiled later may sit beside them)."""
    for name, digest in files.items():
        path = directory / name
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            return False
    return True


class ArtifactStore:
    def __init__(self, config: ResolvedConfig, buckets: list[int] | None) -> None:
        self.directory = store_dir(config)
        self.kernels = self.directory / "triton"
        self.key = store_key(config, buckets)
        self.status = ""

    def open(self) -> None:
        """Check the store, empty it when it cannot be reused, and point Triton's cache at it."""
        manifest_path = self.directory / MANIFEST
        reason = None
        if not manifest_path.exists():
            reason = "no store yet" if not self.kernels.exists() else "the store was left half-written"
        else:
            try:
                manifest = json.loads(manifest_path.read_text())
                if manifest.get("key") != self.key:
                    differ = sorted(k for k in self.key if manifest.get("key", {}).get(k) != self.key[k])
                    reason = f"it was compiled for another configuration ({', '.join(differ)} differ)"
                elif not _intact(self.kernels, manifest.get("files", {})):
                    reason = "its files do not match their checksums (corrupt)"
            except (OSError, ValueError, AttributeError) as error:
                reason = f"its manifest cannot be read ({error})"
        if reason is None:
            self.status = "reused"
            logger.info("Compiled artifacts: reusing %s (nothing to compile)", self.directory)
        else:
            if self.directory.exists():
                shutil.rmtree(self.directory)
            self.status = "created" if reason == "no store yet" else "replaced"
            logger.info("Compiled artifacts: compiling into %s (%s)", self.directory, reason)
        self.kernels.mkdir(parents=True, exist_ok=True)
        os.environ["TRITON_CACHE_DIR"] = str(self.kernels)

    def close(self) -> None:
        """After start-up compiled everything: record what the store holds (a no-op when it was reused)."""
        if self.status == "reused":
            return
        manifest = {"key": self.key, "files": _checksums(self.kernels)}
        tmp = self.directory / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        tmp.replace(self.directory / MANIFEST)

"""Compiled kernels kept on disk and reused across restarts (the seeds' NEURON_COMPILED_ARTIFACTS).

On CUDA what a start compiles is Triton kernels (one binary per kernel and shape specialisation). Their
store is ``KVLOOM_COMPILED_ARTIFACTS`` (or ``override_backend_config={"compiled_artifacts": DIR}``;
default ``KVLOOM_CACHE_DIR/compiled``), one folder per configuration the kernels depend on:

    DIR/<key digest>/manifest.json  what the store was compiled for (versions, GPU, model shapes, dtype,
                                    buckets) and a checksum of every file, written once a start has finished
                                    compiling (kernels compiled later for new shapes join the folder, unlisted)
    DIR/<key digest>/triton/        Triton's cache (TRITON_CACHE_DIR points here)

A start whose configuration has a manifest and whose files pass their checksums compiles nothing. Stores of
other configurations are never touched, so engines of different models, or data-parallel replicas and servers
started at once, can share DIR: a store without a manifest yet (another start of the same configuration is
compiling into it, or one stopped before it finished) is compiled into further, since Triton writes each kernel
file whole (by rename); only a store whose manifest does not hold (corrupt) is set aside (renamed, then
deleted) and compiled anew. One log line says which happened. (CUDA graphs hold device addresses, so they are
captured at every start.)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
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


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _checksums(directory: Path) -> dict[str, str]:
    """Every whole file's checksum: Triton's temporary folders (``tmp.pid_*``, renamed into place when done) and
    files another process removes while this one reads are left out. (os.walk skips a folder renamed away between
    listing and reading it, where Path.rglob raised FileNotFoundError from inside its generator.)"""
    sums = {}
    for root, folders, files in os.walk(directory):
        folders[:] = [name for name in folders if not name.startswith("tmp.")]
        for name in files:
            if name.startswith("tmp."):
                continue
            path = Path(root) / name
            try:
                sums[str(path.relative_to(directory))] = _digest(path)
            except FileNotFoundError:
                continue
    return dict(sorted(sums.items()))


def _intact(directory: Path, files: dict[str, str]) -> bool:
    """Every file the manifest lists is there with its checksum (kernels compiled later may sit beside them)."""
    for name, digest in files.items():
        path = directory / name
        if not path.is_file() or _digest(path) != digest:
            return False
    return True


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


class ArtifactStore:
    """The store of one configuration (``key``) under ``root``; ``for_config`` builds it from an engine's."""

    def __init__(self, root: Path, key: dict[str, Any]) -> None:
        self.root = Path(root)
        self.key = key
        self.directory = self.root / key_digest(key)
        self.kernels = self.directory / "triton"
        self.status = ""

    @classmethod
    def for_config(cls, config: ResolvedConfig, buckets: list[int] | None) -> ArtifactStore:
        return cls(store_dir(config), store_key(config, buckets))

    def open(self) -> None:
        """Check the store, set it aside when it cannot be reused, and point Triton's cache at it."""
        manifest_path = self.directory / MANIFEST
        reason = None
        if not manifest_path.exists():
            self.status = "resumed" if self.kernels.exists() else "created"
        else:
            try:
                manifest = json.loads(manifest_path.read_text())
                if manifest.get("key") != self.key:
                    reason = "its manifest names another configuration"
                elif not _intact(self.kernels, manifest.get("files", {})):
                    reason = "its files do not match their checksums (corrupt)"
            except (OSError, ValueError, AttributeError) as error:
                reason = f"its manifest cannot be read ({error})"
            self.status = "reused" if reason is None else "replaced"
        if self.status == "reused":
            logger.info("Compiled artifacts: reusing %s (nothing to compile)", self.directory)
        else:
            if reason is not None:
                self._set_aside()
            why = {"created": "no store yet", "resumed": "a store without a manifest yet: compiling into it further"}
            logger.info("Compiled artifacts: compiling into %s (%s)", self.directory, reason or why[self.status])
        self.kernels.mkdir(parents=True, exist_ok=True)
        os.environ["TRITON_CACHE_DIR"] = str(self.kernels)

    def _set_aside(self) -> None:
        """Rename the bad store out of the way (a concurrent start sees it whole or not at all), then delete it."""
        aside = self.root / f".stale-{self.directory.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self.directory, aside)
        except FileNotFoundError:
            return  # another start set it aside first
        shutil.rmtree(aside, ignore_errors=True)

    def close(self) -> None:
        """After start-up compiled everything: record what the store holds (a no-op when it was reused)."""
        if self.status == "reused":
            return
        manifest = {"key": self.key, "files": _checksums(self.kernels)}
        tmp = self.directory / f"{MANIFEST}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        tmp.write_text(json.dumps(manifest, indent=1))
        tmp.replace(self.directory / MANIFEST)

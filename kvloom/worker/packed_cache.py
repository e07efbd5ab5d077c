"""The model as packed for the CPU's kernels, kept on disk and mapped back at the next start.

Reading a GGUF's blocks and packing them for kvloom's products (ops/q4.py, ops/int8.py, ops/cpu.py) was most of a
CPU start where they are decoded in Python (a Llama-3.2-1B Q8_0: 4 s of its 5.7; its Q4_K_M's code blocks 8 of 10).
The first start of a configuration writes
the packed model once (``torch.save``: every module, packed product and layer-stack plan with its tensors); a later
one memory-maps it (``torch.load(mmap=True)``): no block is decoded, no tensor copied, and the pages come from the
page cache as the first steps touch them. The products are the same tensors, so every output is bit for bit a cold
start's.

    KVLOOM_CACHE_DIR/packed/<key digest>/model.pt      the pickled model (tensors stored uncompressed)
    KVLOOM_CACHE_DIR/packed/<key digest>/manifest.json what it was packed from, and model.pt's size

The key holds everything the packing depends on: the file (its real path, size and modification time), the
resolved dtype, quantization, backend knobs, batch size hint, context length, model runner, CPU (its ISA level
and flags), every KVLOOM_* variable, torch's version and a digest of kvloom's own sources. A start with another
configuration packs anew beside it; the two newest entries of a file are kept, older ones deleted, and where the
disk cannot hold a new entry the file's older ones (another configuration, an older kvloom's) make room first. An
entry that cannot be read (a partial copy, another version's) is deleted and packed again, with a log line.

Only GGUF files on the CPU, on one rank, without LoRA or speculative decoding are cached (those wrap or share the
model after loading), and by default (``KVLOOM_PACKED_CACHE`` unset: auto) only where reading and packing took
MIN_PACKING_SECONDS or more: a file whose blocks are packed by a C++ pass over its bytes (Q4_K / Q6_K super-blocks)
starts about as fast without an entry, which would double the disk the model takes. ``KVLOOM_PACKED_CACHE=1`` writes
every entry, ``0`` none; the entry is as large as the packed weights (about the file), and a start checks the disk's
free space first. ``rm -r ~/.cache/kvloom/packed`` clears it.
Entries are pickles: this process loads only what a kvloom process wrote into its own cache directory.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from kvloom import envs
from kvloom.config import ResolvedConfig
from kvloom.cpu_capability import cpu_capability
from kvloom.ops import huge_pages
from kvloom.ops.table import Ops
from kvloom.version import __version__
from kvloom.worker.compiled_artifacts import key_digest

logger = logging.getLogger("kvloom")

MODEL_FILE = "model.pt"
MANIFEST = "manifest.json"
FORMAT = 1
KEEP_PER_FILE = 2  # entries of one model file kept (the newest)
FREE_SPACE_MARGIN = 1 << 30  # bytes left free on the disk beyond an entry
# KVLOOM_* variables that do not change what is packed (the rest are in the key).
_UNKEYED_ENV = frozenset({"KVLOOM_CACHE_DIR", "KVLOOM_PACKED_CACHE", "KVLOOM_LOGGING_LEVEL", "KVLOOM_API_KEY",
                          "KVLOOM_NUM_THREADS", "KVLOOM_CPU_OMP_THREADS_BIND", "KVLOOM_CPU_THREAD_POOL",
                          "KVLOOM_HUGE_PAGES"})

# The op table of the process loading an entry: what a pickled module's reference to its ops becomes.
_LOADING_OPS: contextvars.ContextVar[Ops | None] = contextvars.ContextVar("kvloom_packed_cache_ops", default=None)


def _current_ops() -> Ops:
    ops = _LOADING_OPS.get()
    if ops is None:
        raise RuntimeError("a packed model's op table is only restored inside PackedModelCache.load")
    return ops


def _resolve_op(qualified_name: str, overload: str) -> Any:
    """torch.ops.<namespace>.<name>.<overload> of this process (its library is loaded before the model is)."""
    namespace, name = qualified_name.split("::")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


class _Pickler(pickle.Pickler):
    """Pickles a model's references to the op table and to torch.ops overloads by name (neither pickles)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Ops):
            return _current_ops, ()
        if isinstance(obj, torch._ops.OpOverload):
            return _resolve_op, (obj._schema.name, obj._overloadname)
        return NotImplemented


class _PickleModule:
    """What torch.save takes as its ``pickle_module``: the standard one with the pickler above."""

    Pickler = _Pickler
    Unpickler = pickle.Unpickler
    __name__ = "pickle"


def sources_digest() -> str:
    """A digest of kvloom's Python and C++ sources: a change to any of them packs anew."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted((*root.rglob("*.py"), *root.rglob("*.cpp"), *root.rglob("*.h"))):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:24]


# Under KVLOOM_PACKED_CACHE=auto (the default) an entry is written only where reading and packing the file took this
# long or longer: where that work is a C++ pass over the file's bytes (a GGUF's Q4_K / Q6_K super-blocks), a mapped
# entry saves little and doubles the disk the model takes. On a 2-core AMX Xeon, process start to first token: a
# Llama-3.2-1B Q4_K_M 2.1-2.2 s without the cache against 1.65-1.68 mapped and 5.1 at the start that writes its 795 MB;
# its Q8_0 4.7-5.9 s against 1.6-1.7 mapped (its blocks are decoded in Python, then packed in C++).
MIN_PACKING_SECONDS = 3.0


def mode() -> str:
    """KVLOOM_PACKED_CACHE: "auto" (unset), "on" (1: every cached kind of start writes its entry) or "off" (0)."""
    raw = (envs.get("KVLOOM_PACKED_CACHE") or "auto").lower()
    if raw == "auto":
        return "auto"
    return "on" if envs.get_bool("KVLOOM_PACKED_CACHE") else "off"


def enabled() -> bool:
    return mode() != "off"


def cache_root() -> Path:
    return envs.cache_dir() / "packed"


def cache_key(config: ResolvedConfig, ops: Ops) -> dict[str, Any]:
    """Everything the packed model depends on."""
    engine, capability = config.engine, cpu_capability()
    stat = os.stat(config.source.path)
    return {
        "format": FORMAT, "kvloom": __version__, "sources": sources_digest(), "torch": torch.__version__,
        "file": {"path": os.path.realpath(config.source.path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns},
        "ops": ops.name, "dtype": str(config.dtype), "max_model_len": config.max_model_len,
        "block_size": config.block_size, "batch_hint": min(engine.max_num_seqs, 256),
        "quantization": engine.quantization, "quantized_checkpoint_path": engine.quantized_checkpoint_path,
        "kv_cache_dtype": engine.kv_cache_dtype, "runner": engine.runner, "task": engine.task,
        "pooling_type": engine.pooling_type, "hf_overrides": engine.hf_overrides,
        "backend": dataclasses.asdict(engine.backend),
        "cpu": {"level": capability.level, "flags": sorted(capability.cpu_flags)},
        "env": {name: value for name, value in sorted(os.environ.items())
                if name.startswith("KVLOOM_") and name not in _UNKEYED_ENV},
    }


class PackedModelCache:
    """One configuration's entry under ``root``; ``for_config`` says whether a start caches at all."""

    def __init__(self, root: Path, key: dict[str, Any]) -> None:
        self.root = Path(root)
        self.key = json.loads(json.dumps(key, default=str))  # as the manifest will hold it
        self.directory = self.root / key_digest(self.key)
        self.rehome: huge_pages.StepwiseRehome | None = None  # set by a load (the model moving onto huge pages)

    @classmethod
    def for_config(cls, config: ResolvedConfig, ops: Ops, world_size: int) -> PackedModelCache | None:
        """The entry of this start, or None where it is not cached (see the module's docstring)."""
        engine = config.engine
        if (not enabled() or world_size != 1 or ops.name != "cpu" or config.device.type != "cpu"
                or config.source.kind != "gguf" or engine.enable_lora or engine.speculative is not None):
            return None
        return cls(cache_root(), cache_key(config, ops))

    def load(self, ops: Ops) -> torch.nn.Module | None:
        """The packed model mapped from the entry, or None (no entry, or one that cannot be used: then deleted)."""
        manifest_path, model_path = self.directory / MANIFEST, self.directory / MODEL_FILE
        if not manifest_path.is_file():
            return None
        start = time.perf_counter()
        token = _LOADING_OPS.set(ops)
        try:
            manifest = json.loads(manifest_path.read_text())
            if manifest.get("key") != self.key:
                raise ValueError("its manifest names another configuration")
            if model_path.stat().st_size != manifest.get("bytes"):
                raise ValueError(f"{MODEL_FILE} is not the size its manifest gives (a partial copy)")
            model = torch.load(model_path, mmap=True, weights_only=False)
            if not isinstance(model, torch.nn.Module):
                raise ValueError(f"{MODEL_FILE} holds a {type(model).__name__}, not a model")
        except Exception as error:  # a corrupt or foreign entry: packed again below, never fatal
            logger.warning("packed model cache: the entry %s cannot be used (%s); packing the model again",
                           self.directory, error)
            shutil.rmtree(self.directory, ignore_errors=True)
            return None
        finally:
            _LOADING_OPS.reset(token)
        logger.info("packed model cache: mapped %s (%.1f GB) in %.2f s", model_path, manifest["bytes"] / 1e9,
                    time.perf_counter() - start)
        # Served from the file's pages at once; moved onto huge pages over the first steps (the runner steps it).
        self.rehome = huge_pages.StepwiseRehome.start(held_tensors(model, every_view=True))
        return model

    def save(self, model: torch.nn.Module, packing_seconds: float) -> None:
        """Write the entry once (a temporary folder renamed into place), then drop this file's oldest entries; under
        KVLOOM_PACKED_CACHE=auto only where reading and packing took ``packing_seconds`` >= MIN_PACKING_SECONDS."""
        if (self.directory / MANIFEST).is_file():
            return
        if mode() == "auto" and packing_seconds < MIN_PACKING_SECONDS:
            logger.info("packed model cache: not written (the file was read and packed in %.1f s; the cache is for "
                        "%.0f s or more, KVLOOM_PACKED_CACHE=1 writes it anyway)", packing_seconds,
                        MIN_PACKING_SECONDS)
            return
        size = sum(t.untyped_storage().nbytes() for t in held_tensors(model))
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.root).free
        except OSError as error:  # a read-only or missing cache folder: the start goes on without the entry
            logger.warning("packed model cache: not written (%s)", error)
            return
        # Short of space, this file's older entries (another configuration, or written by an older kvloom: a key
        # this process no longer asks for) make way, oldest first, where removing them makes room enough.
        older = self._entries_of_this_file()
        if free < size + FREE_SPACE_MARGIN <= free + sum(nbytes for _, nbytes in older):
            for directory, nbytes in older:
                shutil.rmtree(directory, ignore_errors=True)
                logger.info("packed model cache: removed %s (%.1f GB) to make room", directory, nbytes / 1e9)
                free = shutil.disk_usage(self.root).free
                if free >= size + FREE_SPACE_MARGIN:
                    break
        if free < size + FREE_SPACE_MARGIN:
            logger.warning("packed model cache: not written (%.1f GB needed, %.1f GB free under %s)", size / 1e9,
                           free / 1e9, self.root)
            return
        _remove_abandoned_staging(self.root)
        start = time.perf_counter()
        staging = self.root / f"tmp.{os.getpid()}.{uuid.uuid4().hex}"
        try:
            staging.mkdir()
            torch.save(model, staging / MODEL_FILE, pickle_module=_PickleModule)
            manifest = {"key": self.key, "bytes": (staging / MODEL_FILE).stat().st_size, "written": time.time()}
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
            os.rename(staging, self.directory)
        except OSError as error:  # another start wrote it first (the rename finds a folder), or the disk filled
            shutil.rmtree(staging, ignore_errors=True)
            if not (self.directory / MANIFEST).is_file():
                logger.warning("packed model cache: not written (%s)", error)
            return
        except Exception:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        logger.info("packed model cache: wrote %s (%.1f GB) in %.1f s; the next start maps it", self.directory,
                    manifest["bytes"] / 1e9, time.perf_counter() - start)
        self._evict()

    def _evict(self) -> None:
        """Keep the KEEP_PER_FILE newest entries of this model file."""
        entries = self._entries_of_this_file()
        for directory, _ in entries[:max(0, len(entries) - KEEP_PER_FILE)]:
            shutil.rmtree(directory, ignore_errors=True)

    def _entries_of_this_file(self) -> list[tuple[Path, int]]:
        """The written entries of this model file (this one's too, once written), oldest first, with the size of
        their model file (their manifest's "bytes")."""
        entries = []
        for directory in self.root.iterdir():
            try:
                manifest = json.loads((directory / MANIFEST).read_text())
            except (OSError, ValueError):
                continue
            if manifest.get("key", {}).get("file", {}).get("path") == self.key["file"]["path"]:
                entries.append((manifest.get("written", 0), str(directory), directory, manifest.get("bytes", 0)))
        return [(directory, nbytes) for *_, directory, nbytes in sorted(entries)]


def _remove_abandoned_staging(root: Path) -> None:
    """Delete the temporary folders of writers that died mid-write (``tmp.<pid>.<id>`` whose process is gone): a
    killed first start would otherwise leave a partial entry of gigabytes behind for good."""
    for staging in root.glob("tmp.*"):
        pid = staging.name.split(".")[1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            logger.info("packed model cache: removing %s, left by a start that did not finish", staging)
            shutil.rmtree(staging, ignore_errors=True)
        except PermissionError:  # another user's live process
            continue


def held_tensors(model: torch.nn.Module, every_view: bool = False, skip: tuple[Any, ...] = ()) -> list[torch.Tensor]:
    """The tensors pickling the model would store: its parameters, buffers and the packed products' attributes,
    each storage once (an estimate of the entry's size); with ``every_view``, every tensor object instead (those
    sharing a storage too). Objects in ``skip`` (modules, say) are not walked into."""
    seen: dict[int, torch.Tensor] = {}
    views: list[torch.Tensor] = []
    stack: list[Any] = [model]
    visited: set[int] = {id(obj) for obj in skip}
    while stack:
        obj = stack.pop()
        if id(obj) in visited:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            seen.setdefault(obj.untyped_storage().data_ptr(), obj)
            views.append(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, Ops)):
            stack.extend(vars(obj).values())
    return views if every_view else list(seen.values())

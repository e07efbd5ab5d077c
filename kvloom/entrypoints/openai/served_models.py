"""Several models behind one server: ``ServedModels``, the pool every route resolves a request's ``model`` through.

    kvloom serve tiny=/models/tiny-llama /models/qwen.gguf /models/zoo --max-loaded-models 2

Each model is served under a name (``name=path``; else the folder's name or the .gguf file's stem; a folder
holding several model folders / .gguf files, or a Hugging Face cache folder, stands for all of them). A
``ServedModel`` holds one model's engine (``AsyncLLM``, or the data-parallel router) and its endpoint families
(``ModelServing``: completion, chat, tokenization, embedding, LoRA adapters) while it is loaded. A request names
its model; ``ServedModels.acquire`` loads it on first use (the engine is built on a thread of its own, so the
event loop and the other engines keep serving), makes a request for a model that is loading wait for it, and
counts the request in flight until its HTTP exchange ends (``ModelLeaseMiddleware``), so a model with requests
in flight is never unloaded.

A loaded model is unloaded once idle for its keep-alive: the last ``touch(name, keep_alive_s)`` (a request's
Ollama-style ``keep_alive``), else ``--model-idle-timeout`` (default: never). Loading a model that would take
more than ``--max-loaded-models`` models or ``--models-memory-budget`` bytes first unloads idle models, least
recently used first; when only busy models stand in the way, the load waits for one of them to go idle. A model's
size is its weight files' bytes plus its KV cache (its budget before its first load, what it took after).

Another dialect's routes (Ollama's) use the pool the app keeps as ``app.state.served_models``: ``await
acquire(name)`` for a loaded ``ServedModel`` (``.serving.chat`` and the rest, ``.engine``), held until the HTTP
exchange ends; ``touch(name, keep_alive_s)`` for a request's ``keep_alive``; ``models`` (name -> ``ServedModel``:
``status``, ``size_bytes``, ``spec``) for listings; ``PooledChat(pool)`` for the chat seam over every model.

With one model given as today (``kvloom serve MODEL``) the pool holds that one engine, loaded at start and never
unloaded unless ``--model-idle-timeout`` is given: the server behaves as a one-model server always did.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import gc
import glob
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvloom.engine.engine_client import EngineClient
from kvloom.entrypoints.openai.protocol import ModelCard
from kvloom.entrypoints.openai.serving_engine import APIError

if TYPE_CHECKING:
    from kvloom.config import EngineConfig
    from kvloom.entrypoints.ollama.serving_chat import OllamaServingChat
    from kvloom.entrypoints.ollama.serving_models import OllamaServingModels
    from kvloom.entrypoints.openai.protocol import ChatCompletionRequest
    from kvloom.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
    from kvloom.entrypoints.openai.serving_completion import OpenAIServingCompletion
    from kvloom.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
    from kvloom.entrypoints.openai.serving_infill import OpenAIServingInfill
    from kvloom.entrypoints.openai.serving_lora import LoRAModules
    from kvloom.entrypoints.openai.serving_score import OpenAIServingScore
    from kvloom.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger("kvloom")

# llama-server's model statuses (``/v1/models`` ``status.value``), and "unloading" while an engine stops.
LOADED, LOADING, UNLOADING, UNLOADED = "loaded", "loading", "unloading", "unloaded"
# A busy engine without a counted request (one queued by another way in) is looked at again this often.
BUSY_RECHECK_S = 1.0


# ---- which models: the command line ------------------------------------------------------------

@dataclass
class ModelSpec:
    """One model the server offers: its id, more names for it, and what ``EngineConfig.model`` gets."""

    name: str
    model: str  # a HF directory, a .gguf file or the default model's name
    aliases: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [self.name, *self.aliases]


def _hf_cache_snapshot(path: str) -> str | None:
    """The snapshot a Hugging Face cache folder (``models--ORG--NAME``) stands for: ``refs/main``'s, else the
    newest; None when ``path`` is no such folder."""
    if not os.path.basename(os.path.normpath(path)).startswith("models--"):
        return None
    snapshots = os.path.join(path, "snapshots")
    if not os.path.isdir(snapshots):
        return None
    ref = os.path.join(path, "refs", "main")
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            snapshot = os.path.join(snapshots, f.read().strip())
        if os.path.isdir(snapshot):
            return snapshot
    candidates = sorted(glob.glob(os.path.join(snapshots, "*")), key=os.path.getmtime)
    return candidates[-1] if candidates else None


def _hf_cache_name(path: str) -> str:
    """``models--ORG--NAME`` -> ``ORG/NAME``."""
    return os.path.basename(os.path.normpath(path))[len("models--"):].replace("--", "/")


def _is_model(path: str) -> bool:
    return (os.path.isfile(path) and path.endswith(".gguf")) or os.path.isfile(os.path.join(path, "config.json"))


def expand_model(item: str) -> list[tuple[str, str]]:
    """(name, model) for one command-line item: a model (a HF directory, a .gguf file, the default model's name),
    a Hugging Face cache folder (``models--ORG--NAME``, named ``ORG/NAME``), or a folder of such models (each
    named by its folder or its file's stem). ValueError when the item is none of these."""
    path = os.path.expanduser(item)
    if _is_model(path):
        stem = os.path.basename(os.path.normpath(path))
        return [(stem[: -len(".gguf")] if stem.endswith(".gguf") else stem, path)]
    snapshot = _hf_cache_snapshot(path)
    if snapshot is not None:
        found = expand_model(snapshot)
        if len(found) == 1:
            return [(_hf_cache_name(path), found[0][1])]
        return found
    if os.path.isdir(path):
        found = []
        for entry in sorted(os.listdir(path)):
            child = os.path.join(path, entry)
            if _is_model(child):
                found.extend(expand_model(child))
            elif entry.startswith("models--") and _hf_cache_snapshot(child) is not None:
                found.extend(expand_model(child))
        if not found:
            raise ValueError(f"model folder {item!r} holds no model: neither a config.json of its own, nor model "
                             f"folders (with config.json), .gguf files or Hugging Face cache folders (models--*)")
        return found
    from kvloom.loader.weights import resolve_model

    source = resolve_model(item)  # the default model's name, or a clear ValueError
    return [(item, source.path if os.path.exists(item) else item)]


def model_specs(items: list[str], served_model_names: list[str] | None) -> list[ModelSpec]:
    """The served models from ``kvloom serve``'s model items and ``--served-model-name``.

    One plain item (no ``name=``, not a folder of models) is served as it always was: under the item itself,
    or under ``--served-model-name``'s names (the first the one reported). Otherwise every item is
    ``[NAME=]MODEL``, a folder standing for each model in it, each served under its NAME, else its folder's
    name or file stem; ``--served-model-name`` then gives one name per model, in order. ValueError naming the
    item for a model that cannot be found, a name given twice, or names that do not match the models.
    """
    if not items:
        raise ValueError("give at least one model to serve")
    entries: list[tuple[str | None, str]] = []
    for item in items:
        name, sep, model = item.partition("=")
        if sep and name and "/" not in name and not os.path.exists(item):
            if not model:
                raise ValueError(f"model {item!r}: give NAME=MODEL, with the model's path after '='")
            entries.append((name, model))
        else:
            entries.append((None, item))
    single_plain = len(entries) == 1 and entries[0][0] is None
    if single_plain:
        found = expand_model(entries[0][1])
        if len(found) == 1 and _is_model_item(entries[0][1]):
            names = list(served_model_names or [entries[0][1]])
            return [ModelSpec(names[0], entries[0][1], names[1:])]
    specs: list[ModelSpec] = []
    for name, item in entries:
        found = expand_model(item)
        if name is not None:
            if len(found) > 1:
                raise ValueError(f"model {name}={item}: a folder of {len(found)} models takes no name; its models "
                                 f"are named by their folders and files ({', '.join(n for n, _ in found)})")
            found = [(name, found[0][1])]
        specs.extend(ModelSpec(model_name, model) for model_name, model in found)
    if served_model_names:
        if any(name is not None for name, _ in entries):
            raise ValueError("name the models either with NAME=MODEL or with --served-model-name, not both")
        if len(served_model_names) != len(specs):
            raise ValueError(f"--served-model-name gives {len(served_model_names)} names for {len(specs)} models "
                             f"({', '.join(spec.model for spec in specs)}): give one name per model, in order")
        for spec, name in zip(specs, served_model_names):
            spec.name = name
    seen: dict[str, str] = {}
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"two models are served as {spec.name!r} ({seen[spec.name]} and {spec.model}); name "
                             f"them apart with NAME=MODEL")
        seen[spec.name] = spec.model
    return specs


def _is_model_item(item: str) -> bool:
    """Whether a command-line item is one model itself (not a folder of models)."""
    path = os.path.expanduser(item)
    return _is_model(path) or not os.path.isdir(path)


def weights_bytes(model: str) -> int:
    """The bytes of a model's weight files (a .gguf file, or a directory's safetensors / bin files)."""
    from kvloom.loader.weights import resolve_model

    path = resolve_model(model).path
    if os.path.isfile(path):
        return os.path.getsize(path)
    files = glob.glob(os.path.join(path, "*.safetensors")) or glob.glob(os.path.join(path, "*.bin"))
    return sum(os.path.getsize(f) for f in files)


def kv_cache_budget(config: EngineConfig) -> int:
    """The KV cache a model's engine may take before it is built: ``kv_cache_memory``, else the CPU default."""
    from kvloom.worker.kv_cache import DEFAULT_CPU_KV_CACHE_BYTES

    return int(config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES)


def kv_cache_bytes(engine: EngineClient) -> int | None:
    """The bytes an in-process engine's KV cache took (its blocks times a block's bytes); None when unknown."""
    llm_engine = getattr(engine, "engine", None)
    driver = getattr(getattr(llm_engine, "executor", None), "driver", None)
    manager = getattr(llm_engine, "kv_cache_manager", None)
    if driver is None or manager is None:
        return None
    return manager.num_blocks * driver.kv_bytes_per_block()


# ---- one model ---------------------------------------------------------------------------------

@dataclass
class ModelServing:
    """One loaded model's endpoint families, over its engine."""

    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    tokenization: OpenAIServingTokenization
    embedding: OpenAIServingEmbedding
    lora_modules: LoRAModules
    infill: OpenAIServingInfill
    scoring: OpenAIServingScore
    ollama_chat: OllamaServingChat
    ollama_models: OllamaServingModels


class ServedModel:
    """A model of the pool: its spec, its status, and its engine and serving while loaded.

    Every field is read and written on the event loop only (the engine is built and stopped on threads, whose
    results are applied there)."""

    def __init__(self, spec: ModelSpec, config: EngineConfig | None, size_bytes: int,
                 lora_specs: list[tuple[str, str, str | None]]) -> None:
        self.spec = spec
        self.config = config  # None: an engine handed over loaded, which the pool cannot build again
        self.size_bytes = size_bytes
        # The LoRA adapters offered on this model: --lora-modules's, and at unload the ones loaded at run time.
        self.lora_specs = lora_specs
        self.status = UNLOADED
        self.engine: EngineClient | None = None
        self.serving: ModelServing | None = None
        self.error: str | None = None  # why its last load failed
        self.in_flight = 0
        self.last_used = 0.0  # time.monotonic() of its last request
        self.idle_since = 0.0  # when its last request in flight ended
        self.keep_alive: float | None = None  # the last touch's; None: the server's idle timeout
        self.load_seconds: float | None = None
        self.loads = 0  # times it was loaded
        self.task: asyncio.Task | None = None  # its load (waiting for room included) or unload under way

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def busy(self) -> bool:
        return self.in_flight > 0 or (self.engine is not None and self.engine.has_requests())

    @property
    def pending(self) -> bool:
        """Whether a load or unload of it is under way."""
        return self.task is not None and not self.task.done()

    def adapter_names(self) -> list[str]:
        if self.serving is not None:
            return list(self.serving.lora_modules.adapters)
        return [name for name, _, _ in self.lora_specs]


# The models one HTTP exchange holds (``acquire``), released when it ends (``ModelLeaseMiddleware``).
_LEASES: contextvars.ContextVar[list[ServedModel] | None] = contextvars.ContextVar("kvloom_model_leases",
                                                                                    default=None)


class ModelLeaseMiddleware:
    """Counts a request in flight on the models it acquired until its whole HTTP exchange ends, a streamed
    body included (or the client goes away), so that no model is unloaded under a request. A route that leaves a
    keep-alive in seconds on ``request.state.keep_alive`` (Ollama's routes: None for the server's default) has it
    applied to those models then (``ServedModels.touch``)."""

    def __init__(self, app: ASGIApp, models: ServedModels) -> None:
        self.app = app
        self.models = models

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        leases: list[ServedModel] = []
        token = _LEASES.set(leases)
        try:
            await self.app(scope, receive, send)
        finally:
            _LEASES.reset(token)
            state = scope.get("state") or {}
            for model in leases:
                if "keep_alive" in state:
                    self.models.touch(model.name, state["keep_alive"])
                self.models.release(model)


# ---- the pool ----------------------------------------------------------------------------------

class ServedModels:
    """The served models by name: loads, keep-alives, LRU unloading under the limits (module docstring).

    ``build_engine(model)`` builds a model's engine (blocking: run on a thread); ``build_serving(engine, model)``
    its endpoint families (also on that thread)."""

    def __init__(self, models: list[ServedModel], *,
                 build_engine: Callable[[ServedModel], EngineClient] | None,
                 build_serving: Callable[[EngineClient, ServedModel], ModelServing],
                 default_model: str | None = None, idle_timeout: float | None = None,
                 max_loaded_models: int | None = None, memory_budget: int | None = None) -> None:
        if not models:
            raise ValueError("a server needs at least one model")
        self.models = {model.name: model for model in models}
        self._by_alias = {alias: model for model in models for alias in model.spec.aliases}
        if default_model is not None and default_model not in self.models:
            raise ValueError(f"--default-model {default_model!r} is not one of the served models "
                             f"({', '.join(self.models)})")
        self.default = self.models[default_model] if default_model is not None else models[0]
        self.build_engine = build_engine
        self.build_serving = build_serving
        self.idle_timeout = idle_timeout
        self.max_loaded_models = max_loaded_models
        self.memory_budget = memory_budget
        self._placing: asyncio.Lock | None = None  # made on the loop that uses it
        self._wake: asyncio.Event | None = None
        self._reaper: asyncio.Task | None = None
        self._touched = False  # a keep-alive was set: idle unloading runs even without --model-idle-timeout

    @classmethod
    def single(cls, engine: EngineClient, names: list[str],
               build_serving: Callable[[EngineClient, ServedModel], ModelServing], *, root: str | None = None,
               lora_specs: list[tuple[str, str, str | None]] | None = None,
               idle_timeout: float | None = None, config: EngineConfig | None = None,
               build_engine: Callable[[ServedModel], EngineClient] | None = None) -> ServedModels:
        """The pool of one model whose engine is already loaded (``kvloom serve MODEL``, and ``build_app(engine)``):
        served under ``names`` (the first reported), ``root`` the model it was given as."""
        spec = ModelSpec(names[0], root if root is not None else names[0], names[1:])
        model = ServedModel(spec, config, 0, list(lora_specs or []))
        pool = cls([model], build_engine=build_engine, build_serving=build_serving, idle_timeout=idle_timeout)
        pool.adopt(model, engine)
        return pool

    @property
    def several(self) -> bool:
        return len(self.models) > 1

    # ---- names ---------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Every name a request may give a model (each model's, then its aliases)."""
        return [name for model in self.models.values() for name in model.spec.names]

    def find(self, name: str | None) -> ServedModel | None:
        """The model ``name`` stands for (its name, an alias, or one of its LoRA adapters; None: the default)."""
        if name is None:
            return self.default
        model = self.models.get(name) or self._by_alias.get(name)
        if model is not None:
            return model
        for candidate in self.models.values():
            if name in candidate.adapter_names():
                return candidate
        return None

    def resolve(self, name: str | None) -> ServedModel:
        """``find``, or a 404 naming the models there are."""
        model = self.find(name)
        if model is None:
            raise self.not_found(name)
        return model

    def not_found(self, name: str | None) -> APIError:
        message = f"The model `{name}` does not exist."
        if self.several:
            adapters = [a for model in self.models.values() for a in model.adapter_names()]
            message = (f"The model `{name}` does not exist; this server serves {', '.join(self.models)}"
                       + (f" and the LoRA adapters {', '.join(adapters)}" if adapters else "") + ".")
        return APIError(message, 404, "model", code="model_not_found")

    # ---- requests ------------------------------------------------------------------------------
    async def acquire(self, name: str | None) -> ServedModel:
        """The loaded model a request names (None: the default), loading it first or waiting for its load, counted
        in flight until the request's HTTP exchange ends. 404 for an unknown name; 503 when it fails to load."""
        model = self.resolve(name)
        await self._loaded(model)
        model.in_flight += 1
        model.last_used = time.monotonic()
        leases = _LEASES.get()
        if leases is not None:
            leases.append(model)
        else:  # outside an HTTP exchange: held only while its engine has its requests
            self.release(model)
        return model

    async def _loaded(self, model: ServedModel) -> None:
        """Return once ``model`` is loaded: at once, or after its load (started here where none is under way)."""
        self._start_reaper()
        while model.status != LOADED:
            if not model.pending:
                if model.status != UNLOADED:
                    raise APIError(f"model {model.name!r} is {model.status} with nothing under way", 500, "model",
                                   type="server_error")
                model.task = asyncio.ensure_future(self._load(model))
                await asyncio.shield(model.task)
                if model.status != LOADED:
                    raise APIError(f"model {model.name!r} failed to load: {model.error}", 503, "model",
                                   type="server_error", code="model_load_failed")
            else:
                await asyncio.shield(model.task)  # type: ignore[arg-type]
                if model.status == UNLOADED and model.error is not None:
                    raise APIError(f"model {model.name!r} failed to load: {model.error}", 503, "model",
                                   type="server_error", code="model_load_failed")

    def release(self, model: ServedModel) -> None:
        model.in_flight -= 1
        if model.in_flight == 0:
            model.idle_since = time.monotonic()
            self._notify()

    def current(self) -> ServedModel:
        """The model the running HTTP exchange acquired last (the default outside one)."""
        leases = _LEASES.get()
        return leases[-1] if leases else self.default

    def touch(self, name: str, keep_alive_s: float | None) -> None:
        """Ollama's ``keep_alive``: keep ``name`` loaded for ``keep_alive_s`` seconds after its last request ends (0:
        unload as soon as it is idle; negative or infinite: never; None: back to ``--model-idle-timeout``). The
        latest call rules, as in Ollama. KeyError for an unknown name."""
        model = self.find(name)
        if model is None:
            raise KeyError(name)
        model.keep_alive = keep_alive_s
        now = time.monotonic()
        model.last_used = now
        if model.in_flight == 0:
            model.idle_since = now
        self._touched = True
        self._start_reaper()
        self._notify()

    def keep_alive_of(self, model: ServedModel) -> float | None:
        """Seconds a model stays loaded once idle; None: for ever."""
        if model.config is None:  # an engine handed over loaded: it could not be loaded again, so it stays
            return None
        # A request's keep-alive rules where several models share the server; one model stays for the server's life
        # (unless --model-idle-timeout says otherwise).
        touched = model.keep_alive if self.several else None
        keep_alive = touched if touched is not None else self.idle_timeout
        if keep_alive is None or keep_alive < 0 or math.isinf(keep_alive):
            return None
        return keep_alive

    # ---- loading and unloading -------------------------------------------------------------------
    def adopt(self, model: ServedModel, engine: EngineClient) -> None:
        """Take ``engine``, already built, as ``model``'s (and build its serving here)."""
        try:
            model.serving = self.build_serving(engine, model)
        except BaseException:
            engine.shutdown()
            raise
        model.engine = engine
        model.idle_since = model.last_used = time.monotonic()
        if model.config is not None:
            self._measure(model, engine)
        model.status = LOADED
        model.loads += 1

    async def load(self, name: str) -> ServedModel:
        """``POST /models/load``: the model loaded (waiting for room and for its load), not counted in flight."""
        model = self.resolve(name)
        await self._loaded(model)
        model.idle_since = model.last_used = time.monotonic()
        self._notify()
        return model

    async def unload(self, name: str) -> ServedModel:
        """``POST /models/unload``: the model unloaded now; 409 while it has requests in flight."""
        model = self.resolve(name)
        while model.pending:
            await asyncio.shield(model.task)  # type: ignore[arg-type]
        if model.status != LOADED:
            return model
        if model.busy:
            raise APIError(f"model {model.name!r} has requests in flight; it is unloaded only when idle (try again "
                           f"once they finish, or send keep_alive 0 to unload it then)", 409, "model",
                           code="model_busy")
        await asyncio.shield(self._begin_unload(model, "asked to"))
        return model

    def _lock(self) -> asyncio.Lock:
        if self._placing is None:
            self._placing = asyncio.Lock()
        return self._placing

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _changed(self, timeout: float | None) -> None:
        """Wait until a model changes status or goes idle (or ``timeout`` seconds)."""
        if self._wake is None or self._wake.is_set():
            self._wake = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    async def _load(self, model: ServedModel) -> None:
        """Make room, then build the model's engine and serving on a thread; a failure is kept in ``error``."""
        model.error = None
        if self.build_engine is None or model.config is None:
            model.error = "this server was handed the model's engine and cannot build it again"
            return
        async with self._lock():
            try:
                await self._make_room(model)
            except APIError as e:
                model.error = e.message
                return
            model.status = LOADING
        logger.info("Loading model %s (%s)", model.name, model.config.model)
        start = time.perf_counter()
        try:
            engine, serving = await asyncio.to_thread(self._build, model)
        except Exception as e:  # noqa: BLE001 - the requests waiting for it get the reason
            logger.exception("loading model %s failed", model.name)
            model.error = str(e) or repr(e)
            model.status = UNLOADED
            self._notify()
            return
        model.load_seconds = time.perf_counter() - start
        model.engine, model.serving = engine, serving
        self._measure(model, engine)
        model.idle_since = model.last_used = time.monotonic()
        model.status = LOADED
        model.loads += 1
        logger.info("Loaded model %s in %.2fs", model.name, model.load_seconds)
        self._notify()

    def _build(self, model: ServedModel) -> tuple[EngineClient, ModelServing]:
        engine = self.build_engine(model)  # type: ignore[misc]
        try:
            return engine, self.build_serving(engine, model)
        except BaseException:
            engine.shutdown()
            raise

    @staticmethod
    def _measure(model: ServedModel, engine: EngineClient) -> None:
        """The model's size from what its engine took: weights and KV cache (kept as estimated where unknown)."""
        measured = kv_cache_bytes(engine)
        if measured is not None and model.config is not None:
            model.size_bytes = weights_bytes(model.config.model) + measured

    async def _make_room(self, model: ServedModel) -> None:
        """Unload idle models, least recently used first, until ``model`` fits the limits; wait while only busy
        ones stand in the way. 503 when it could never fit."""
        if self.memory_budget is not None and model.size_bytes > self.memory_budget:
            raise APIError(f"model {model.name!r} needs about {model.size_bytes} bytes (weights and KV cache), more "
                           f"than --models-memory-budget ({self.memory_budget})", 503, "model", type="server_error",
                           code="model_too_large")
        while True:
            others = [m for m in self.models.values() if m is not model and m.status in (LOADED, LOADING, UNLOADING)]
            count, size = len(others) + 1, sum(m.size_bytes for m in others) + model.size_bytes
            idle = sorted((m for m in others if m.status == LOADED and not m.busy), key=lambda m: m.last_used)
            victims = []
            while not self._fits(count, size) and idle:
                victim = idle.pop(0)
                victims.append(victim)
                count, size = count - 1, size - victim.size_bytes
            if self._fits(count, size):
                stopping = [self._begin_unload(victim, f"to make room for {model.name}") for victim in victims]
                await asyncio.gather(*(asyncio.shield(task) for task in stopping))
                return
            logger.info("Model %s waits for room: %s", model.name,
                        ", ".join(f"{m.name} {m.status}{' and busy' if m.busy else ''}" for m in others))
            await self._changed(BUSY_RECHECK_S)

    def _fits(self, count: int, size: int) -> bool:
        return ((self.max_loaded_models is None or count <= self.max_loaded_models)
                and (self.memory_budget is None or size <= self.memory_budget))

    def _begin_unload(self, model: ServedModel, reason: str) -> asyncio.Task:
        """Take an idle, loaded model's engine out of service at once, and stop it on a task (returned)."""
        engine, serving = model.engine, model.serving
        model.engine = model.serving = None
        if serving is not None:
            model.lora_specs = [(name, request.lora_path, request.base_model_name)
                                for name, request in serving.lora_modules.adapters.items()]
        model.status = UNLOADING
        logger.info("Unloading model %s (%s)", model.name, reason)

        async def stop() -> None:
            try:
                if engine is not None:
                    await asyncio.to_thread(_stop_engine, engine)
            finally:
                model.status = UNLOADED
                self._notify()
                logger.info("Unloaded model %s", model.name)

        del serving
        model.task = asyncio.ensure_future(stop())
        return model.task

    # ---- idle unloading ------------------------------------------------------------------------
    def _start_reaper(self) -> None:
        """Idle unloading, once anything can expire (the one-model server without a timeout never needs it)."""
        if self.idle_timeout is None and not self._touched:
            return
        if self._reaper is None or self._reaper.done():
            self._wake = None
            self._reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        """Unload each model idle for longer than its keep-alive."""
        while True:
            now = time.monotonic()
            wait: float | None = None
            for model in self.models.values():
                keep_alive = self.keep_alive_of(model)
                if model.status != LOADED or keep_alive is None or model.in_flight or model.pending:
                    continue
                if model.busy:
                    wait = BUSY_RECHECK_S if wait is None else min(wait, BUSY_RECHECK_S)
                    continue
                left = model.idle_since + keep_alive - now
                if left <= 0:
                    self._begin_unload(model, f"idle for {keep_alive:g}s")
                else:
                    wait = left if wait is None else min(wait, left)
            await self._changed(wait)

    @contextlib.asynccontextmanager
    async def lifespan(self, _: Any) -> AsyncIterator[None]:
        """The app's lifespan: idle unloading runs from the start (a model loaded at start and never asked for)."""
        self._start_reaper()
        try:
            yield
        finally:
            if self._reaper is not None:
                self._reaper.cancel()

    # ---- LoRA adapters ---------------------------------------------------------------------------
    async def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> None:
        """``/v1/load_lora_adapter``: offer an adapter on its base model (``base_model_name``, else the default
        model), loading that model first. ValueError naming what is wrong."""
        if base_model_name is not None:
            model = self.models.get(base_model_name) or self._by_alias.get(base_model_name)
            if model is None:
                names = [n for m in self.models.values() for n in m.spec.names]
                raise ValueError(f"LoRA adapter {name!r} is for base model {base_model_name!r}, but this server "
                                 f"serves {names}")
        else:
            model = self.default
        for other in self.models.values():
            if other is not model and (name in other.spec.names or name in other.adapter_names()):
                raise ValueError(f"LoRA adapter name {name!r} is taken by model {other.name!r}; choose another")
        await self._loaded(model)
        model.serving.lora_modules.add(name, path, base_model_name)  # type: ignore[union-attr]

    def remove_lora(self, name: str) -> None:
        """``/v1/unload_lora_adapter``: KeyError when no model offers ``name``."""
        for model in self.models.values():
            if model.serving is not None and name in model.serving.lora_modules:
                model.serving.lora_modules.remove(name)
                return
            if model.serving is None and name in model.adapter_names():
                model.lora_specs = [spec for spec in model.lora_specs if spec[0] != name]
                return
        raise KeyError(name)

    # ---- what the launcher asks of an engine ----------------------------------------------------
    def loaded(self) -> list[ServedModel]:
        return [model for model in self.models.values() if model.status == LOADED and model.engine is not None]

    def has_requests(self) -> bool:
        return any(model.engine.has_requests() for model in self.loaded())  # type: ignore[union-attr]

    def shutdown(self, timeout: float | None = 30.0, reason: str = "the engine was shut down") -> None:
        """Stop every engine (requests still running fail with ``reason``)."""
        for model in self.models.values():
            if model.engine is not None:
                model.engine.shutdown(timeout, reason)

    # ---- listings ------------------------------------------------------------------------------
    def metric_rows(self) -> list[tuple[str, bool, float | None, int]]:
        """Per model: name, whether loaded, its last load's seconds, its size in bytes (``/metrics``)."""
        return [(model.name, model.status == LOADED, model.load_seconds, model.size_bytes)
                for model in self.models.values()]

    def model_cards(self) -> list[ModelCard]:
        """Every model, loaded or not (``status``: llama-server's), then the loaded models' LoRA adapters."""
        cards = []
        for model in self.models.values():
            status: dict[str, Any] = {"value": model.status}
            if model.error is not None and model.status == UNLOADED:
                status.update(failed=True, error=model.error)
            engine = model.engine
            max_model_len = engine.max_model_len if engine is not None else None
            root = model.config.model if model.config is not None else model.spec.model
            cards.extend(ModelCard(id=name, root=root, max_model_len=max_model_len, status=status)
                         for name in model.spec.names)
        for model in self.loaded():
            cards.extend(model.serving.lora_modules.model_cards(model.engine.max_model_len))  # type: ignore[union-attr]
        return cards

    def model_card(self, name: str) -> ModelCard:
        self.resolve(name)
        for card in self.model_cards():
            if card.id == name:
                return card
        raise self.not_found(name)  # an adapter of a model not loaded: listed once it is


def _stop_engine(engine: EngineClient) -> None:
    """Stop an engine and hand its memory back (on a thread: joining the engine's thread blocks)."""
    engine.shutdown(reason="the model was unloaded")
    llm_engine = getattr(engine, "engine", None)
    if llm_engine is not None:
        llm_engine.shutdown()  # the executor's workers, where it has any
    del engine, llm_engine
    gc.collect()
    from kvloom.platform import release_freed_heap

    release_freed_heap()


# ---- the chat seam over the pool ---------------------------------------------------------------

class PooledChat:
    """The chat serving's seam (``start_chat``, ``chat_prompt``, ``chat_response``, ``chat_chunks``, ``check_model``,
    ``tokenizer``) over every model of the pool: what the other dialects (Responses, Anthropic Messages, Ollama)
    take in place of one model's ``OpenAIServingChat``; each call goes to the model its request names."""

    def __init__(self, models: ServedModels) -> None:
        self.models = models

    def check_model(self, model: str | None) -> None:
        self.models.resolve(model)

    async def start_chat(self, request: ChatCompletionRequest) -> ChatRun:
        served = await self.models.acquire(request.model)
        return await served.serving.chat.start_chat(request)  # type: ignore[union-attr]

    async def chat_prompt(self, request: ChatCompletionRequest) -> Any:
        served = await self.models.acquire(request.model)
        return await served.serving.chat.chat_prompt(request)  # type: ignore[union-attr]

    def _chat_of(self, run: ChatRun) -> OpenAIServingChat:
        # The run's model is held (acquired) until its exchange ends, so it is loaded.
        serving = self.models.resolve(run.model).serving
        if serving is None:
            raise APIError(f"model {run.model!r} is not loaded", 503, "model", type="server_error")
        return serving.chat

    def chat_response(self, run: ChatRun) -> Any:
        return self._chat_of(run).chat_response(run)

    def chat_chunks(self, run: ChatRun) -> Any:
        return self._chat_of(run).chat_chunks(run)

    @property
    def tokenizer(self) -> Any:
        serving = self.models.current().serving
        if serving is None:
            raise APIError("no model is loaded for this request", 503, "model", type="server_error")
        return serving.chat.tokenizer


# ---- routes ------------------------------------------------------------------------------------

async def _model_field(raw_request: Request) -> str:
    try:
        body = await raw_request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError("the request body must be a JSON object {\"model\": NAME}", 400) from None
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str) or not model:
        raise APIError("'model' is required: the name of a served model", 400, "model")
    return model


def models_routes(models: ServedModels) -> APIRouter:
    """llama-server's ``POST /models/load`` and ``POST /models/unload`` ``{"model": NAME}``, and ``GET /models``."""
    router = APIRouter()

    @router.get("/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [card.model_dump() for card in models.model_cards()]}

    @router.post("/models/load")
    async def load_model(raw_request: Request) -> JSONResponse:
        """Load a model now (unloading idle ones the limits ask for); answered once it is loaded."""
        await models.load(await _model_field(raw_request))
        return JSONResponse({"success": True})

    @router.post("/models/unload")
    async def unload_model(raw_request: Request) -> JSONResponse:
        """Unload an idle model now (409 while it has requests in flight)."""
        await models.unload(await _model_field(raw_request))
        return JSONResponse({"success": True})

    return router


def model_args(args: argparse.Namespace, spec: ModelSpec) -> argparse.Namespace:
    """The server's flags as one model of the pool sees them (its own ``--model``)."""
    return argparse.Namespace(**{**vars(args), "model": spec.model})


def lora_specs_by_model(specs: list[ModelSpec], lora_modules: list[tuple[str, str, str | None]],
                        default: str) -> dict[str, list[tuple[str, str, str | None]]]:
    """``--lora-modules`` by the model each adapter is for: its ``base_model_name``, else the default model.
    ValueError for a base model that is not served."""
    by_name = {name: spec.name for spec in specs for name in spec.names}
    by_model: dict[str, list[tuple[str, str, str | None]]] = {spec.name: [] for spec in specs}
    for name, path, base in lora_modules:
        if base is not None and base not in by_name:
            raise ValueError(f"LoRA adapter {name!r} is for base model {base!r}, but this server serves "
                             f"{sorted(by_name)}")
        by_model[by_name[base] if base is not None else default].append((name, path, base))
    return by_model

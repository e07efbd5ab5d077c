"""LoRA adapters on the server (vLLM's surface): ``--lora-modules``, a request's ``model`` naming an adapter,
``/v1/models`` listing them with their ``parent``, and with ``KVLOOM_ALLOW_RUNTIME_LORA_UPDATING=1``
``POST /v1/load_lora_adapter {lora_name, lora_path}`` and ``/v1/unload_lora_adapter {lora_name}``.

Each adapter name gets its own ``lora_int_id`` (never reused, so an adapter loaded again under a name is a
new adapter to the caches). Unloading takes the name away from new requests; requests already running keep
their ``LoRARequest`` and finish on it.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from kvloom import envs
from kvloom.engine.engine_client import EngineClient
from kvloom.entrypoints.openai.protocol import ModelCard
from kvloom.entrypoints.openai.serving_engine import APIError
from kvloom.lora.request import LoRARequest


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str, str | None]]:
    """``--lora-modules`` items, ``name=path`` or vLLM's JSON ``{"name", "path", "base_model_name"}``, as
    (name, path, base model name)."""
    modules = []
    for value in values or []:
        value = value.strip()
        if value.startswith("{"):
            try:
                item = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"--lora-modules {value!r} is not valid JSON ({error})") from None
            if (not isinstance(item, dict) or not isinstance(item.get("name"), str)
                    or not isinstance(item.get("path"), str) or set(item) - {"name", "path", "base_model_name"}):
                raise ValueError(f"--lora-modules {value!r}: the JSON form is {{\"name\": ..., \"path\": ..., "
                                 f"\"base_model_name\": ... (optional)}}")
            modules.append((item["name"], item["path"], item.get("base_model_name")))
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r}: give name=path or the JSON form")
        modules.append((name, path, None))
    return modules


class LoRAModules:
    """The adapters the server offers by name."""

    def __init__(self, engine: EngineClient, served_model_names: list[str], enabled: bool) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.enabled = enabled
        self.adapters: dict[str, LoRARequest] = {}
        self._next_id = 1
        self._lock = threading.Lock()

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    def lora_request(self, model: str | None) -> LoRARequest | None:
        return None if model is None else self.adapters.get(model)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check the adapter against the engine and offer it under ``name``; ValueError if it cannot be."""
        if not self.enabled:
            raise ValueError("this server serves no LoRA adapters; start it with --enable-lora")
        if name in self.served_model_names:
            raise ValueError(f"LoRA adapter name {name!r} is the base model's name; choose another")
        if base_model_name is not None and base_model_name not in self.served_model_names:
            raise ValueError(f"LoRA adapter {name!r} is for base model {base_model_name!r}, but this server serves "
                             f"{self.served_model_names}")
        with self._lock:
            if name in self.adapters:
                raise ValueError(f"LoRA adapter {name!r} is already loaded; unload it first")
            request = LoRARequest(name, self._next_id, path, base_model_name)
            self.engine.input_processor.check_lora_request(request)
            self._next_id += 1
            self.adapters[name] = request
        return request

    def remove(self, name: str) -> None:
        with self._lock:
            if name not in self.adapters:
                raise KeyError(name)
            del self.adapters[name]

    def model_cards(self, max_model_len: int) -> list[ModelCard]:
        return [ModelCard(id=name, root=request.lora_path, parent=request.base_model_name or self.served_model_names[0],
                          max_model_len=max_model_len)
                for name, request in self.adapters.items()]


def _body_field(body: Any, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise APIError(f"'{name}' is required: a non-empty string", 400, name)
    return value


async def _json(raw_request: Request) -> Any:
    try:
        return await raw_request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError("the request body must be a JSON object", 400) from None


class AdapterHost(Protocol):
    """Where the routes load and unload adapters: the served models (``served_models.ServedModels``)."""

    async def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> None: ...

    def remove_lora(self, name: str) -> None: ...


def lora_routes(models: AdapterHost) -> APIRouter:
    """``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` over the served models (an adapter goes to its
    ``base_model_name``, else the default model, loaded first): 404 unless runtime updating is allowed."""
    router = APIRouter(prefix="/v1")

    def check_allowed() -> None:
        if envs.get("KVLOOM_ALLOW_RUNTIME_LORA_UPDATING") not in ("1", "true", "True"):
            raise APIError("loading and unloading LoRA adapters at run time is off; start the server with "
                           "KVLOOM_ALLOW_RUNTIME_LORA_UPDATING=1", 404, code="not_found")

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(raw_request: Request) -> PlainTextResponse:
        check_allowed()
        body = await _json(raw_request)
        name, path = _body_field(body, "lora_name"), _body_field(body, "lora_path")
        base_model_name = body.get("base_model_name")
        if base_model_name is not None and not isinstance(base_model_name, str):
            raise APIError("'base_model_name' must be a served model's name", 400, "base_model_name")
        try:
            await models.add_lora(name, path, base_model_name)
        except ValueError as error:
            raise APIError(str(error), 400, "lora_path" if "adapter at" in str(error) else "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(raw_request: Request) -> PlainTextResponse:
        check_allowed()
        name = _body_field(await _json(raw_request), "lora_name")
        try:
            models.remove_lora(name)
        except KeyError:
            raise APIError(f"The lora adapter '{name}' cannot be found.", 404, "lora_name",
                           code="not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return router

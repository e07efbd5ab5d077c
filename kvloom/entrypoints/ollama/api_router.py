"""Ollama's routes: ``POST /api/chat``, ``/api/generate``, ``/api/embed``, ``/api/embeddings``, ``/api/show``;
``GET /api/tags``, ``/api/ps``, ``/api/version``; and ``GET`` / ``HEAD /``, which answers "Ollama is running" as
Ollama does (clients probe it).

Every answer under ``/api/`` is in Ollama's shape, errors included (``{"error": "..."}``): a body that does not
validate, an unknown model (404, naming the models there are), a dead engine, Ollama's model-management routes
(pull, push, create, copy, delete, blobs: 501, kvloom serves the models it started with), an unknown path or
method. Bodies are read whatever their Content-Type, as Ollama reads them (``curl -d`` sends a form's).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from kvloom.entrypoints.ollama.protocol import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaErrorResponse,
    OllamaGenerateRequest,
    OllamaShowRequest,
    error_response,
)
from kvloom.entrypoints.ollama.serving_chat import OllamaServingChat, listed_name
from kvloom.entrypoints.ollama.serving_models import OllamaServingModels, unloaded_tags
from kvloom.entrypoints.openai.request_body import json_body, parse_body
from kvloom.entrypoints.openai.serving_engine import APIError, answered_in_shape

if TYPE_CHECKING:
    from kvloom.entrypoints.openai.served_models import ServedModels

logger = logging.getLogger("kvloom")

API_PATH = "/api"
RUNNING = "Ollama is running"
# Ollama's routes that manage its model store, which a kvloom server does not have.
MODEL_STORE_PATHS = ("/pull", "/push", "/create", "/copy", "/delete", "/blobs")
ROUTES = {"/chat": "POST", "/generate": "POST", "/embed": "POST", "/embeddings": "POST", "/show": "POST",
          "/tags": "GET", "/ps": "GET", "/version": "GET"}

ERRORS: dict[int | str, dict[str, object]] = {
    400: {"model": OllamaErrorResponse, "description": "Invalid request: the message names the field"},
    404: {"model": OllamaErrorResponse, "description": "No such model: the message names the models there are"},
    413: {"model": OllamaErrorResponse, "description": "The body is over --max-request-body-bytes"},
    "4XX": {"model": OllamaErrorResponse, "description": "Client error"},
    "5XX": {"model": OllamaErrorResponse, "description": "Server error (503: the engine is not running)"},
}


def is_ollama_path(path: str) -> bool:
    """Whether ``path`` is Ollama's API (its answers, 401s included, are in Ollama's shape)."""
    return path == API_PATH or path.startswith(API_PATH + "/")


# Every error a route raises answered in the API's shape.
in_ollama_shape = answered_in_shape(error_response, "an Ollama API")


def pool_name(model: str | None) -> str | None:
    """The served model an Ollama name stands for (Ollama's ``:latest`` tag dropped)."""
    return model.removesuffix(":latest") if model else model


def ollama_routes(pool: ServedModels) -> APIRouter:
    """Ollama's routes over the pool of served models: each request on the model it names (loaded on first use),
    through that model's chat and embeddings servings; the listings over every model."""
    router = APIRouter()

    async def serving_of(model: str | None) -> tuple[OllamaServingChat, OllamaServingModels]:
        if not model:
            raise APIError("model is required")
        name = model if pool.find(model) is not None else pool_name(model)
        if pool.find(name) is None:  # a 404 in Ollama's words, naming the models there are
            available = [*pool.names(), *(a for served in pool.models.values() for a in served.adapter_names())]
            raise APIError(f"model '{model}' not found; this server serves "
                           f"{', '.join(listed_name(n) for n in available)}", 404)
        served = await pool.acquire(name)
        return served.serving.ollama_chat, served.serving.ollama_models

    async def listing(kind: str) -> dict[str, Any]:
        """/api/tags (every model whose engine is loaded, then the others from their files) or /api/ps (loaded)."""
        entries: list[dict[str, Any]] = []
        for model in pool.models.values():
            if model.serving is not None:
                entries += (await getattr(model.serving.ollama_models, kind)())["models"]
            elif kind == "tags":
                entries += await unloaded_tags(model.spec.model, model.spec.names)
        return {"models": entries}

    async def body(raw_request: Request, request_model: Any) -> Any:
        return await parse_body(raw_request, request_model, any_content_type=True)

    @router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def running() -> Response:
        return PlainTextResponse(RUNNING)

    @router.post(API_PATH + "/chat", openapi_extra=json_body(OllamaChatRequest),
                 responses={200: {"description": "The reply: NDJSON objects (application/x-ndjson), or with "
                                  "stream: false one object"}, **ERRORS})
    @in_ollama_shape
    async def create_chat(raw_request: Request) -> Response:
        request = await body(raw_request, OllamaChatRequest)
        return await (await serving_of(request.model))[0].create_chat(request, raw_request)

    @router.post(API_PATH + "/generate", openapi_extra=json_body(OllamaGenerateRequest),
                 responses={200: {"description": "The reply: NDJSON objects (application/x-ndjson), or with "
                                  "stream: false one object"}, **ERRORS})
    @in_ollama_shape
    async def create_generate(raw_request: Request) -> Response:
        request = await body(raw_request, OllamaGenerateRequest)
        return await (await serving_of(request.model))[0].create_generate(request, raw_request)

    @router.post(API_PATH + "/embed", openapi_extra=json_body(OllamaEmbedRequest),
                 responses={200: {"description": "{\"model\", \"embeddings\": [[...]], ...}"}, **ERRORS})
    @in_ollama_shape
    async def embed(raw_request: Request) -> Response:
        request = await body(raw_request, OllamaEmbedRequest)
        return await (await serving_of(request.model))[1].embed(request, raw_request)

    @router.post(API_PATH + "/embeddings", openapi_extra=json_body(OllamaEmbeddingsRequest),
                 responses={200: {"description": "{\"embedding\": [...]}"}, **ERRORS})
    @in_ollama_shape
    async def embeddings(raw_request: Request) -> Response:
        request = await body(raw_request, OllamaEmbeddingsRequest)
        return await (await serving_of(request.model))[1].embeddings(request, raw_request)

    @router.post(API_PATH + "/show", openapi_extra=json_body(OllamaShowRequest),
                 responses={200: {"description": "The model's details, template and capabilities"}, **ERRORS})
    @in_ollama_shape
    async def show(raw_request: Request) -> Response:
        request = await body(raw_request, OllamaShowRequest)
        return JSONResponse(await (await serving_of(request.model or request.name))[1].show(request))

    @router.get(API_PATH + "/tags", responses=ERRORS)
    @in_ollama_shape
    async def tags(raw_request: Request) -> Response:
        return JSONResponse(await listing("tags"))

    @router.get(API_PATH + "/ps", responses=ERRORS)
    @in_ollama_shape
    async def ps(raw_request: Request) -> Response:
        return JSONResponse(await listing("ps"))

    @router.get(API_PATH + "/version", responses=ERRORS)
    @in_ollama_shape
    async def version(raw_request: Request) -> Response:
        return JSONResponse(OllamaServingModels.version())

    # Ollama answers HEAD on these as on GET (clients probe them); one operation each in /openapi.json.
    router.add_api_route(API_PATH + "/tags", tags, methods=["HEAD"], include_in_schema=False)
    router.add_api_route(API_PATH + "/version", version, methods=["HEAD"], include_in_schema=False)

    async def elsewhere(raw_request: Request) -> Response:
        path = raw_request.url.path.removeprefix(API_PATH)
        if path.startswith(MODEL_STORE_PATHS):
            return error_response(f"{API_PATH}{path} is not supported: kvloom serves the models it was started "
                                  f"with and has no model store to pull, push, create, copy or delete", 501)
        if path in ROUTES:
            return error_response(f"{raw_request.method} is not allowed on {API_PATH}{path}; use {ROUTES[path]}",
                                  405)
        return error_response(f"no route {raw_request.url.path}: Ollama's API here serves "
                              f"{', '.join(f'{method} {API_PATH}{p}' for p, method in ROUTES.items())}", 404)

    # Registered after the routes: any other method or path below /api.
    for path in ("", "/{rest:path}"):
        router.add_api_route(API_PATH + path, elsewhere,
                             methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
                             include_in_schema=False)

    return router

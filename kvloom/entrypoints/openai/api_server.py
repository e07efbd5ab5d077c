"""The OpenAI-compatible HTTP server: ``kvloom serve MODEL`` or
``python -m kvloom.entrypoints.openai.api_server --model MODEL``.

Routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, ``/health``, ``/version``,
``/tokenize``, ``/detokenize`` and ``/metrics``. One uvicorn process serves them on one asyncio
loop; the engine steps in its own thread (AsyncLLM), or with ``--data-parallel-size N`` N engines
run as replicas behind a router (``router.py``) that offers the same surface. With ``--api-key`` every route but
``/health`` (and ``/metrics``, unless ``--metrics-require-key``) needs the key.

Every error has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``. Request
bodies are parsed here rather than by FastAPI, so that malformed JSON, wrong types and huge
numbers all end as a 400 that names the field; a body that is not ``application/json`` is a 415
and one over ``--max-request-body-bytes`` a 413, both before it is read. ``/openapi.json`` still
documents each body's model (``json_body``) and these errors (never FastAPI's 422).

On SIGTERM uvicorn stops accepting connections and lets the in-flight responses finish for at
most ``--shutdown-timeout`` seconds; then the engine is stopped, which ends the remaining streams
with an error event. A second SIGTERM or SIGINT exits at once.
"""

from __future__ import annotations

import argparse
import functools
import hmac
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections import deque
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvloom import __version__, envs
from kvloom.config import config_from_args
from kvloom.engine.async_engine import AsyncLLM, EngineDeadError
from kvloom.entrypoints.openai.args import DEFAULT_MAX_REQUEST_BODY_BYTES, add_server_args
from kvloom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    RequestModel,
    TokenizeRequest,
    TokenizeResponse,
)
from kvloom.entrypoints.openai.serving_chat import OpenAIServingChat
from kvloom.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kvloom.entrypoints.openai.serving_engine import APIError, error_response, max_chars_per_token_of
from kvloom.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from kvloom.metrics import EngineStats
from kvloom.sampling_params import MAX_LOGPROBS

logger = logging.getLogger("kvloom")

RequestT = TypeVar("RequestT", bound=RequestModel)


# ---- request bodies -------------------------------------------------------------------------

async def _read_body(raw_request: Request) -> bytes:
    """The body, refused before it is read when it is not JSON (415) or too large (413)."""
    content_type = raw_request.headers.get("content-type", "")
    if content_type.partition(";")[0].strip().lower() != "application/json":
        raise APIError(f"the request body must be JSON sent with 'Content-Type: application/json', "
                       f"got {content_type or 'no Content-Type'!r}", 415, code="unsupported_media_type")
    limit = getattr(raw_request.app.state, "max_request_body_bytes", DEFAULT_MAX_REQUEST_BODY_BYTES)
    too_large = APIError(f"the request body is larger than {limit} bytes (--max-request-body-bytes)",
                         413, code="request_too_large")
    length = raw_request.headers.get("content-length")
    if length is not None and length.strip().isdigit() and int(length) > limit:
        raise too_large
    chunks = []
    size = 0
    async for chunk in raw_request.stream():  # a chunked body has no Content-Length: count it
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(raw_request: Request, model: type[RequestT]) -> RequestT:
    """The JSON body as a request model; a 400 naming the field for anything malformed."""
    body = await _read_body(raw_request)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(f"the request body must be a JSON object, got {type(data).__name__}")
    _check_unicode(data)
    try:
        request = model.model_validate(data)
    except ValidationError as e:
        raise APIError(*_describe_validation_error(e.errors(include_url=False))) from None
    except RecursionError:
        raise APIError("the request body is nested too deeply") from None
    if request.model_extra:
        logger.warning("Ignoring unknown fields in the request: %s", sorted(request.model_extra))
    return request


_UNION_TAG = re.compile(r"str|int|float|bool|none|[\w-]+\[.*\]")
_UNION_MESSAGES = {
    "prompt": "prompt must be a string, a list of strings, a list of token ids or a list of lists of "
              "token ids",
    "stop": "stop must be a string or a list of strings",
}


def _check_unicode(data: Any) -> None:
    """Refuse lone surrogates (JSON "\\ud800"): no tokenizer or UTF-8 encoder accepts them."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(f"the request holds a string that is not valid Unicode "
                               f"(a lone surrogate): {item[:50]!r}") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _describe_validation_error(errors: list[Any]) -> tuple[str, int, str | None]:
    """(message, 400, param) from pydantic's errors: the first error, its field as the param."""
    if not errors:
        return "invalid request", 400, None
    error = errors[0]
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    # Union members appear in the location (prompt.list[int].0); keep the path readable.
    path = ".".join(part for part in loc if not _UNION_TAG.fullmatch(part))
    message = f"{path}: {error.get('msg', 'invalid value')}" if path else str(error.get("msg"))
    if param in _UNION_MESSAGES and len(errors) > 1:
        message = _UNION_MESSAGES[param]
    if "input" in error and error.get("type") != "missing":
        shown = repr(error["input"])
        message += f", got {shown[:100]}{'...' if len(shown) > 100 else ''}"
    return message, 400, param


# ---- the OpenAPI document -------------------------------------------------------------------

REQUEST_MODELS: tuple[type[RequestModel], ...] = (CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                                                  DetokenizeRequest)
_SCHEMA_REF = "#/components/schemas/{model}"


def json_body(model: type[RequestModel]) -> dict[str, Any]:
    """A route's ``openapi_extra`` documenting its JSON body as ``model``. The handler reads the
    body itself (``parse_body``), so that the 415 and 413 come before it is read and a bad body
    is a 400, not FastAPI's 422; ``openapi_schema`` adds the model's schema to the components."""
    if model not in REQUEST_MODELS:
        raise ValueError(f"{model.__name__} is not in REQUEST_MODELS, so /openapi.json would not define it")
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _SCHEMA_REF.format(model=model.__name__)}}}}}


# Every route's errors have OpenAI's shape; documenting 4XX also keeps FastAPI from documenting
# its 422, which this server never sends (validation errors are 400s).
ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorResponse, "description": "Client error"},
    "5XX": {"model": ErrorResponse, "description": "Server error (503: the engine is dead)"},
}
BODY_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request: the message names the field"},
    413: {"model": ErrorResponse, "description": "The body is over --max-request-body-bytes"},
    415: {"model": ErrorResponse, "description": "The body is not sent as application/json"},
}


@functools.cache
def request_schemas() -> dict[str, Any]:
    """The JSON schemas of ``REQUEST_MODELS`` and the models they nest, by name."""
    _, definitions = models_json_schema([(model, "validation") for model in REQUEST_MODELS],
                                        ref_template=_SCHEMA_REF)
    return definitions.get("$defs", {})


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document (cached by FastAPI) with the request models under ``components/schemas``."""
    document = FastAPI.openapi(app)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in request_schemas().items():
        if schemas.setdefault(name, schema) != schema:
            raise ValueError(f"two different OpenAPI schemas are named {name!r}")
    return document


# ---- the dashboard --------------------------------------------------------------------------

class DashboardRates:
    """Generation tokens over the last few seconds of dashboard polls (a rate from two totals)."""

    WINDOW_S = 5.0

    def __init__(self) -> None:
        self.samples: deque[tuple[float, int]] = deque()

    def tokens_per_second(self, now: float, total: int) -> float | None:
        self.samples.append((now, total))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.WINDOW_S:
            self.samples.popleft()
        start, first = self.samples[0]
        return (total - first) / (now - start) if now > start else None


def dashboard_numbers(stats: EngineStats, rates: DashboardRates, model: str) -> dict[str, Any]:
    scheduler = stats.scheduler
    return {
        "model": model,
        "num_running": scheduler.num_running,
        "num_waiting": scheduler.num_waiting,
        "kv_cache_usage_percent": 100.0 * scheduler.kv_cache_usage,
        "prefix_cache_hit_rate_percent": (100.0 * scheduler.prefix_cache_hits / scheduler.prefix_cache_queries
                                          if scheduler.prefix_cache_queries else None),
        "generation_tokens_total": stats.generation_tokens,
        "generation_tokens_per_second": rates.tokens_per_second(time.monotonic(), stats.generation_tokens),
        "num_preemptions": scheduler.num_preemptions,
        "spec_decode_acceptance_percent": (100.0 * scheduler.num_accepted_tokens / scheduler.num_draft_tokens
                                           if scheduler.num_draft_tokens else None),
    }


# ---- the app --------------------------------------------------------------------------------

class APIKeyMiddleware:
    """Every HTTP route but the open ones needs ``Authorization: Bearer <key>`` (401 otherwise).

    A middleware rather than a route dependency, so that no route (``/openapi.json``, an unknown
    path, a later one) can be left open by accident.
    """

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        scheme, _, token = header.decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), self.api_key):
            await self.app(scope, receive, send)
            return
        response = error_response("Invalid or missing API key; send it as 'Authorization: Bearer <key>'",
                                  401, code="invalid_api_key")
        await response(scope, receive, send)


def load_chat_template(value: str | None) -> str | None:
    """A chat template given inline or as a file path."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def served_model_names(args: argparse.Namespace) -> list[str]:
    names = getattr(args, "served_model_name", None)
    if isinstance(names, str):
        names = [names]
    return list(names) if names else [args.model]


def build_app(engine: AsyncLLM, args: argparse.Namespace) -> FastAPI:
    """The FastAPI app serving ``engine`` under the names and settings in ``args``."""
    names = served_model_names(args)
    chat_template = load_chat_template(getattr(args, "chat_template", None))
    api_key = getattr(args, "api_key", None) or envs.get("KVLOOM_API_KEY")
    root = getattr(args, "model", None)
    limits = dict(max_logprobs=getattr(args, "max_logprobs", MAX_LOGPROBS),
                  max_chars_per_token=max_chars_per_token_of(engine.tokenizer))
    completion = OpenAIServingCompletion(engine, names, chat_template, **limits)
    chat = OpenAIServingChat(engine, names, chat_template, **limits)
    tokenization = OpenAIServingTokenization(engine, names, chat_template, **limits)

    app = FastAPI(title="kvloom", version=__version__, docs_url=None, redoc_url=None, responses=ERRORS)
    app.state.engine = engine
    app.state.max_request_body_bytes = getattr(args, "max_request_body_bytes", DEFAULT_MAX_REQUEST_BODY_BYTES)
    if api_key:
        open_paths = {"/health"} if getattr(args, "metrics_require_key", False) else {"/health", "/metrics"}
        app.add_middleware(APIKeyMiddleware, api_key=api_key, open_paths=frozenset(open_paths))

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError) -> JSONResponse:
        return error_response(str(error), 503, type="server_error", code="engine_dead")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(str(error.detail), error.status_code,
                              type="invalid_request_error" if error.status_code < 500 else "server_error")

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(*_describe_validation_error(list(error.errors())))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        return error_response(f"internal error: {error!r}", 500, type="server_error")

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=root, max_model_len=engine.max_model_len)
                               for name in names])

    @v1.get("/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelCard:
        completion.check_model(model_id)
        return ModelCard(id=model_id, root=root, max_model_len=engine.max_model_len)

    @v1.post("/completions", openapi_extra=json_body(CompletionRequest), responses=BODY_ERRORS)
    async def create_completion(raw_request: Request) -> Response:
        request = await parse_body(raw_request, CompletionRequest)
        return await completion.create_completion(request, raw_request)

    @v1.post("/chat/completions", openapi_extra=json_body(ChatCompletionRequest), responses=BODY_ERRORS)
    async def create_chat_completion(raw_request: Request) -> Response:
        request = await parse_body(raw_request, ChatCompletionRequest)
        return await chat.create_chat_completion(request, raw_request)

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return error_response(f"the engine is dead: {engine.dead_error}", 503, type="server_error",
                                  code="engine_dead")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    dashboard_page = (Path(__file__).parent / "dashboard" / "index.html").read_text()
    rates = DashboardRates()

    @app.get("/dashboard")
    async def dashboard() -> Response:
        """A live page of the engine's state (static HTML and JS, no build step, nothing from a CDN)."""
        return Response(dashboard_page, media_type="text/html")

    @app.get("/dashboard/stats")
    async def dashboard_stats() -> dict[str, Any]:
        """The numbers the dashboard plots: the ones /metrics exports, with rates and ratios worked out."""
        return dashboard_numbers(engine.get_stats(), rates, names[0])

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", openapi_extra=json_body(TokenizeRequest), responses=BODY_ERRORS)
    async def tokenize(raw_request: Request) -> TokenizeResponse:
        return await tokenization.tokenize(await parse_body(raw_request, TokenizeRequest))

    @app.post("/detokenize", openapi_extra=json_body(DetokenizeRequest), responses=BODY_ERRORS)
    async def detokenize(raw_request: Request) -> DetokenizeResponse:
        return await tokenization.detokenize(await parse_body(raw_request, DetokenizeRequest))

    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    return app


# ---- running it -----------------------------------------------------------------------------

def _setup_logging(level: str) -> None:
    kvloom_logger = logging.getLogger("kvloom")
    if not kvloom_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s",
                                               "%m-%d %H:%M:%S"))
        kvloom_logger.addHandler(handler)
        kvloom_logger.propagate = False
    kvloom_logger.setLevel(level.upper())


def _bind(host: str, port: int) -> socket.socket:
    """Bind the port before the model loads, so a busy port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def _draining_server_class() -> type:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server with a bounded drain: the first SIGTERM / SIGINT stops accepting and
        lets in-flight requests finish for ``shutdown_timeout`` seconds, then stops the engine,
        which ends the remaining requests with an error (a stream's last event); a second signal
        of either kind exits at once (uvicorn alone forces only on a second SIGINT)."""

        def __init__(self, config: uvicorn.Config, engine: AsyncLLM, shutdown_timeout: float) -> None:
            super().__init__(config)
            self.engine = engine
            self.shutdown_timeout = shutdown_timeout
            self._deadline: threading.Timer | None = None

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.should_exit:
                self._captured_signals.append(sig)
                self.force_exit = True
                return
            super().handle_exit(sig, frame)
            logger.info("Shutting down: in-flight requests have %.0fs to finish (--shutdown-timeout)",
                        self.shutdown_timeout)
            self._deadline = threading.Timer(self.shutdown_timeout, self._end_requests)
            self._deadline.daemon = True
            self._deadline.start()

        def cancel_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()

        def _end_requests(self) -> None:
            if self.engine.has_requests():
                logger.warning("Shutdown timeout of %.0fs reached: ending the requests still running",
                               self.shutdown_timeout)
            self.engine.shutdown(reason=f"the server is shutting down: the request did not finish within "
                                 f"--shutdown-timeout ({self.shutdown_timeout:g}s)")

    return DrainingServer


def run_server(args: argparse.Namespace) -> int:
    """Load the engine, serve until SIGTERM / SIGINT, then stop the engine. Returns the exit code."""
    import uvicorn

    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    level = (args.log_level or envs.get("KVLOOM_LOGGING_LEVEL") or "info").lower()
    _setup_logging(level)
    config = config_from_args(args)
    load_chat_template(args.chat_template)  # a bad --chat-template fails before the model loads
    sock = _bind(args.host, args.port)
    try:
        names = served_model_names(args)
        if config.data_parallel_size > 1:
            from kvloom.entrypoints.openai.router import ReplicaRouter

            engine = ReplicaRouter(config, model_name=names[0], stats_interval=args.stats_interval,
                                   log_requests=not args.disable_log_requests, log_level=level)
        else:
            engine = AsyncLLM.from_config(config, model_name=names[0], stats_interval=args.stats_interval,
                                          log_requests=not args.disable_log_requests)
    except BaseException:
        sock.close()
        raise
    try:
        app = build_app(engine, args)
        shutdown_timeout = args.shutdown_timeout
        DrainingServer = _draining_server_class()
        # uvicorn's own deadline is a backstop: by then the engine has ended every stream.
        server = DrainingServer(uvicorn.Config(app, log_level=level, access_log=args.uvicorn_access_log,
                                               timeout_keep_alive=5,
                                               timeout_graceful_shutdown=shutdown_timeout + 1),
                                engine, shutdown_timeout)
        host, port = sock.getsockname()[:2]
        logger.info("kvloom %s serving %s at http://%s:%d (API key %s)", __version__, ", ".join(names),
                    host if ":" not in host else f"[{host}]", port,
                    "required" if (args.api_key or envs.get("KVLOOM_API_KEY")) else "off")
        # uvicorn re-raises the signal that stopped it once it has shut down; these handlers make
        # that a clean exit (the engine thread is stopped below) instead of a kill.
        received: list[int] = []
        previous = {sig: signal.signal(sig, lambda s, _: received.append(s))
                    for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            server.run(sockets=[sock])
        finally:
            server.cancel_deadline()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        engine.shutdown()
        sock.close()
    logger.info("kvloom server stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvloom.entrypoints.openai.api_server",
                                     description="kvloom's OpenAI-compatible server")
    add_server_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_server(args)
    except ValueError as e:
        print(f"kvloom serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The OpenAI-compatible HTTP server: ``kvloom serve MODEL`` or
``python -m kvloom.entrypoints.openai.api_server --model MODEL``.

Routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (behind ``--api-key`` when
one is set), ``/health``, ``/version``, ``/tokenize``, ``/detokenize`` and ``/metrics``. One
uvicorn process serves them on one asyncio loop; the engine steps in its own thread (AsyncLLM).

Every error has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``. Request
bodies are parsed here rather than by FastAPI, so that malformed JSON, wrong types and huge
numbers all end as a 400 that names the field. On SIGTERM uvicorn stops accepting connections,
lets the in-flight responses finish, and the engine thread is stopped before the process exits.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import re
import signal
import socket
import sys
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvloom import __version__, envs
from kvloom.config import config_from_args
from kvloom.engine.async_engine import AsyncLLM, EngineDeadError
from kvloom.entrypoints.openai.args import add_server_args
from kvloom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    RequestModel,
    TokenizeRequest,
    TokenizeResponse,
)
from kvloom.entrypoints.openai.serving import (
    APIError,
    OpenAIServingChat,
    OpenAIServingCompletion,
    OpenAIServingTokenization,
    error_response,
)

logger = logging.getLogger("kvloom")

MAX_BODY_BYTES = 32 << 20

RequestT = TypeVar("RequestT", bound=RequestModel)


# ---- request bodies -------------------------------------------------------------------------

async def _read_body(raw_request: Request) -> bytes:
    length = raw_request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise APIError(f"the request body is larger than {MAX_BODY_BYTES} bytes", 413)
    chunks = []
    size = 0
    async for chunk in raw_request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(f"the request body is larger than {MAX_BODY_BYTES} bytes", 413)
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


# ---- the app --------------------------------------------------------------------------------

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
    completion = OpenAIServingCompletion(engine, names, chat_template)
    chat = OpenAIServingChat(engine, names, chat_template)
    tokenization = OpenAIServingTokenization(engine, names, chat_template)

    app = FastAPI(title="kvloom", version=__version__, docs_url=None, redoc_url=None)
    app.state.engine = engine

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

    async def check_api_key(raw_request: Request) -> None:
        if api_key is None:
            return
        header = raw_request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError("Invalid or missing API key; send it as 'Authorization: Bearer <key>'", 401,
                           type="invalid_request_error", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=root, max_model_len=engine.max_model_len)
                               for name in names])

    @v1.get("/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelCard:
        completion.check_model(model_id)
        return ModelCard(id=model_id, root=root, max_model_len=engine.max_model_len)

    @v1.post("/completions")
    async def create_completion(raw_request: Request) -> Response:
        request = await parse_body(raw_request, CompletionRequest)
        return await completion.create_completion(request, raw_request)

    @v1.post("/chat/completions")
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

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(raw_request: Request) -> TokenizeResponse:
        return await tokenization.tokenize(await parse_body(raw_request, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize(raw_request: Request) -> DetokenizeResponse:
        return await tokenization.detokenize(await parse_body(raw_request, DetokenizeRequest))

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
        engine = AsyncLLM.from_config(config, model_name=names[0], stats_interval=args.stats_interval,
                          log_requests=not args.disable_log_requests)
    except BaseException:
        sock.close()
        raise
    try:
        app = build_app(engine, args)
        server = uvicorn.Server(uvicorn.Config(app, log_level=level, access_log=args.uvicorn_access_log,
                                               timeout_keep_alive=5))
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

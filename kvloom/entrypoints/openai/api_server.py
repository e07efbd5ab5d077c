"""The OpenAI-compatible HTTP server: ``kvloom serve MODEL`` or
``python -m kvloom.entrypoints.openai.api_server --model MODEL``: the app and its routes.

Routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``
(``serving_responses.py``), llama-server's ``/infill`` (``serving_infill.py``), ``/health``, ``/version``,
``/tokenize``, ``/detokenize``, ``/metrics`` and ``/dashboard``; ``/score`` and ``/rerank`` (with their ``/v1``
aliases, ``serving_score.py``). One uvicorn process serves them on
one asyncio loop; the engine steps in its own thread (AsyncLLM), or with ``--data-parallel-size N``
N engines run as replicas behind a router (``kvloom/engine/data_parallel/``) that offers the same
surface. Each endpoint family's logic is its ``serving_*.py`` module; request bodies are parsed and
documented by ``request_body.py``; ``--api-key`` is ``auth.py``; the dashboard is ``dashboard/``;
serving over HTTP with a bounded drain on SIGTERM is ``launcher.py``.

Every error has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``, but those of Anthropic's
Messages API (``/v1/messages``, ``kvloom/entrypoints/anthropic/``) and of Ollama's API (``/api/...``,
``kvloom/entrypoints/ollama/``), which have their own.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvloom import __version__, envs
from kvloom.config import config_from_args
from kvloom.engine.async_engine import AsyncLLM
from kvloom.engine.engine_client import EngineClient, EngineDeadError
from kvloom.entrypoints.anthropic.api_router import anthropic_routes
from kvloom.entrypoints.ollama.api_router import ollama_routes
from kvloom.entrypoints.openai.args import DEFAULT_MAX_REQUEST_BODY_BYTES, add_server_args
from kvloom.entrypoints.openai.auth import require_api_key
from kvloom.entrypoints.openai.cors import add_cors
from kvloom.entrypoints.openai.dashboard import dashboard_routes
from kvloom.entrypoints.openai.launcher import bind_socket, serve_http
from kvloom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    InfillRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from kvloom.entrypoints.openai.request_body import (
    BODY_ERRORS,
    ERRORS,
    describe_validation_error,
    json_body,
    openapi_schema,
    parse_body,
)
from kvloom.entrypoints.openai.serving_chat import OpenAIServingChat
from kvloom.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kvloom.entrypoints.openai.serving_embedding import OpenAIServingEmbedding, embedding_pooler_config, runner_of
from kvloom.entrypoints.openai.serving_engine import APIError, error_response, max_chars_per_token_of
from kvloom.entrypoints.openai.serving_infill import OpenAIServingInfill
from kvloom.entrypoints.openai.serving_lora import LoRAModules, lora_routes, parse_lora_modules
from kvloom.entrypoints.openai.serving_responses import responses_routes
from kvloom.entrypoints.openai.serving_score import OpenAIServingScore, score_routes
from kvloom.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from kvloom.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS
from kvloom.sampling_params import MAX_LOGPROBS

logger = logging.getLogger("kvloom")


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


def build_app(engine: EngineClient, args: argparse.Namespace) -> FastAPI:
    """The FastAPI app serving ``engine`` under the names and settings in ``args``."""
    names = served_model_names(args)
    chat_template = load_chat_template(getattr(args, "chat_template", None))
    api_key = getattr(args, "api_key", None) or envs.get("KVLOOM_API_KEY")
    root = getattr(args, "model", None)
    limits = dict(max_logprobs=getattr(args, "max_logprobs", MAX_LOGPROBS),
                  max_chars_per_token=max_chars_per_token_of(engine.tokenizer))
    completion = OpenAIServingCompletion(engine, names, chat_template, **limits)
    chat = OpenAIServingChat(engine, names, chat_template, **limits,
                             enable_auto_tools=getattr(args, "enable_auto_tool_choice", False),
                             tool_parser=getattr(args, "tool_call_parser", None),
                             reasoning_parser=getattr(args, "reasoning_parser", None))
    tokenization = OpenAIServingTokenization(engine, names, chat_template, **limits)
    embedding = OpenAIServingEmbedding(engine, names, chat_template, **limits,
                                       pooler=embedding_pooler_config(args), runner=runner_of(args))
    infill = OpenAIServingInfill(engine, names, chat_template, **limits)
    completion.runner = chat.runner = infill.runner = runner_of(args)
    scoring = OpenAIServingScore(engine, names, chat_template, **limits, runner=runner_of(args))
    completion.generation_refusal = chat.generation_refusal = infill.generation_refusal = \
        scoring.generation_refusal
    lora_modules = LoRAModules(engine, names, bool(getattr(args, "enable_lora", False)))
    for name, path, base_model_name in parse_lora_modules(getattr(args, "lora_modules", None)):
        lora_modules.add(name, path, base_model_name)
    completion.lora_modules = chat.lora_modules = tokenization.lora_modules = infill.lora_modules = lora_modules

    app = FastAPI(title="kvloom", version=__version__, docs_url=None, redoc_url=None, responses=ERRORS)
    app.state.engine = engine
    app.state.max_request_body_bytes = getattr(args, "max_request_body_bytes", DEFAULT_MAX_REQUEST_BODY_BYTES)
    if api_key:
        require_api_key(app, api_key, getattr(args, "metrics_require_key", False))
    add_cors(app, args)  # outermost: preflights are answered before the key is asked for

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
        return error_response(*describe_validation_error(list(error.errors())))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        return error_response(f"internal error: {error!r}", 500, type="server_error")

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=root, max_model_len=engine.max_model_len)
                               for name in names] + lora_modules.model_cards(engine.max_model_len))

    @v1.get("/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelCard:
        completion.check_model(model_id)
        cards = [card for card in lora_modules.model_cards(engine.max_model_len) if card.id == model_id]
        return cards[0] if cards else ModelCard(id=model_id, root=root, max_model_len=engine.max_model_len)

    @v1.post("/completions", openapi_extra=json_body(CompletionRequest), responses=BODY_ERRORS)
    async def create_completion(raw_request: Request) -> Response:
        request = await parse_body(raw_request, CompletionRequest)
        return await completion.create_completion(request, raw_request)

    @v1.post("/chat/completions", openapi_extra=json_body(ChatCompletionRequest), responses=BODY_ERRORS)
    async def create_chat_completion(raw_request: Request) -> Response:
        request = await parse_body(raw_request, ChatCompletionRequest)
        return await chat.create_chat_completion(request, raw_request)

    @v1.post("/embeddings", openapi_extra=json_body(EmbeddingRequest), responses=BODY_ERRORS)
    async def create_embedding(raw_request: Request) -> Response:
        request = await parse_body(raw_request, EmbeddingRequest)
        return await embedding.create_embedding(request, raw_request)

    app.include_router(v1)

    @app.post("/infill", openapi_extra=json_body(InfillRequest), responses=BODY_ERRORS)
    async def create_infill(raw_request: Request) -> Response:
        return await infill.create_infill(await parse_body(raw_request, InfillRequest), raw_request)
    app.include_router(anthropic_routes(chat))
    app.include_router(responses_routes(chat))
    app.include_router(lora_routes(lora_modules))
    app.include_router(score_routes(scoring))
    app.include_router(ollama_routes(chat, embedding, root or names[0], getattr(args, "device", None) or "auto"))

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return error_response(f"the engine is dead: {engine.dead_error}", 503, type="server_error",
                                  code="engine_dead")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    app.include_router(dashboard_routes(engine, names[0]))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render() + embedding.metrics_text(), media_type=CONTENT_TYPE_LATEST)

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


def run_server(args: argparse.Namespace) -> int:
    """Load the engine, serve until SIGTERM / SIGINT, then stop the engine. Returns the exit code."""

    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    level = (args.log_level or envs.get("KVLOOM_LOGGING_LEVEL") or "info").lower()
    _setup_logging(level)
    config = config_from_args(args)
    load_chat_template(args.chat_template)  # a bad --chat-template fails before the model loads
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                         f"{sorted(TOOL_CALL_PARSERS)})")
    sock = bind_socket(args.host, args.port)
    try:
        names = served_model_names(args)
        # vLLM's --disable-log-stats: no periodic stats line (what --stats-interval 0 also asks).
        stats_interval = 0.0 if config.disable_log_stats else args.stats_interval
        engine: EngineClient
        if config.data_parallel_size > 1:
            from kvloom.engine.data_parallel.router import ReplicaRouter

            engine = ReplicaRouter(config, model_name=names[0], stats_interval=stats_interval,
                                   log_requests=not args.disable_log_requests, log_level=level)
        else:
            engine = AsyncLLM.from_config(config, model_name=names[0], stats_interval=stats_interval,
                                          log_requests=not args.disable_log_requests)
    except BaseException:
        sock.close()
        raise
    try:
        app = build_app(engine, args)
        host, port = sock.getsockname()[:2]
        logger.info("kvloom %s serving %s at http://%s:%d (API key %s)", __version__, ", ".join(names),
                    host if ":" not in host else f"[{host}]", port,
                    "required" if (args.api_key or envs.get("KVLOOM_API_KEY")) else "off")
        serve_http(app, sock, engine, log_level=level, access_log=args.uvicorn_access_log,
                   shutdown_timeout=args.shutdown_timeout)
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

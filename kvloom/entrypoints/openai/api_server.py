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

Every route resolves a request's ``model`` through ``served_models.ServedModels`` (``app.state.served_models``):
one model as given (``kvloom serve MODEL``), or several (``kvloom serve A B C``), each loaded on first use.

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
from kvloom.config import DEFAULT_MODEL, EngineConfig, config_from_args
from kvloom.engine.async_engine import AsyncLLM
from kvloom.engine.engine_client import EngineClient, EngineDeadError
from kvloom.entrypoints.anthropic.api_router import anthropic_routes
from kvloom.entrypoints.ollama.api_router import ollama_routes
from kvloom.entrypoints.ollama.serving_chat import OllamaServingChat
from kvloom.entrypoints.ollama.serving_models import OllamaServingModels
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
from kvloom.entrypoints.openai.served_models import (
    ModelLeaseMiddleware,
    ModelServing,
    PooledChat,
    ServedModel,
    ServedModels,
    kv_cache_budget,
    lora_specs_by_model,
    model_args,
    model_specs,
    models_routes,
    weights_bytes,
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
from kvloom.metrics import merge_metrics, served_models_metrics
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


def model_serving(engine: EngineClient, names: list[str], args: argparse.Namespace, chat_template: str | None,
                  lora_specs: list[tuple[str, str, str | None]], *, strict_lora: bool = True,
                  can_unload: bool = False) -> ModelServing:
    """One model's endpoint families over its ``engine``, served under ``names``, with its LoRA adapters
    (``strict_lora``: an adapter that cannot be loaded is an error, else a warning)."""
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
    for name, path, base_model_name in lora_specs:
        try:
            lora_modules.add(name, path, base_model_name)
        except ValueError as error:
            if strict_lora:
                raise
            logger.warning("LoRA adapter %s is not offered on model %s: %s", name, names[0], error)
    completion.lora_modules = chat.lora_modules = tokenization.lora_modules = infill.lora_modules = lora_modules
    return ModelServing(completion, chat, tokenization, embedding, lora_modules, infill, scoring,
                        OllamaServingChat(chat, can_unload), OllamaServingModels(chat, embedding, args.model,
                                                                      getattr(args, "device", None) or "auto"))


def build_app(engine: EngineClient | ServedModels, args: argparse.Namespace) -> FastAPI:
    """The FastAPI app serving ``engine`` (one model, under the names in ``args``) or a pool of models, with
    the settings in ``args``."""
    api_key = getattr(args, "api_key", None) or envs.get("KVLOOM_API_KEY")
    if isinstance(engine, ServedModels):
        models = engine
    else:
        chat_template = load_chat_template(getattr(args, "chat_template", None))
        models = ServedModels.single(
            engine, served_model_names(args),
            lambda built, model: model_serving(built, model.spec.names, args, chat_template, model.lora_specs),
            root=getattr(args, "model", None), lora_specs=parse_lora_modules(getattr(args, "lora_modules", None)))
    pooled_chat = PooledChat(models)

    app = FastAPI(title="kvloom", version=__version__, docs_url=None, redoc_url=None, responses=ERRORS,
                  lifespan=models.lifespan)
    app.state.engine = models.default.engine
    app.state.served_models = models  # what every route resolves a request's model through
    app.state.max_request_body_bytes = getattr(args, "max_request_body_bytes", DEFAULT_MAX_REQUEST_BODY_BYTES)
    app.add_middleware(ModelLeaseMiddleware, models=models)
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
        return ModelList(data=models.model_cards())

    @v1.get("/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelCard:
        return models.model_card(model_id)

    @v1.post("/completions", openapi_extra=json_body(CompletionRequest), responses=BODY_ERRORS)
    async def create_completion(raw_request: Request) -> Response:
        request = await parse_body(raw_request, CompletionRequest)
        served = await models.acquire(request.model)
        return await served.serving.completion.create_completion(request, raw_request)

    @v1.post("/chat/completions", openapi_extra=json_body(ChatCompletionRequest), responses=BODY_ERRORS)
    async def create_chat_completion(raw_request: Request) -> Response:
        request = await parse_body(raw_request, ChatCompletionRequest)
        served = await models.acquire(request.model)
        return await served.serving.chat.create_chat_completion(request, raw_request)

    @v1.post("/embeddings", openapi_extra=json_body(EmbeddingRequest), responses=BODY_ERRORS)
    async def create_embedding(raw_request: Request) -> Response:
        request = await parse_body(raw_request, EmbeddingRequest)
        served = await models.acquire(request.model)
        return await served.serving.embedding.create_embedding(request, raw_request)

    app.include_router(v1)

    @app.post("/infill", openapi_extra=json_body(InfillRequest), responses=BODY_ERRORS)
    async def create_infill(raw_request: Request) -> Response:
        request = await parse_body(raw_request, InfillRequest)
        served = await models.acquire(request.model)
        return await served.serving.infill.create_infill(request, raw_request)

    app.include_router(anthropic_routes(pooled_chat))
    app.include_router(responses_routes(pooled_chat))
    app.include_router(lora_routes(models))
    app.include_router(models_routes(models))
    app.include_router(score_routes(models))
    app.include_router(ollama_routes(models))

    @app.get("/health")
    async def health() -> Response:
        for model in models.loaded():
            if model.engine.errored:
                where = f" (model {model.name})" if models.several else ""
                return error_response(f"the engine is dead{where}: {model.engine.dead_error}", 503,
                                      type="server_error", code="engine_dead")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    app.include_router(dashboard_routes(models))

    @app.get("/metrics")
    async def metrics() -> Response:
        texts = [model.engine.metrics.render() + model.serving.embedding.metrics_text() for model in models.loaded()]
        if models.several:
            texts = [merge_metrics([*texts, served_models_metrics(models.metric_rows())])]
        return Response(b"".join(texts), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", openapi_extra=json_body(TokenizeRequest), responses=BODY_ERRORS)
    async def tokenize(raw_request: Request) -> TokenizeResponse:
        request = await parse_body(raw_request, TokenizeRequest)
        served = await models.acquire(request.model)
        return await served.serving.tokenization.tokenize(request)

    @app.post("/detokenize", openapi_extra=json_body(DetokenizeRequest), responses=BODY_ERRORS)
    async def detokenize(raw_request: Request) -> DetokenizeResponse:
        request = await parse_body(raw_request, DetokenizeRequest)
        served = await models.acquire(request.model)
        return await served.serving.tokenization.detokenize(request)

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


def model_items(args: argparse.Namespace) -> list[str]:
    """The models to serve: ``--model`` where given, then the positional ones (default: the default model)."""
    items = ([args.model] if getattr(args, "model", None) else []) + list(getattr(args, "model_tag", None) or [])
    return items or [DEFAULT_MODEL]


def run_server(args: argparse.Namespace) -> int:
    """Load the engine(s), serve until SIGTERM / SIGINT, then stop them. Returns the exit code."""

    level = (args.log_level or envs.get("KVLOOM_LOGGING_LEVEL") or "info").lower()
    _setup_logging(level)
    specs = model_specs(model_items(args), served_model_names_flag(args))
    args.model = specs[0].model
    config = config_from_args(args)
    chat_template = load_chat_template(args.chat_template)  # a bad --chat-template fails before the model loads
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                         f"{sorted(TOOL_CALL_PARSERS)})")
    lora_specs = lora_specs_by_model(specs, parse_lora_modules(getattr(args, "lora_modules", None)),
                                     getattr(args, "default_model", None) or specs[0].name)
    # vLLM's --disable-log-stats: no periodic stats line (what --stats-interval 0 also asks).
    stats_interval = 0.0 if config.disable_log_stats else args.stats_interval
    models_by_name = {spec.name: ServedModel(spec, config if i == 0 else replace_model(config, spec.model), 0,
                                             lora_specs[spec.name]) for i, spec in enumerate(specs)}

    def build_engine(model: ServedModel) -> EngineClient:
        model_config = model.config
        if model_config.data_parallel_size > 1:
            from kvloom.engine.data_parallel.router import ReplicaRouter

            return ReplicaRouter(model_config, model_name=model.name, stats_interval=stats_interval,
                                 log_requests=not args.disable_log_requests, log_level=level)
        return AsyncLLM.from_config(model_config, model_name=model.name, stats_interval=stats_interval,
                                    log_requests=not args.disable_log_requests)

    def build_serving(engine: EngineClient, model: ServedModel) -> ModelServing:
        return model_serving(engine, model.spec.names, model_args(args, model.spec), chat_template, model.lora_specs,
                             strict_lora=model.loads == 0,
                             can_unload=model.config is not None and len(models_by_name) > 1)

    sock = bind_socket(args.host, args.port)
    try:
        for model in models_by_name.values():
            model.size_bytes = weights_bytes(model.config.model) + kv_cache_budget(model.config)
        models = ServedModels(list(models_by_name.values()), build_engine=build_engine, build_serving=build_serving,
                              default_model=getattr(args, "default_model", None), idle_timeout=args.model_idle_timeout,
                              max_loaded_models=args.max_loaded_models, memory_budget=args.models_memory_budget)
        default = models.default
        if models.memory_budget is not None and default.size_bytes > models.memory_budget:
            raise ValueError(f"the default model {default.name!r} needs about {default.size_bytes} bytes (weights "
                             f"and KV cache), more than --models-memory-budget ({models.memory_budget})")
        models.adopt(default, build_engine(default))  # the default model loads at start, as one model always did
    except BaseException:
        sock.close()
        raise
    try:
        app = build_app(models, args)
        host, port = sock.getsockname()[:2]
        logger.info("kvloom %s serving %s at http://%s:%d (API key %s)", __version__, ", ".join(models.names()),
                    host if ":" not in host else f"[{host}]", port,
                    "required" if (args.api_key or envs.get("KVLOOM_API_KEY")) else "off")
        serve_http(app, sock, models, log_level=level, access_log=args.uvicorn_access_log,
                   shutdown_timeout=args.shutdown_timeout)
    finally:
        models.shutdown()
        sock.close()
    logger.info("kvloom server stopped")
    return 0


def served_model_names_flag(args: argparse.Namespace) -> list[str] | None:
    names = getattr(args, "served_model_name", None)
    return [names] if isinstance(names, str) else names


def replace_model(config: EngineConfig, model: str) -> EngineConfig:
    """``config`` for another model: every other setting the same."""
    return EngineConfig.from_kwargs(**{**config.to_dict(), "model": model})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvloom.entrypoints.openai.api_server",
                                     description="kvloom's OpenAI-compatible server")
    parser.add_argument("model_tag", nargs="*", default=None, metavar="MODEL",
                        help="more models to serve beside --model, each [NAME=]MODEL (docs/serving.md, Many models)")
    add_server_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_server(args)
    except ValueError as e:
        print(f"kvloom serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

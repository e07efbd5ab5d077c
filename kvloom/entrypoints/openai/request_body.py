"""Request bodies: read and parsed here rather than by FastAPI, and documented in ``/openapi.json``
as if FastAPI had parsed them.

Malformed JSON, wrong types and huge numbers all end as a 400 that names the field; a body that
is not ``application/json`` is a 415 and one over ``--max-request-body-bytes`` a 413, both before
it is read. ``json_body`` documents each route's body model and these errors (never FastAPI's 422).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from pydantic import ValidationError
from pydantic.json_schema import models_json_schema

from kvloom.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
from kvloom.entrypoints.ollama.protocol import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
)
from kvloom.entrypoints.openai.args import DEFAULT_MAX_REQUEST_BODY_BYTES
from kvloom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ErrorResponse,
    InfillRequest,
    RequestModel,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
)
from kvloom.entrypoints.openai.responses_protocol import ResponsesRequest
from kvloom.entrypoints.openai.serving_engine import APIError

logger = logging.getLogger("kvloom")

RequestT = TypeVar("RequestT", bound=RequestModel)


async def _read_body(raw_request: Request, any_content_type: bool = False) -> bytes:
    """The body, refused before it is read when it is not JSON (415, unless ``any_content_type``) or too large
    (413)."""
    content_type = raw_request.headers.get("content-type", "")
    if not any_content_type and content_type.partition(";")[0].strip().lower() != "application/json":
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


async def parse_body(raw_request: Request, model: type[RequestT], any_content_type: bool = False) -> RequestT:
    """The JSON body as a request model; a 400 naming the field for anything malformed. ``any_content_type``: read
    it as JSON whatever its Content-Type (Ollama's API does)."""
    body = await _read_body(raw_request, any_content_type)
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
        raise APIError(*describe_validation_error(e.errors(include_url=False))) from None
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


def describe_validation_error(errors: list[Any]) -> tuple[str, int, str | None]:
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


# ---- the OpenAPI document ----------------------------------------------------------------

REQUEST_MODELS: tuple[type[RequestModel], ...] = (CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                                                  DetokenizeRequest, EmbeddingRequest,
                                                  AnthropicMessagesRequest, AnthropicCountTokensRequest,
                                                  ResponsesRequest, InfillRequest, ScoreRequest, RerankRequest,
                                                  OllamaChatRequest, OllamaGenerateRequest, OllamaEmbedRequest,
                                                  OllamaEmbeddingsRequest, OllamaShowRequest)
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

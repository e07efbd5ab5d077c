"""The Messages API's routes: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Every answer under ``/v1/messages`` is in Anthropic's shape, errors included: a body that does not validate,
an unknown model, a dead engine, an unknown path or method below it, and (``auth.py``) a missing key. The
app's handlers, which write OpenAI's shape, never see an error of these routes.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvloom.entrypoints.anthropic.protocol import (
    AnthropicCountTokensRequest,
    AnthropicCountTokensResponse,
    AnthropicErrorResponse,
    AnthropicMessage,
    AnthropicMessagesRequest,
    error_response,
)
from kvloom.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from kvloom.entrypoints.openai.request_body import json_body, parse_body
from kvloom.entrypoints.openai.serving_chat import OpenAIServingChat
from kvloom.entrypoints.openai.serving_engine import answered_in_shape

logger = logging.getLogger("kvloom")

MESSAGES_PATH = "/v1/messages"

# Documented in /openapi.json in place of the app's OpenAI-shaped errors.
ERRORS: dict[int | str, dict[str, object]] = {
    400: {"model": AnthropicErrorResponse, "description": "Invalid request: the message names the field"},
    413: {"model": AnthropicErrorResponse, "description": "The body is over --max-request-body-bytes"},
    415: {"model": AnthropicErrorResponse, "description": "The body is not sent as application/json"},
    "4XX": {"model": AnthropicErrorResponse, "description": "Client error"},
    "5XX": {"model": AnthropicErrorResponse, "description": "Server error (503: the engine is not running)"},
}


def is_messages_path(path: str) -> bool:
    """Whether ``path`` is the Messages API's (its answers, 401s included, are in Anthropic's shape)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


# Every error a route raises answered in the API's shape.
in_anthropic_shape = answered_in_shape(error_response, "a Messages API")


def anthropic_routes(chat: OpenAIServingChat) -> APIRouter:
    """The Messages API's routes over the chat serving ``chat``."""
    serving = AnthropicServingMessages(chat)
    router = APIRouter(prefix=MESSAGES_PATH)

    @router.post("", openapi_extra=json_body(AnthropicMessagesRequest),
                 responses={200: {"model": AnthropicMessage, "description": "The message, or with stream: true its "
                                  "server-sent events"}, **ERRORS})
    @in_anthropic_shape
    async def create_message(raw_request: Request) -> Response:
        request = await parse_body(raw_request, AnthropicMessagesRequest)
        return await serving.create_message(request, raw_request)

    @router.post("/count_tokens", openapi_extra=json_body(AnthropicCountTokensRequest),
                 responses={200: {"model": AnthropicCountTokensResponse, "description": "The prompt's tokens"},
                            **ERRORS})
    @in_anthropic_shape
    async def count_tokens(raw_request: Request) -> Response:
        request = await parse_body(raw_request, AnthropicCountTokensRequest)
        return JSONResponse((await serving.count_tokens(request)).model_dump())

    async def elsewhere(raw_request: Request) -> Response:
        path = raw_request.url.path
        if path in (MESSAGES_PATH, MESSAGES_PATH + "/count_tokens"):
            return error_response(f"{raw_request.method} is not allowed on {path}; use POST", 405)
        return error_response(f"no route {path}: the Messages API serves POST {MESSAGES_PATH} and POST "
                              f"{MESSAGES_PATH}/count_tokens", 404)

    # Registered after the two routes: any other method or path below them.
    for path in ("", "/{rest:path}"):
        router.add_api_route(path, elsewhere, methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
                             include_in_schema=False)

    return router

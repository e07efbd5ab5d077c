"""``--api-key`` (or ``KVLOOM_API_KEY``): every route but ``/health`` (and ``/metrics``, unless
``--metrics-require-key``) needs ``Authorization: Bearer <key>``; the Messages API's routes take the key as
Anthropic's clients send it, ``x-api-key: <key>``, too, and answer a missing one in Anthropic's error shape; Ollama's
routes (``/api/...``) answer it in Ollama's."""

from __future__ import annotations

import hmac

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from kvloom.entrypoints.anthropic import protocol as anthropic
from kvloom.entrypoints.anthropic.api_router import is_messages_path
from kvloom.entrypoints.ollama import protocol as ollama
from kvloom.entrypoints.ollama.api_router import is_ollama_path
from kvloom.entrypoints.openai.serving_engine import error_response


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
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), self.api_key):
            await self.app(scope, receive, send)
            return
        if is_messages_path(scope["path"]):
            if hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self.api_key):
                await self.app(scope, receive, send)
                return
            response = anthropic.error_response("Invalid or missing API key; send it as 'x-api-key: <key>' or "
                                                "'Authorization: Bearer <key>'", 401)
        elif is_ollama_path(scope["path"]):
            response = ollama.error_response("unauthorized: send the API key as 'Authorization: Bearer <key>'", 401)
        else:
            response = error_response("Invalid or missing API key; send it as 'Authorization: Bearer <key>'",
                                      401, code="invalid_api_key")
        await response(scope, receive, send)


def require_api_key(app: FastAPI, api_key: str, metrics_require_key: bool) -> None:
    """Put ``app`` behind ``api_key``; ``/health`` stays open, and ``/metrics`` unless ``metrics_require_key``."""
    open_paths = {"/health"} if metrics_require_key else {"/health", "/metrics"}
    app.add_middleware(APIKeyMiddleware, api_key=api_key, open_paths=frozenset(open_paths))

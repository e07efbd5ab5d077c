"""CORS, with vLLM's flags: ``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers`` (JSON lists) and
``--allow-credentials``. Off unless one is given: a server started without them sends no CORS headers, so a
browser page on another origin cannot call it. When on, Starlette's CORSMiddleware answers preflights and
decorates every response; it sits outside ``--api-key``'s check, so a preflight (which never carries the key)
is answered rather than refused."""

from __future__ import annotations

import argparse
import json
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

# vLLM's defaults for the lists a server with CORS on does not name.
DEFAULT_ALLOWED = ["*"]


def json_list(value: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's spelling: '["https://a.example", "https://b.example"]')."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"must be a JSON list of strings such as '[\"*\"]', got {value!r} ({e})") from None
    if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings such as '[\"*\"]', got {value!r}")
    return parsed


def add_cors_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allowed-origins", type=json_list, default=None, metavar="JSON",
                        help="CORS: the origins browsers may call from, a JSON list ('[\"*\"]' for any); "
                        "CORS is off (no CORS headers) unless this or another CORS flag is given")
    parser.add_argument("--allowed-methods", type=json_list, default=None, metavar="JSON",
                        help="CORS: the methods allowed, a JSON list (default with CORS on: '[\"*\"]')")
    parser.add_argument("--allowed-headers", type=json_list, default=None, metavar="JSON",
                        help="CORS: the request headers allowed, a JSON list (default with CORS on: '[\"*\"]')")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="CORS: let browsers send cookies / credentials (a wildcard origin then answers "
                        "with the caller's origin)")


def add_cors(app: FastAPI, args: Any) -> None:
    """CORSMiddleware around ``app`` when any CORS flag is set; nothing otherwise. Call it after the other
    middlewares, so that it is the outermost."""
    origins = getattr(args, "allowed_origins", None)
    methods = getattr(args, "allowed_methods", None)
    headers = getattr(args, "allowed_headers", None)
    credentials = bool(getattr(args, "allow_credentials", False))
    if origins is None and methods is None and headers is None and not credentials:
        return
    app.add_middleware(CORSMiddleware, allow_origins=origins if origins is not None else DEFAULT_ALLOWED,
                       allow_methods=methods if methods is not None else DEFAULT_ALLOWED,
                       allow_headers=headers if headers is not None else DEFAULT_ALLOWED,
                       allow_credentials=credentials)

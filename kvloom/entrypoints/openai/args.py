"""Flags of ``kvloom serve``: every engine argument (from EngineConfig) plus the server's own."""

from __future__ import annotations

import argparse

from kvloom.config import add_engine_args

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--api-key", default=None,
                        help="require this key as a Bearer token on /v1/* (also KVLOOM_API_KEY)")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model name(s) clients use; the first is reported in responses "
                        "and metrics (default: the model argument)")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, or a file holding one (default: the model's)")
    parser.add_argument("--log-level", default=None, type=str.lower, choices=LOG_LEVELS,
                        help="uvicorn and kvloom log level (default: KVLOOM_LOGGING_LEVEL or info)")
    parser.add_argument("--stats-interval", type=float, default=10.0,
                        help="seconds between engine stats log lines (0 turns them off)")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="do not log a line per finished request")
    parser.add_argument("--uvicorn-access-log", action="store_true",
                        help="also log uvicorn's line per HTTP request")

"""Flags of ``kvloom serve``: every engine argument (from EngineConfig) plus the server's own."""

from __future__ import annotations

import argparse

from kvloom.config import add_engine_args
from kvloom.entrypoints.openai.cors import add_cors_args
from kvloom.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS
from kvloom.sampling_params import MAX_LOGPROBS

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# 8 MiB holds any prompt a served context can take: a 128k-token context is at most ~2M characters
# (16 per token, see serving.MIN_CHARS_PER_TOKEN), 4 UTF-8 bytes each at worst; a body that large
# still parses in tens of milliseconds, so one request cannot hold the event loop for long.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20


def add_server_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--api-key", default=None,
                        help="require this key as a Bearer token on every route but /health "
                        "(and /metrics, unless --metrics-require-key); also KVLOOM_API_KEY")
    parser.add_argument("--metrics-require-key", action="store_true",
                        help="with an API key, /metrics needs it too")
    parser.add_argument("--max-request-body-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="larger request bodies are refused with 413 before they are read "
                        "(default 8 MiB)")
    parser.add_argument("--max-logprobs", type=_positive_int, default=MAX_LOGPROBS,
                        help="most logprobs / top_logprobs per position a request may ask for (as vLLM's)")
    parser.add_argument("--shutdown-timeout", type=_non_negative_float, default=20.0,
                        help="seconds SIGTERM lets in-flight requests finish before they are ended "
                        "with an error; a second signal exits at once")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model name(s) clients use; the first is reported in responses "
                        "and metrics (default: the model argument)")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="with --enable-lora: LoRA adapters served by name, as name=path or vLLM's JSON "
                        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, or a file holding one (default: the model's)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="let the model decide when to call tools (tool_choice 'auto'); needs "
                        "--tool-call-parser")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                        help="how tool calls are read from the model's text: hermes (ChatML models such as "
                        "SmolLM2, Qwen, Hermes), llama3_json, mistral, pythonic")
    parser.add_argument("--log-level", default=None, type=str.lower, choices=LOG_LEVELS,
                        help="uvicorn and kvloom log level (default: KVLOOM_LOGGING_LEVEL or info)")
    parser.add_argument("--stats-interval", type=float, default=10.0,
                        help="seconds between engine stats log lines (0 turns them off)")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="do not log a line per finished request")
    parser.add_argument("--uvicorn-access-log", action="store_true",
                        help="also log uvicorn's line per HTTP request")
    add_cors_args(parser)


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def _non_negative_float(value: str) -> float:
    number = float(value)
    if not number >= 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {value}")
    return number

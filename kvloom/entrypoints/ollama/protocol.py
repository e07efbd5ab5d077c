"""Ollama's API bodies (docs/api.md and api/types.go of ollama/ollama): the requests of ``/api/chat``,
``/api/generate``, ``/api/embed``, ``/api/embeddings`` and ``/api/show``, the answers of the listings, the
error shape ``{"error": "..."}``, ``keep_alive`` durations, and RFC 3339 timestamps.

Requests accept unknown fields (ignored with a warning, as the OpenAI routes do); ``options`` accepts unknown
options too, as Ollama does, and honours vLLM's extra sampling fields there (``EXTRA_SAMPLING_FIELDS``).
"""

from __future__ import annotations

import datetime
import math
import re
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from kvloom.entrypoints.openai.protocol import RequestModel, ResponseModel

# ---- requests ---------------------------------------------------------------------------------

KeepAlive = StrictInt | StrictFloat | StrictStr


class OllamaOptions(RequestModel):
    """``options``: the Modelfile parameters a request may set (api/types.go ``Options``)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: StrictStr | list[StrictStr] | None = None
    num_ctx: int | None = Field(None, ge=1)
    # Sampling kvloom does not implement: refused unless neutral (serving_chat.REFUSED_OPTIONS).
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    repeat_last_n: int | None = None
    penalize_newline: bool | None = None  # Ollama itself no longer reads it
    # How Ollama's runner runs the model: kvloom's own flags decide these; accepted and not used.
    num_keep: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    num_thread: int | None = None
    draft_num_predict: int | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    vocab_only: bool | None = None
    logits_all: bool | None = None
    embedding_only: bool | None = None


class OllamaToolCallFunction(RequestModel):
    index: int | None = None
    name: StrictStr
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(RequestModel):
    """An assistant's call of a tool, as this API returned it (``id`` since Ollama 0.12)."""

    id: StrictStr | None = None
    function: OllamaToolCallFunction


class OllamaMessage(RequestModel):
    role: StrictStr  # system, user, assistant or tool (any case, as Ollama lowercases it)
    content: StrictStr = ""
    thinking: StrictStr | None = None
    images: list[StrictStr] | None = None  # base64, no data: prefix
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: StrictStr | None = None
    tool_call_id: StrictStr | None = None


class OllamaGenerationFields(RequestModel):
    """What ``/api/chat`` and ``/api/generate`` share."""

    model: StrictStr
    stream: bool = True
    format: StrictStr | dict[str, Any] | None = None  # "json" or a JSON schema
    options: OllamaOptions | None = None
    think: StrictBool | StrictStr | None = None  # true / false, or "low", "medium", "high", "max"
    keep_alive: KeepAlive | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Ollama trims the history (truncate) or shifts the context (shift) past the context length; kvloom does
    # neither (a prompt over the context is a 400). Accepted, as both are Ollama's default.
    truncate: bool | None = None
    shift: bool | None = None


class OllamaChatRequest(OllamaGenerationFields):
    """``POST /api/chat``."""

    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(OllamaGenerationFields):
    """``POST /api/generate``."""

    prompt: StrictStr = ""
    suffix: StrictStr = ""
    system: StrictStr = ""
    template: StrictStr = ""
    context: list[int] | None = None
    raw: bool = False
    images: list[StrictStr] | None = None


class OllamaEmbedRequest(RequestModel):
    """``POST /api/embed``."""

    model: StrictStr
    input: StrictStr | list[StrictStr]
    truncate: bool = True
    dimensions: int | None = None
    options: OllamaOptions | None = None
    keep_alive: KeepAlive | None = None


class OllamaEmbeddingsRequest(RequestModel):
    """``POST /api/embeddings`` (superseded by ``/api/embed``): one prompt, one embedding."""

    model: StrictStr
    prompt: StrictStr = ""
    options: OllamaOptions | None = None
    keep_alive: KeepAlive | None = None


class OllamaShowRequest(RequestModel):
    """``POST /api/show`` (``name``: the older spelling of ``model``)."""

    model: StrictStr | None = None
    name: StrictStr | None = None
    verbose: bool = False


# ---- answers ----------------------------------------------------------------------------------


class OllamaModelDetails(ResponseModel):
    parent_model: str = ""
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class OllamaListedModel(ResponseModel):
    """An entry of ``/api/tags``."""

    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: OllamaModelDetails


class OllamaRunningModel(ResponseModel):
    """An entry of ``/api/ps``."""

    name: str
    model: str
    size: int
    digest: str
    details: OllamaModelDetails
    expires_at: str
    size_vram: int
    context_length: int


class OllamaShowResponse(ResponseModel):
    modelfile: str
    parameters: str
    template: str
    details: OllamaModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class OllamaErrorResponse(ResponseModel):
    error: str


def error_response(message: str, status_code: int) -> JSONResponse:
    """Ollama's error: ``{"error": message}`` with ``status_code``."""
    return JSONResponse(OllamaErrorResponse(error=message).model_dump(), status_code=status_code)


# ---- keep_alive -------------------------------------------------------------------------------

# Go's time.ParseDuration: a sequence of decimal numbers, each with a unit ("1h30m", "1.5s", "300ms").
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
KEEP_ALIVE_FOREVER = math.inf


def parse_keep_alive(value: Any) -> float | None:
    """``keep_alive`` in seconds, as Ollama reads it: a number of seconds or a Go duration string ("5m", "1h30m",
    "0"); 0 unloads the model after the request, a negative value keeps it loaded for ever
    (``KEEP_ALIVE_FOREVER``); None when the request gave none (Ollama's default is 5 minutes). ValueError naming
    what is allowed for anything else."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"keep_alive must be a number of seconds or a duration such as \"5m\", got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"keep_alive must be a finite number of seconds, got {value!r}")
        return KEEP_ALIVE_FOREVER if value < 0 else float(value)
    text = value.strip()
    sign, body = (text[0], text[1:]) if text[:1] in "+-" and text else ("+", text)
    if body == "0":
        return 0.0
    seconds, position = 0.0, 0
    for match in _DURATION_PART.finditer(body):
        if match.start() != position:
            break
        seconds += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        position = match.end()
    if not body or position != len(body):
        raise ValueError(f"keep_alive {value!r} is not a duration: give a number of seconds, or numbers with units "
                         f"ns, us, ms, s, m, h (\"5m\", \"1h30m\", \"0\"); a negative one keeps the model loaded")
    return KEEP_ALIVE_FOREVER if sign == "-" and seconds > 0 else seconds


# ---- times ------------------------------------------------------------------------------------


def rfc3339(seconds: float) -> str:
    """A Unix time as RFC 3339 in UTC with microseconds: ``2024-07-22T20:47:51.147561Z``."""
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def nanoseconds(seconds: float) -> int:
    """A duration as Ollama gives every duration: whole nanoseconds, never negative."""
    return max(0, round(seconds * 1e9))

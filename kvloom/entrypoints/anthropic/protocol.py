"""Anthropic's Messages API bodies: the request (``POST /v1/messages``, ``/v1/messages/count_tokens``), the
message it answers with, its stream events' payloads and its error shape.

Requests accept unknown fields (ignored with a warning, as the OpenAI routes do), so newer clients keep working;
content blocks are checked by their ``type``, so a wrong block is a 400 that names where it is.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import Discriminator, Field, StrictStr, Tag

from kvloom.entrypoints.openai.protocol import RequestModel, ResponseModel

# ---- content blocks of a request ------------------------------------------------------------


def string_or_blocks(block: Any) -> Any:
    """A field that is a string or a list of ``block``: a list is checked as blocks only, so that a bad block
    is reported as such (not as "not a valid string")."""
    return Annotated[Annotated[StrictStr, Tag("str")] | Annotated[list[block], Tag("list[block]")],
                     Discriminator(lambda value: "list[block]" if isinstance(value, list) else "str")]



class AnthropicTextBlock(RequestModel):
    type: Literal["text"]
    text: StrictStr


class AnthropicBase64ImageSource(RequestModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: StrictStr


class AnthropicURLImageSource(RequestModel):
    type: Literal["url"]
    url: StrictStr


class AnthropicImageBlock(RequestModel):
    type: Literal["image"]
    source: Annotated[AnthropicBase64ImageSource | AnthropicURLImageSource, Field(discriminator="type")]


class AnthropicToolUseBlock(RequestModel):
    """An assistant's call of a tool, as this API returned it."""

    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]


AnthropicToolResultContent = Annotated[AnthropicTextBlock | AnthropicImageBlock, Field(discriminator="type")]


class AnthropicToolResultBlock(RequestModel):
    """A user's answer to the tool call ``tool_use_id``."""

    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: string_or_blocks(AnthropicToolResultContent) | None = None
    is_error: bool = False


class AnthropicThinkingBlock(RequestModel):
    """An assistant's reasoning, sent back in the history (``signature`` is accepted and not checked)."""

    type: Literal["thinking"]
    thinking: StrictStr
    signature: str | None = None


class AnthropicRedactedThinkingBlock(RequestModel):
    type: Literal["redacted_thinking"]
    data: str | None = None


AnthropicContentBlock = Annotated[AnthropicTextBlock | AnthropicImageBlock | AnthropicToolUseBlock
                                  | AnthropicToolResultBlock | AnthropicThinkingBlock | AnthropicRedactedThinkingBlock,
                                  Field(discriminator="type")]


class AnthropicInputMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: string_or_blocks(AnthropicContentBlock)


# ---- tools ------------------------------------------------------------------------------------


class AnthropicTool(RequestModel):
    """A client tool: its name, what it does, and the JSON schema of its ``input``."""

    type: Literal["custom"] | None = None
    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoiceAuto(RequestModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class AnthropicToolChoiceAny(RequestModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class AnthropicToolChoiceTool(RequestModel):
    type: Literal["tool"]
    name: StrictStr
    disable_parallel_tool_use: bool = False


class AnthropicToolChoiceNone(RequestModel):
    type: Literal["none"]


AnthropicToolChoice = Annotated[AnthropicToolChoiceAuto | AnthropicToolChoiceAny | AnthropicToolChoiceTool
                                | AnthropicToolChoiceNone, Field(discriminator="type")]


# ---- requests ---------------------------------------------------------------------------------


class AnthropicCountTokensRequest(RequestModel):
    """``/v1/messages/count_tokens``: the conversation whose prompt is counted."""

    model: StrictStr
    messages: list[AnthropicInputMessage] = Field(min_length=1)
    system: string_or_blocks(AnthropicTextBlock) | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    # {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}: the template's enable_thinking.
    thinking: dict[str, Any] | None = None
    # vLLM's extra: more variables for the chat template.
    chat_template_kwargs: dict[str, Any] | None = None


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    """``/v1/messages``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[StrictStr] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # {"user_id": ...}: accepted, not used
    stream: bool = False


# ---- responses --------------------------------------------------------------------------------

AnthropicStopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicUsage(ResponseModel):
    """Anthropic's usage: ``input_tokens`` are the prompt tokens computed, ``cache_read_input_tokens`` those the
    prefix cache served (their sum is the prompt; as llama-server reports them)."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0


class AnthropicTextContent(ResponseModel):
    type: Literal["text"] = "text"
    text: str


class AnthropicThinkingContent(ResponseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # kvloom signs nothing; the field is there because clients read it


class AnthropicToolUseContent(ResponseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class AnthropicMessage(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[AnthropicTextContent | AnthropicThinkingContent | AnthropicToolUseContent]
    stop_reason: AnthropicStopReason | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class AnthropicCountTokensResponse(ResponseModel):
    input_tokens: int


# ---- errors -----------------------------------------------------------------------------------


class AnthropicErrorDetail(ResponseModel):
    type: str
    message: str


class AnthropicErrorResponse(ResponseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


# Anthropic's error type of each HTTP status kvloom answers with (any other 4xx is invalid_request_error, any
# other 5xx api_error). 503: the engine is not running, which this API calls being overloaded.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}


def error_type(status_code: int) -> str:
    return ERROR_TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "api_error")


def error_body(message: str, status_code: int) -> dict[str, Any]:
    detail = AnthropicErrorDetail(type=error_type(status_code), message=message)
    return AnthropicErrorResponse(error=detail).model_dump()


def error_response(message: str, status_code: int) -> JSONResponse:
    """``{"type": "error", "error": {"type", "message"}}`` with ``status_code``."""
    return JSONResponse(error_body(message, status_code), status_code=status_code)

"""The Responses API's request and response bodies (``/v1/responses``), as OpenAI's documents them.

The request keeps ``input`` items as plain objects: ``serving_responses.py`` reads them one by one, with errors
that name the item (``input[2].call_id``). Fields OpenAI has and kvloom does not use (``include``,
``truncation``, ``prompt_cache_key``, ...) are accepted and ignored, as every kvloom request does.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from kvloom.entrypoints.openai.protocol import RequestModel, ResponseModel


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None  # {"effort", "summary"}: accepted; a --reasoning-parser decides


# ---- output items ---------------------------------------------------------------------------

class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(ResponseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class FunctionToolCall(ResponseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(ResponseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | FunctionToolCall | ReasoningItem


# ---- the response -----------------------------------------------------------------------------

class InputTokensDetails(ResponseModel):
    cached_tokens: int = 0  # input tokens served from the prefix cache (whole blocks)
    cache_write_tokens: int = 0


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(ResponseModel):
    code: Literal["server_error", "invalid_prompt"]
    message: str


class ResponseObject(ResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "failed", "in_progress", "incomplete"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class ResponseDeleted(ResponseModel):
    id: str
    object: Literal["response"] = "response"  # as OpenAI answers a DELETE
    deleted: bool = True

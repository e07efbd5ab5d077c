"""The Responses API's parts that need no model: the response store's bounds (LRU and time limit, per API key),
the translation of input items into chat messages, and the stream's events when the engine fails mid-answer,
each event checked against the ``openai`` package's own event types."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, get_args

import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel

from kvloom.engine.engine_client import EngineDeadError
from kvloom.entrypoints.openai.protocol import (
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
)
from kvloom.entrypoints.openai.responses_protocol import ResponseObject, ResponsesRequest
from kvloom.entrypoints.openai.serving_chat import ChatRun
from kvloom.entrypoints.openai.serving_engine import APIError
from kvloom.entrypoints.openai.serving_responses import OpenAIServingResponses, ResponseStore, chat_messages

# The openai package's event class of each event type.
EVENT_TYPES: dict[str, type[BaseModel]] = {
    get_args(cls.model_fields["type"].annotation)[0]: cls for cls in get_args(get_args(ResponseStreamEvent)[0])}


def stored(response_id: str) -> ResponseObject:
    return ResponseObject(id=response_id, status="completed", model="m")


def test_store_drops_the_least_recently_used_and_the_expired() -> None:
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl_s=10.0, clock=lambda: now[0])
    store.put("a", stored("resp_1"), [])
    store.put("a", stored("resp_2"), [])
    assert store.get("a", "resp_1") is not None  # resp_1 is now the most recently used
    store.put("a", stored("resp_3"), [])
    assert store.get("a", "resp_2") is None and store.get("a", "resp_1") is not None and len(store) == 2
    now[0] = 10.0
    assert store.get("a", "resp_1") is None and len(store) == 0


def test_store_is_per_api_key() -> None:
    store = ResponseStore()
    store.put("a", stored("resp_1"), [{"role": "user", "content": "hi"}])
    assert store.get("b", "resp_1") is None and store.get(None, "resp_1") is None
    assert not store.delete("b", "resp_1")
    assert store.get("a", "resp_1").items == [{"role": "user", "content": "hi"}]
    assert store.delete("a", "resp_1") and store.get("a", "resp_1") is None


def test_items_become_the_chat_conversation() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Look:"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "auto"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "g", "arguments": "{\"x\":1}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "two"}]},
    ]
    assert chat_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Look:"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "hm", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{\"x\":1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "one"},
        {"role": "tool", "tool_call_id": "call_2", "content": "two"},
    ]


@pytest.mark.parametrize(("items", "param"), [
    ([{"role": "tool", "content": "x"}], "input[0].role"),
    ([{"type": "function_call", "call_id": "c", "name": "f"}], "input[0].arguments"),
    ([{"role": "assistant", "content": [{"type": "input_image", "image_url": "u"}]}], "input[0].content[0].type"),
    ([{"type": "item_reference", "id": "x"}], "input[0].type"),
])
def test_bad_items_name_the_field(items: list[dict[str, Any]], param: str) -> None:
    with pytest.raises(APIError) as info:
        chat_messages(items)
    assert info.value.param == param and info.value.status_code == 400


class FailingChat:
    """A chat serving whose stream sends some text and a tool call's start, then finds the engine dead."""

    async def chat_chunks(self, run: ChatRun) -> AsyncIterator[ChatCompletionStreamResponse]:
        def chunk(delta: DeltaMessage) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(id=run.request_id, created=run.created, model=run.model, choices=[
                ChatCompletionResponseStreamChoice(index=0, delta=delta)])

        yield chunk(DeltaMessage(role="assistant", content=""))
        yield chunk(DeltaMessage(content="Hel"))
        yield chunk(DeltaMessage(content="lo"))
        yield chunk(DeltaMessage(tool_calls=[DeltaToolCall(index=0, id="chatcmpl-tool-abc", type="function",
                                                           function=DeltaFunctionCall(name="f", arguments="{"))]))
        raise EngineDeadError("the engine died")


def test_a_failure_mid_stream_is_an_error_event_then_response_failed() -> None:
    async def nothing() -> AsyncIterator[Any]:
        return
        yield

    serving = OpenAIServingResponses(FailingChat())  # type: ignore[arg-type]
    run = ChatRun(request=None, request_id="chatcmpl-123", created=1, model="m", num_prompt_tokens=3,  # type: ignore[arg-type]
                  generator=nothing(), tool_choice="auto")
    request = ResponsesRequest(input="hi", stream=True)

    async def collect() -> list[str]:
        return [event async for event in serving._stream(request, run, "resp_123", [], None)]

    blocks = asyncio.run(collect())
    events = [json.loads(block.split("\ndata: ", 1)[1]) for block in blocks]
    for event in events:
        EVENT_TYPES[event["type"]].model_validate(event)  # the openai package's own types
    assert [event["type"] for event in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "error", "response.failed"]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert events[-2]["code"] == "engine_dead" and events[-2]["message"] == "the engine died"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "server_error", "message": "the engine died"}
    # Only the finished message: the call was cut off before its arguments were whole.
    assert [item["type"] for item in failed["output"]] == ["message"]
    assert failed["output"][0]["content"][0]["text"] == "Hello"

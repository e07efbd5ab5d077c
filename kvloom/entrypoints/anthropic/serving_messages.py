"""Anthropic's Messages API as a translation at the edge: a Messages request becomes a Chat Completions request
and runs through the chat serving's one seam (``OpenAIServingChat.start_chat``), and its message or stream
chunks are translated back.

Request, block by block:
- ``system`` (a string or text blocks) -> a first ``system`` message.
- ``text`` -> a text part; ``image`` (base64 or url source) -> an ``image_url`` part (a data URL for base64).
- an assistant's ``tool_use`` -> an entry of its ``tool_calls`` (``input`` as the JSON ``arguments``);
  ``thinking`` -> its ``reasoning_content`` (templates that replay reasoning read it).
- a user's ``tool_result`` -> a ``tool`` message answering ``tool_use_id`` (before the user's other content,
  as the API requires them to come first); ``is_error`` prefixes its text with ``Error:``; images in a result
  follow as a user message.
- ``tools`` -> function tools (``input_schema`` as ``parameters``); ``tool_choice`` ``auto`` / ``any`` /
  ``tool`` / ``none`` -> ``auto`` / ``required`` / the named function / ``none``, so the same grammars force
  them; ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``.
- ``stop_sequences`` -> ``stop``; ``thinking`` ``enabled`` / ``disabled`` -> the template's ``enable_thinking``;
  vLLM's extra sampling fields (``seed``, ``logit_bias``, ...: ``EXTRA_SAMPLING_FIELDS``) as they are.

Result: text, ``tool_use`` (id ``toolu_...``, ``input`` an object) and ``thinking`` blocks; ``stop_reason``
``end_turn``, ``max_tokens``, ``stop_sequence`` (with the matched ``stop_sequence``) or ``tool_use``.
Streaming: ``message_start``, ``ping``, per block ``content_block_start`` / ``content_block_delta``
(``text_delta``, ``input_json_delta``, ``thinking_delta``) / ``content_block_stop``, then ``message_delta``
(stop reason, output tokens) and ``message_stop``; an error after the stream began is an ``error`` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from kvloom.engine.engine_client import EngineDeadError
from kvloom.entrypoints.anthropic.protocol import (
    AnthropicCountTokensRequest,
    AnthropicCountTokensResponse,
    AnthropicImageBlock,
    AnthropicMessage,
    AnthropicMessagesRequest,
    AnthropicStopReason,
    AnthropicTextBlock,
    AnthropicTextContent,
    AnthropicThinkingContent,
    AnthropicToolResultBlock,
    AnthropicToolUseContent,
    AnthropicUsage,
    error_body,
)
from kvloom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    StreamOptions,
)
from kvloom.entrypoints.openai.request_body import describe_validation_error
from kvloom.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from kvloom.entrypoints.openai.serving_engine import (
    EXTRA_SAMPLING_FIELDS,
    APIError,
    chat_content,
    error_status,
    event_stream,
    run_until_disconnected,
)
from kvloom.entrypoints.openai.tool_calls import ToolError, check_tools


class AnthropicServingMessages:
    """``/v1/messages`` and ``/v1/messages/count_tokens`` over the chat serving."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    # ---- request -----------------------------------------------------------------------------
    def chat_request(self, request: AnthropicCountTokensRequest) -> ChatCompletionRequest:
        """The Chat Completions request a Messages (or count_tokens) request stands for."""
        messages: list[dict[str, Any]] = []
        if isinstance(request.system, str):
            messages.append({"role": "system", "content": request.system})
        elif request.system:
            messages.append({"role": "system", "content": [{"type": "text", "text": block.text}
                                                          for block in request.system]})
        for index, message in enumerate(request.messages):
            messages.extend(_chat_messages(message.role, message.content, index))
        if request.messages[-1].role != "user":
            raise APIError("the last message must have role 'user': kvloom does not continue a final "
                           "assistant message (prefill)", param="messages")
        fields: dict[str, Any] = {"model": request.model, "messages": messages}
        if request.tools:
            fields["tools"] = [{"type": "function", "function": {
                "name": tool.name, "parameters": tool.input_schema,
                **({"description": tool.description} if tool.description is not None else {})}}
                for tool in request.tools]
        choice = request.tool_choice
        if choice is not None:
            if choice.type == "tool":
                fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
            if getattr(choice, "disable_parallel_tool_use", False):
                fields["parallel_tool_calls"] = False
        template_kwargs = dict(request.chat_template_kwargs or {})
        thinking = (request.thinking or {}).get("type")
        if thinking in ("enabled", "disabled"):
            template_kwargs.setdefault("enable_thinking", thinking == "enabled")
        if template_kwargs:
            fields["chat_template_kwargs"] = template_kwargs
        if isinstance(request, AnthropicMessagesRequest):
            fields.update(max_tokens=request.max_tokens, stop=request.stop_sequences,
                          temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                          stream=request.stream)
            if request.stream:  # the output token count comes in the stream's last chunk
                fields["stream_options"] = StreamOptions(include_usage=True)
            fields.update({name: value for name, value in (request.model_extra or {}).items()
                           if name in EXTRA_SAMPLING_FIELDS})
        try:
            return ChatCompletionRequest(**fields)
        except ValidationError as e:
            raise APIError(*describe_validation_error(e.errors(include_url=False))) from None

    # ---- routes --------------------------------------------------------------------------------
    async def create_message(self, request: AnthropicMessagesRequest, raw_request: Request) -> Response:
        run = await self.chat.start_chat(self.chat_request(request))
        if request.stream:
            return event_stream(self._stream(run))

        async def collect() -> Response:
            return JSONResponse(self._message(run, await self.chat.chat_response(run)).model_dump())

        return await run_until_disconnected(collect(), raw_request)

    async def count_tokens(self, request: AnthropicCountTokensRequest) -> AnthropicCountTokensResponse:
        """The tokens of the prompt the request would run: the rendered system, tools and messages."""
        chat_request = self.chat_request(request)
        self.chat.check_model(chat_request.model)
        try:
            check_tools(chat_request.tools)
        except ToolError as e:
            raise APIError(str(e), param=e.param) from None
        prompt = await self.chat.chat_prompt(chat_request)
        return AnthropicCountTokensResponse(input_tokens=len(prompt.token_ids))

    # ---- result --------------------------------------------------------------------------------
    def _message(self, run: ChatRun, response: ChatCompletionResponse) -> AnthropicMessage:
        choice = response.choices[0]
        message = choice.message
        content: list[AnthropicTextContent | AnthropicThinkingContent | AnthropicToolUseContent] = []
        if message.reasoning_content:
            content.append(AnthropicThinkingContent(thinking=message.reasoning_content))
        if message.content:
            content.append(AnthropicTextContent(text=message.content))
        for call in message.tool_calls:
            content.append(AnthropicToolUseContent(id=_tool_use_id(call.id), name=call.function.name,
                                          input=_tool_input(call.function.name, call.function.arguments)))
        stop_reason, stop_sequence = _stop_reason(choice.finish_reason, choice.stop_reason)
        return AnthropicMessage(id=_message_id(run), model=run.model, content=content, stop_reason=stop_reason,
                       stop_sequence=stop_sequence,
                       usage=_usage(response.usage.prompt_tokens, response.usage.completion_tokens,
                                    run.num_cached_tokens))

    async def _stream(self, run: ChatRun) -> AsyncIterator[str]:
        blocks = _BlockStream()

        def message_start() -> list[str]:
            # Sent with the first engine output, as llama-server does, when the prefix cache's share is known.
            return [_event("message_start", {"type": "message_start", "message": AnthropicMessage(
                id=_message_id(run), model=run.model, content=[],
                usage=_usage(run.num_prompt_tokens, 0, run.num_cached_tokens)).model_dump()}),
                _event("ping", {"type": "ping"})]

        started = False
        finish_reason: str | None = None
        matched_stop: int | str | None = None
        output_tokens = 0
        try:
            async with aclosing(self.chat.chat_chunks(run)) as chunks:
                async for chunk in chunks:
                    if not started and run.num_cached_tokens is not None:
                        started = True
                        for event in message_start():
                            yield event
                    if chunk.usage is not None:
                        output_tokens = chunk.usage.completion_tokens
                    for event in blocks.feed(chunk):
                        yield event
                    for choice in chunk.choices:
                        if choice.finish_reason is not None:
                            finish_reason, matched_stop = choice.finish_reason, choice.stop_reason
        except (APIError, EngineDeadError, ValueError) as e:
            if not started:
                for event in message_start():
                    yield event
            yield _error_event(e)
            return
        if not started:
            for event in message_start():
                yield event
        for event in blocks.close():
            yield event
        stop_reason, stop_sequence = _stop_reason(finish_reason, matched_stop)
        yield _event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                       "usage": {"output_tokens": output_tokens}})
        yield _event("message_stop", {"type": "message_stop"})


def _usage(num_prompt_tokens: int, output_tokens: int, num_cached_tokens: int | None) -> AnthropicUsage:
    """Anthropic's usage: the prompt's computed tokens as input_tokens, the prefix cache's as cache_read_input_tokens
    (llama-server's split)."""
    cached = num_cached_tokens or 0
    return AnthropicUsage(input_tokens=num_prompt_tokens - cached, output_tokens=output_tokens,
                          cache_read_input_tokens=cached)


class _BlockStream:
    """Chat stream chunks -> content block events: a block opens when its kind of delta first comes (thinking,
    text, or a tool call's first delta) and closes when another begins or the message ends."""

    def __init__(self) -> None:
        self.index = -1  # the open block's index (-1: none yet)
        self.open_kind: str | None = None  # "thinking", "text", or "tool:<chat index>"

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.open_kind = kind
        events.append(_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                     "content_block": block}))
        return events

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def feed(self, chunk: ChatCompletionStreamResponse) -> list[str]:
        events: list[str] = []
        for choice in chunk.choices:
            delta = choice.delta
            if delta.reasoning_content:
                if self.open_kind != "thinking":
                    events += self._start("thinking", AnthropicThinkingContent(thinking="").model_dump())
                events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning_content}))
            if delta.content:
                if self.open_kind != "text":
                    events += self._start("text", AnthropicTextContent(text="").model_dump())
                events.append(self._delta({"type": "text_delta", "text": delta.content}))
            for call in delta.tool_calls or ():
                kind = f"tool:{call.index}"
                if self.open_kind != kind:
                    name = call.function.name if call.function is not None else None
                    if call.id is None or name is None:
                        raise ValueError(f"tool call {call.index}'s first delta carries no id and name")
                    events += self._start(kind, {"type": "tool_use", "id": _tool_use_id(call.id), "name": name,
                                                 "input": {}})
                if call.function is not None and call.function.arguments:
                    events.append(self._delta({"type": "input_json_delta", "partial_json": call.function.arguments}))
        return events

    def close(self) -> list[str]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]


# ---- helpers ----------------------------------------------------------------------------------


def _chat_messages(role: str, content: str | list[Any], index: int) -> list[dict[str, Any]]:
    """The chat messages of one Messages API message (a user's tool results become ``tool`` messages)."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    where = f"messages[{index}]"
    parts: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    tool_messages: list[dict[str, Any]] = []
    for block_index, block in enumerate(content):
        kind = block.type
        if kind in ("tool_use", "thinking", "redacted_thinking") and role != "assistant":
            raise APIError(f"{where}.content[{block_index}] is a {kind} block, which only an assistant message "
                           f"can hold", param="messages")
        if kind == "tool_result" and role != "user":
            raise APIError(f"{where}.content[{block_index}] is a tool_result block, which only a user message "
                           f"can hold", param="messages")
        if isinstance(block, AnthropicTextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, AnthropicImageBlock):
            parts.append(_image_part(block))
        elif kind == "tool_use":
            tool_calls.append({"id": block.id, "type": "function",
                               "function": {"name": block.name, "arguments": json.dumps(block.input,
                                                                                        ensure_ascii=False)}})
        elif kind == "thinking":
            reasoning.append(block.thinking)
        elif isinstance(block, AnthropicToolResultBlock):
            tool_messages.extend(_tool_result_messages(block))
        # redacted_thinking: opaque; accepted so a client can send a reply back whole, and left out.
    messages = tool_messages
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": chat_content(parts)}
        if tool_calls:
            message["tool_calls"] = tool_calls
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        messages.append(message)
    elif parts or not tool_messages:
        messages.append({"role": role, "content": chat_content(parts)})
    return messages


def _image_part(block: AnthropicImageBlock) -> dict[str, Any]:
    source = block.source
    url = source.url if source.type == "url" else f"data:{source.media_type};base64,{source.data}"
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result_messages(block: AnthropicToolResultBlock) -> list[dict[str, Any]]:
    """A tool message with the result's text, then a user message with its images, if any."""
    if isinstance(block.content, list):
        text = "\n".join(item.text for item in block.content if isinstance(item, AnthropicTextBlock))
        images = [_image_part(item) for item in block.content if isinstance(item, AnthropicImageBlock)]
    else:
        text, images = block.content or "", []
    if block.is_error:
        text = f"Error: {text}" if text else "Error"
    messages: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": block.tool_use_id, "content": text}]
    if images:
        messages.append({"role": "user", "content": images})
    return messages


def _stop_reason(finish_reason: str | None, matched_stop: int | str | None) -> tuple[AnthropicStopReason, str | None]:
    """The API's stop_reason and stop_sequence for a chat choice's finish_reason and stop_reason (the matched
    stop string; an int is a stop token id, which this API counts as the end of the turn)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(matched_stop, str):
        return "stop_sequence", matched_stop
    return "end_turn", None


def _tool_input(name: str, arguments: str) -> dict[str, Any]:
    """A tool call's arguments as the object the API's ``input`` is (a call cut by max_tokens never gets
    here: the chat serving returns only complete calls, and a forced call's grammar is the tool's object
    schema). A model that called a tool with something else is answered with a 500 that shows it."""
    value = json.loads(arguments)
    if not isinstance(value, dict):
        raise APIError(f"the model called the tool {name!r} with arguments that are not a JSON object: "
                       f"{arguments[:100]!r}", 500, type="server_error")
    return value


def _message_id(run: ChatRun) -> str:
    return "msg_" + run.request_id.rpartition("-")[2]


def _tool_use_id(call_id: str) -> str:
    """The chat serving's ``chatcmpl-tool-<hex>`` as the API's ``toolu_<hex>``."""
    return "toolu_" + call_id.rpartition("-")[2]


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _error_event(error: BaseException) -> str:
    return _event("error", error_body(*error_status(error)))

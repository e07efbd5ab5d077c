"""OpenAI's Responses API (``/v1/responses``) as a translation at the edge: a Responses request becomes a Chat
Completions request and runs through the chat serving's one seam (``OpenAIServingChat.start_chat``); its chat
message or stream chunks are translated back into a ``response`` object or the Responses stream events.

Request:
- ``instructions`` -> a first ``system`` message; ``input`` as a string -> one user message.
- ``message`` items (role user / assistant / system / developer; ``developer`` renders as ``system``), their
  ``input_text`` / ``output_text`` / ``refusal`` parts as text, ``input_image`` as an ``image_url`` part.
- ``function_call`` items -> ``tool_calls`` on the assistant message before them (or a new one);
  ``function_call_output`` -> a ``tool`` message answering ``call_id``; ``reasoning`` items -> the next
  assistant message's ``reasoning_content`` (templates that replay reasoning read it).
- ``tools`` (Responses' flat function tools) -> chat function tools; ``tool_choice`` ``auto`` / ``none`` /
  ``required`` / ``{"type": "function", "name"}`` as the chat ones, so the same grammars force them;
  ``text.format`` -> ``response_format`` (left out where ``tool_choice`` forces a call, whose output is the
  call); ``max_output_tokens`` -> ``max_completion_tokens``.
- ``previous_response_id`` -> that stored response's input and output items go first.
- vLLM's extra sampling fields (``seed``, ``logit_bias``, ...: ``EXTRA_SAMPLING_FIELDS``) and
  ``chat_template_kwargs`` as they are.

Result: a ``response`` with ``reasoning`` (from ``reasoning_content``), ``message`` (``output_text``) and
``function_call`` items, ``usage``, and ``status`` ``completed`` or ``incomplete`` (``max_output_tokens``).
Streaming: ``response.created``, ``response.in_progress``, per item ``response.output_item.added``, its
content part and text / reasoning / arguments deltas and their ``.done`` events, ``response.output_item.done``,
then ``response.completed`` (or ``response.incomplete``); a failure after the stream began is an ``error``
event followed by ``response.failed``. Every event carries a ``sequence_number``.

``store`` (default true): responses are kept in memory per API key (the ``Authorization: Bearer`` key, or
none) for ``GET`` / ``DELETE /v1/responses/{id}`` and ``previous_response_id``, at most
``RESPONSES_STORE_MAX_ENTRIES`` of them (least recently used go first) for ``RESPONSES_STORE_TTL_S`` seconds.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from kvloom.engine.engine_client import EngineDeadError
from kvloom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionStreamResponse,
    ChatMessage,
    StreamOptions,
)
from kvloom.entrypoints.openai.request_body import BODY_ERRORS, describe_validation_error, json_body, parse_body
from kvloom.entrypoints.openai.responses_protocol import (
    FunctionToolCall,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseDeleted,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from kvloom.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from kvloom.entrypoints.openai.serving_engine import (
    EXTRA_SAMPLING_FIELDS,
    APIError,
    chat_content,
    event_stream,
    run_until_disconnected,
)

# The store's bounds: memory grows with entries x conversation length, so both are capped.
RESPONSES_STORE_MAX_ENTRIES = 1024
RESPONSES_STORE_TTL_S = 3600.0

# Chat Completions' names in an error raised by the chat serving -> the Responses field they came from.
_PARAM_NAMES = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
                "messages": "input"}


@dataclass
class StoredResponse:
    response: ResponseObject
    items: list[dict[str, Any]]  # the conversation as input items: earlier input, this input, this output
    expires_at: float


class ResponseStore:
    """Stored responses by (API key, response id): an LRU of at most ``max_entries``, each kept ``ttl_s``."""

    def __init__(self, max_entries: int = RESPONSES_STORE_MAX_ENTRIES, ttl_s: float = RESPONSES_STORE_TTL_S,
                 clock: Any = time.monotonic) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()

    def put(self, api_key: str | None, response: ResponseObject, items: list[dict[str, Any]]) -> None:
        self._expire()
        key = (api_key, response.id)
        self._entries[key] = StoredResponse(response, items, self.clock() + self.ttl_s)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, api_key: str | None, response_id: str) -> StoredResponse | None:
        self._expire()
        entry = self._entries.get((api_key, response_id))
        if entry is not None:
            self._entries.move_to_end((api_key, response_id))
        return entry

    def delete(self, api_key: str | None, response_id: str) -> bool:
        self._expire()
        return self._entries.pop((api_key, response_id), None) is not None

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        now = self.clock()
        for key in [key for key, entry in self._entries.items() if entry.expires_at <= now]:
            del self._entries[key]


def api_key_of(raw_request: Request) -> str | None:
    """The Bearer key a request was sent with (the store's scope), or None."""
    scheme, _, token = raw_request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def not_found(response_id: str, param: str | None = None) -> APIError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    return APIError(f"{what} with id {response_id!r} not found.", 404, param=param,
                    code="previous_response_not_found" if param else "response_not_found")


class OpenAIServingResponses:
    """``/v1/responses`` and ``/v1/responses/{id}`` over the chat serving."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store if store is not None else ResponseStore()

    # ---- routes --------------------------------------------------------------------------------
    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        api_key = api_key_of(raw_request)
        items = input_items(request.input)
        if request.previous_response_id is not None:
            previous = self.store.get(api_key, request.previous_response_id)
            if previous is None:
                raise not_found(request.previous_response_id, "previous_response_id")
            items = previous.items + items
        chat_request = self.chat_request(request, items)
        try:
            run = await self.chat.start_chat(chat_request)
        except APIError as e:
            raise _renamed(e) from None
        response_id = "resp_" + run.request_id.rpartition("-")[2]
        if request.stream:
            return event_stream(self._stream(request, run, response_id, items, api_key))

        async def collect() -> Response:
            chat_response = await self.chat.chat_response(run)
            choice = chat_response.choices[0]
            response = self._response(request, run, response_id, output_items(choice.message),
                                      choice.finish_reason,
                                      self._usage(chat_response.usage.prompt_tokens,
                                                  chat_response.usage.completion_tokens,
                                                  choice.message.reasoning_content, run.num_cached_tokens))
            self._keep(request, api_key, response, items)
            return JSONResponse(response.model_dump())

        return await run_until_disconnected(collect(), raw_request)

    def retrieve(self, response_id: str, raw_request: Request) -> ResponseObject:
        entry = self.store.get(api_key_of(raw_request), response_id)
        if entry is None:
            raise not_found(response_id)
        return entry.response

    def delete(self, response_id: str, raw_request: Request) -> ResponseDeleted:
        if not self.store.delete(api_key_of(raw_request), response_id):
            raise not_found(response_id)
        return ResponseDeleted(id=response_id)

    # ---- request -------------------------------------------------------------------------------
    def chat_request(self, request: ResponsesRequest, items: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The Chat Completions request a Responses request over the conversation ``items`` stands for."""
        messages = chat_messages(items)
        if request.instructions:
            messages.insert(0, {"role": "system", "content": request.instructions})
        if not messages:
            raise APIError("input is empty: give a string or at least one item", param="input")
        fields: dict[str, Any] = {
            "model": request.model, "messages": messages, "max_completion_tokens": request.max_output_tokens,
            "temperature": request.temperature, "top_p": request.top_p, "user": request.user,
            "parallel_tool_calls": request.parallel_tool_calls, "stream": request.stream}
        if request.stream:  # the output token count comes in the stream's last chunk
            fields["stream_options"] = StreamOptions(include_usage=True)
        if request.tools:
            fields["tools"] = [chat_tool(tool, index) for index, tool in enumerate(request.tools)]
        if request.tool_choice is not None:
            fields["tool_choice"] = chat_tool_choice(request.tool_choice)
        extra = request.model_extra or {}
        fields.update({name: value for name, value in extra.items()
                       if name in EXTRA_SAMPLING_FIELDS or name == "chat_template_kwargs"})
        response_format = chat_response_format(request.text)
        # A forced call's output is the call (its grammar is the tool's), so text.format shapes only the text of a
        # turn that may answer; OpenAI takes both in one request, as agents with an output type send them.
        if response_format is not None and not _forces_call(request.tool_choice):
            fields["response_format"] = response_format
        try:
            return ChatCompletionRequest(**fields)
        except ValidationError as e:
            raise _renamed(APIError(*describe_validation_error(e.errors(include_url=False)))) from None

    # ---- result --------------------------------------------------------------------------------
    def _response(self, request: ResponsesRequest, run: ChatRun, response_id: str, output: list[OutputItem],
                  finish_reason: str | None, response_usage: ResponseUsage | None,
                  status: str | None = None, error: ResponseError | None = None) -> ResponseObject:
        incomplete = None
        if status is None:
            status = "completed"
            if finish_reason == "length":
                status, incomplete = "incomplete", IncompleteDetails(reason="max_output_tokens")
                for item in output:
                    if isinstance(item, OutputMessage):
                        item.status = "incomplete"
        return ResponseObject(
            id=response_id, created_at=run.created, status=status, error=error, incomplete_details=incomplete,
            instructions=request.instructions, max_output_tokens=request.max_output_tokens, model=run.model,
            output=output, parallel_tool_calls=request.parallel_tool_calls,
            previous_response_id=request.previous_response_id,
            reasoning={"effort": None, "summary": None, **(request.reasoning or {})}, store=request.store,
            temperature=request.temperature, text=request.text or {"format": {"type": "text"}},
            tool_choice=request.tool_choice if request.tool_choice is not None else "auto",
            tools=request.tools or [], top_p=request.top_p, usage=response_usage, user=request.user,
            metadata=request.metadata or {})

    def _usage(self, input_tokens: int, output_tokens: int, reasoning: str | None,
               cached_tokens: int | None) -> ResponseUsage:
        """Usage, the reasoning's tokens counted as the tokenizer encodes its text (the chat seam gives the text,
        not where its tokens end); ``cached_tokens``: the input tokens the prefix cache served."""
        reasoning_tokens = len(self.chat.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return ResponseUsage(input_tokens=input_tokens, output_tokens=output_tokens,
                             total_tokens=input_tokens + output_tokens,
                             input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens or 0),
                             output_tokens_details=OutputTokensDetails(
                                 reasoning_tokens=min(reasoning_tokens, output_tokens)))

    def _keep(self, request: ResponsesRequest, api_key: str | None, response: ResponseObject,
              items: list[dict[str, Any]]) -> None:
        if request.store:
            self.store.put(api_key, response, items + [item.model_dump() for item in response.output])

    async def _stream(self, request: ResponsesRequest, run: ChatRun, response_id: str,
                      items: list[dict[str, Any]], api_key: str | None) -> AsyncIterator[str]:
        events = _EventStream()
        snapshot = self._response(request, run, response_id, [], None, None, status="in_progress")
        yield events.event("response.created", response=snapshot.model_dump())
        yield events.event("response.in_progress", response=snapshot.model_dump())
        finish_reason: str | None = None
        response_usage: ResponseUsage | None = None
        try:
            async with aclosing(self.chat.chat_chunks(run)) as chunks:
                async for chunk in chunks:
                    if chunk.usage is not None:
                        response_usage = self._usage(chunk.usage.prompt_tokens, chunk.usage.completion_tokens,
                                                     events.reasoning_text(), run.num_cached_tokens)
                    for event in events.feed(chunk):
                        yield event
                    for choice in chunk.choices:
                        if choice.finish_reason is not None:
                            finish_reason = choice.finish_reason
            for event in events.close():
                yield event
        except (APIError, EngineDeadError, ValueError) as e:
            code = (e.code or e.type) if isinstance(e, APIError) else (
                "engine_dead" if isinstance(e, EngineDeadError) else "invalid_request_error")
            message = e.message if isinstance(e, APIError) else str(e)
            yield events.event("error", code=code, message=message,
                               param=e.param if isinstance(e, APIError) else None)
            # A response's error code is one of OpenAI's few: a refused request's, or the server's.
            client_error = isinstance(e, ValueError) or (isinstance(e, APIError) and e.status_code < 500)
            failed = self._response(request, run, response_id, events.done_items(), None, response_usage,
                                    status="failed", error=ResponseError(
                                        code="invalid_prompt" if client_error else "server_error", message=message))
            yield events.event("response.failed", response=failed.model_dump())
            return
        response = self._response(request, run, response_id, events.done_items(), finish_reason, response_usage)
        self._keep(request, api_key, response, items)
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        yield events.event(kind, response=response.model_dump())


class _EventStream:
    """Chat stream chunks -> Responses output item events: an item opens when its kind of delta first comes
    (reasoning, text, or a tool call's first delta) and is done when another begins or the reply ends."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.items: list[OutputItem] = []  # every item opened, in output order
        self.open: OutputItem | None = None
        self.open_kind: str | None = None  # "reasoning", "text", or "tool:<chat index>"

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def reasoning_text(self) -> str:
        return "".join(item.content[0].text for item in self.items if isinstance(item, ReasoningItem))

    def done_items(self) -> list[OutputItem]:
        return [item for item in self.items if item.status == "completed"]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open.id, "output_index": len(self.items) - 1}

    def _start(self, kind: str, item: OutputItem) -> list[str]:
        events = self.close()
        self.items.append(item)
        self.open, self.open_kind = item, kind
        added = item.model_copy(update={"status": "in_progress"}).model_dump()
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=added))
        if isinstance(item, OutputMessage):
            events.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                     part=OutputText(text="").model_dump()))
        elif isinstance(item, ReasoningItem):
            events.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                     part=ReasoningText(text="").model_dump()))
        return events

    def feed(self, chunk: ChatCompletionStreamResponse) -> list[str]:
        events: list[str] = []
        for choice in chunk.choices:
            delta = choice.delta
            if delta.reasoning_content:
                if self.open_kind != "reasoning":
                    events += self._start("reasoning", ReasoningItem(id=_item_id("rs"), content=[ReasoningText(
                        text="")], status="in_progress"))
                self.open.content[0].text += delta.reasoning_content
                events.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0,
                                         delta=delta.reasoning_content))
            if delta.content:
                if self.open_kind != "text":
                    events += self._start("text", OutputMessage(id=_item_id("msg"), content=[OutputText(text="")],
                                                                status="in_progress"))
                self.open.content[0].text += delta.content
                events.append(self.event("response.output_text.delta", **self._where(), content_index=0,
                                         delta=delta.content, logprobs=[]))
            for call in delta.tool_calls or ():
                kind = f"tool:{call.index}"
                if self.open_kind != kind:
                    name = call.function.name if call.function is not None else None
                    if call.id is None or name is None:
                        raise ValueError(f"tool call {call.index}'s first delta carries no id and name")
                    events += self._start(kind, FunctionToolCall(id=_item_id("fc"), call_id=_call_id(call.id),
                                                                 name=name, arguments="", status="in_progress"))
                if call.function is not None and call.function.arguments:
                    self.open.arguments += call.function.arguments
                    events.append(self.event("response.function_call_arguments.delta", **self._where(),
                                             delta=call.function.arguments))
        return events

    def close(self) -> list[str]:
        item = self.open
        if item is None:
            return []
        where = self._where()
        events = []
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events.append(self.event("response.output_text.done", **where, content_index=0, text=part.text,
                                     logprobs=[]))
            events.append(self.event("response.content_part.done", **where, content_index=0,
                                     part=part.model_dump()))
        elif isinstance(item, ReasoningItem):
            part = item.content[0]
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=part.text))
            events.append(self.event("response.content_part.done", **where, content_index=0,
                                     part=part.model_dump()))
        else:
            events.append(self.event("response.function_call_arguments.done", **where, name=item.name,
                                     arguments=item.arguments))
        item.status = "completed"
        events.append(self.event("response.output_item.done", output_index=where["output_index"],
                                 item=item.model_dump()))
        self.open = self.open_kind = None
        return events


# ---- translation ----------------------------------------------------------------------------------


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return value


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a conversation's input items."""
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []  # reasoning items waiting for the assistant message they precede

    def assistant() -> dict[str, Any]:
        if messages and messages[-1]["role"] == "assistant":
            return messages[-1]
        message: dict[str, Any] = {"role": "assistant", "content": None}
        messages.append(message)
        return message

    def take_reasoning(message: dict[str, Any]) -> None:
        if reasoning:
            message["reasoning_content"] = message.get("reasoning_content", "") + "".join(reasoning)
            reasoning.clear()

    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise APIError(f"{where} must be an object, got {type(item).__name__}", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(f"{where}.role must be 'user', 'assistant', 'system' or 'developer', got {role!r}",
                               param=f"{where}.role")
            parts = _message_parts(item.get("content"), role, where)
            if role == "assistant":
                message = {"role": "assistant", "content": chat_content(parts)}
                messages.append(message)
                take_reasoning(message)
            else:
                messages.append({"role": "system" if role == "developer" else role, "content": chat_content(parts)})
        elif kind == "function_call":
            call_id, name, arguments = (_string(item, field, where) for field in ("call_id", "name", "arguments"))
            message = assistant()
            take_reasoning(message)
            message.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            text, images = _output_parts(item.get("output"), where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
            if images:
                messages.append({"role": "user", "content": images})
        elif kind == "reasoning":
            texts = [part.get("text", "") for part in item.get("content") or item.get("summary") or []
                     if isinstance(part, dict)]
            reasoning.append("".join(texts))
        else:
            raise APIError(f"{where}.type {kind!r} is not supported: kvloom takes 'message', 'function_call', "
                           f"'function_call_output' and 'reasoning' items", param=f"{where}.type")
    return messages


def _string(item: dict[str, Any], field: str, where: str) -> str:
    value = item.get(field)
    if not isinstance(value, str):
        raise APIError(f"{where}.{field} must be a string, got {type(value).__name__}", param=f"{where}.{field}")
    return value


def _message_parts(content: Any, role: str, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise APIError(f"{where}.content must be a string or a list of content parts", param=f"{where}.content")
    parts = []
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            parts.append({"type": "text", "text": _string(part, "text", at)})
        elif kind == "refusal" and role == "assistant":
            parts.append({"type": "text", "text": _string(part, "refusal", at)})
        elif kind == "input_image" and role != "assistant":
            parts.append(_image_part(part, at))
        else:
            allowed = "output_text, refusal" if role == "assistant" else "input_text, input_image"
            raise APIError(f"{at}.type {kind!r} is not supported in a {role} message (allowed: {allowed})",
                           param=f"{at}.type")
    return parts


def _image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    url = part.get("image_url")
    if not isinstance(url, str):
        raise APIError(f"{where}.image_url must be a URL or data URL string (file_id is not supported)",
                       param=f"{where}.image_url")
    return {"type": "image_url", "image_url": {"url": url}}


def _output_parts(output: Any, where: str) -> tuple[str, list[dict[str, Any]]]:
    """A function_call_output's text, and its images (sent after it as a user message)."""
    if isinstance(output, str):
        return output, []
    if not isinstance(output, list):
        raise APIError(f"{where}.output must be a string or a list of content parts", param=f"{where}.output")
    texts, images = [], []
    for index, part in enumerate(output):
        at = f"{where}.output[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            texts.append(_string(part, "text", at))
        elif kind == "input_image":
            images.append(_image_part(part, at))
        else:
            raise APIError(f"{at}.type {kind!r} is not supported (allowed: input_text, input_image)",
                           param=f"{at}.type")
    return "\n".join(texts), images


def chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    """A Responses function tool (flat: name, description, parameters, strict) as a chat tool."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise APIError(f"tools[{index}].type {kind!r} is not supported: kvloom runs 'function' tools",
                       param=f"tools[{index}].type")
    function = {field: tool[field] for field in ("name", "description", "parameters", "strict")
                if tool.get(field) is not None}
    return {"type": "function", "function": function}


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # "none", "auto", "required": checked by the chat serving
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'name': ...}}, "
                   f"got {choice!r:.120}", param="tool_choice")


def _forces_call(choice: str | dict[str, Any] | None) -> bool:
    return choice == "required" or isinstance(choice, dict)


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as a chat ``response_format`` (None for plain text)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError("text.format.schema must be a JSON schema object", param="text.format.schema")
        schema = {field: fmt[field] for field in ("name", "schema", "strict", "description")
                  if fmt.get(field) is not None}
        schema.setdefault("name", "response")
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   param="text.format.type")


def output_items(message: ChatMessage) -> list[OutputItem]:
    """A whole chat message's output items: its reasoning, its text, its tool calls."""
    items: list[OutputItem] = []
    if message.reasoning_content:
        items.append(ReasoningItem(id=_item_id("rs"), content=[ReasoningText(text=message.reasoning_content)]))
    if message.content:
        items.append(OutputMessage(id=_item_id("msg"), content=[OutputText(text=message.content)]))
    for call in message.tool_calls:
        items.append(FunctionToolCall(id=_item_id("fc"), call_id=_call_id(call.id), name=call.function.name,
                                      arguments=call.function.arguments))
    return items


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _call_id(chat_call_id: str) -> str:
    """The chat serving's ``chatcmpl-tool-<hex>`` as OpenAI's ``call_<hex>``."""
    return "call_" + chat_call_id.rpartition("-")[2]


def _renamed(error: APIError) -> APIError:
    """A chat serving error with its field named as the Responses request names it."""
    param = _PARAM_NAMES.get(error.param or "", error.param)
    message = error.message
    if error.param in _PARAM_NAMES:
        message = message.replace(error.param, param)
    return APIError(message, error.status_code, param=param, type=error.type, code=error.code)


def responses_routes(chat: OpenAIServingChat, store: ResponseStore | None = None) -> APIRouter:
    """``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{response_id}`` over the chat serving."""
    serving = OpenAIServingResponses(chat, store)
    router = APIRouter(prefix="/v1/responses")

    @router.post("", openapi_extra=json_body(ResponsesRequest),
                 responses={200: {"model": ResponseObject, "description": "The response, or with stream: true its "
                                  "server-sent events"}, **BODY_ERRORS})
    async def create_response(raw_request: Request) -> Response:
        request = await parse_body(raw_request, ResponsesRequest)
        return await serving.create_response(request, raw_request)

    @router.get("/{response_id}")
    async def retrieve_response(response_id: str, raw_request: Request) -> ResponseObject:
        return serving.retrieve(response_id, raw_request)

    @router.delete("/{response_id}")
    async def delete_response(response_id: str, raw_request: Request) -> ResponseDeleted:
        return serving.delete(response_id, raw_request)

    return router

"""Ollama's ``/api/chat`` and ``/api/generate`` as a translation at the edge: a chat request, and a templated
generate request, become a Chat Completions request run by the chat serving's one seam
(``OpenAIServingChat.start_chat``); a ``raw`` generate request (and a ``suffix``'s fill-in-the-middle prompt) is a
plain prompt run by the same serving's prompt, sampling and engine-request steps. Their deltas come back as
Ollama's NDJSON objects, or, with ``stream: false``, as one object.

Request:
- ``messages``: ``system`` / ``user`` / ``assistant`` / ``tool`` (any case); a user's ``images`` (base64) ->
  ``image_url`` parts (data URLs) before its text, so a vision model sees them and a text model answers 400;
  an assistant's ``tool_calls`` (``arguments`` an object) -> ``tool_calls`` with JSON ``arguments`` and
  ``thinking`` -> ``reasoning_content``; a ``tool`` message answers ``tool_call_id``, or else the oldest
  unanswered call named ``tool_name``.
- ``tools`` -> the same function tools, run as ``tool_choice: auto`` (the server needs
  ``--enable-auto-tool-choice --tool-call-parser``; without them a request with tools is a 400).
- ``format``: ``"json"`` -> a JSON object; a schema -> that schema (structured outputs).
- ``options`` (``OPTIONS_TO_FIELDS``): Ollama's defaults where the request leaves them out (temperature 0.8,
  top_k 40, top_p 0.9); ``num_predict`` -1 / -2 -> the rest of the context; a negative ``seed`` -> unseeded;
  ``num_ctx``: kvloom's context is fixed when the server starts (``--max-model-len``), so a request always has
  all of it: a larger ``num_ctx`` is clamped to it (as Ollama clamps to the model's), a smaller one changes
  nothing; ``REFUSED_OPTIONS`` (typical_p, tfs_z, mirostat, repeat_last_n with a repeat_penalty) are a 400
  unless neutral; the runner's settings (num_gpu, num_thread, ...) are accepted and unused; vLLM's extra sampling
  fields and ``structured_outputs`` are honoured there (kvloom's extension).
- ``think``: true / a level -> the template's ``enable_thinking`` (and ``reasoning_effort``), the reply's
  reasoning split into ``thinking`` by ``--reasoning-parser`` (without one, a 400 as Ollama's for a model that
  does not think); false -> ``enable_thinking: false``.
- ``keep_alive`` (``parse_keep_alive``): validated, and left in seconds on ``raw_request.state.keep_alive`` for
  the server; one model stays loaded for the server's life, so an empty request with ``keep_alive: 0`` (Ollama's
  unload) is a 400.
- generate: ``system`` and ``prompt`` (with ``images``) as a system and a user message; ``raw``: the prompt as it
  is; ``suffix``: a fill-in-the-middle prompt (built as llama-server builds ``/infill``'s: openai/fim.py; 400 for a
  model without FIM tokens); ``template`` (a Go template) and ``context`` (deprecated by Ollama) are a 400.

Answer: per delta ``{"model", "created_at", "message": {"role", "content", "thinking"?, "tool_calls"?}, "done":
false}`` (generate: ``"response"`` and ``"thinking"``), each tool call whole once its arguments are complete
(``{"id", "function": {"index", "name", "arguments": {...}}}``); the last object has ``done: true``,
``done_reason`` (``stop`` or ``length``) and ``Timing``'s counts and durations (nanoseconds). An error after the
stream began is an ``{"error": ...}`` line.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from kvloom.engine.engine_client import EngineDeadError
from kvloom.entrypoints.ollama.protocol import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaGenerationFields,
    OllamaMessage,
    OllamaOptions,
    nanoseconds,
    parse_keep_alive,
    rfc3339,
)
from kvloom.entrypoints.openai.fim import FimTokens
from kvloom.entrypoints.openai.protocol import ChatCompletionLogProbs, ChatCompletionRequest, CompletionRequest
from kvloom.entrypoints.openai.request_body import describe_validation_error
from kvloom.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from kvloom.entrypoints.openai.serving_engine import (
    EXTRA_SAMPLING_FIELDS,
    APIError,
    OpenAIServing,
    chat_content,
    error_status,
    run_until_disconnected,
)
from kvloom.outputs import RequestMetrics, RequestOutput

logger = logging.getLogger("kvloom")

# Ollama's defaults (api/types.go DefaultOptions) for what a request leaves out.
DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P = 0.8, 40, 0.9
# Ollama's options -> the chat request's fields (the rest: num_predict, num_ctx, seed, stop, by hand).
OPTIONS_TO_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                     "frequency_penalty": "frequency_penalty"}
# Sampling kvloom does not implement, and the values that ask for nothing (Ollama's defaults, or off).
REFUSED_OPTIONS: dict[str, tuple[Any, ...]] = {"typical_p": (1.0,), "tfs_z": (1.0,), "mirostat": (0,)}
# kvloom's extension: vLLM's extra sampling fields and structured outputs given in ``options``.
OPTION_EXTRAS = (*EXTRA_SAMPLING_FIELDS, "structured_outputs")
THINK_LEVELS = ("low", "medium", "high", "max")
ROLES = ("system", "user", "assistant", "tool")
# Fill-in-the-middle tokens (prefix, suffix, middle) of the code model families, laid out prefix-suffix-middle.
# The first bytes of the image formats a client sends, for the data URL's media type.
IMAGE_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"),
                    (b"BM", "image/bmp"))


# ---- model names ------------------------------------------------------------------------------


def listed_name(name: str) -> str:
    """A served name as Ollama lists a model: ``name:tag``, the tag ``latest`` when it has none."""
    return name if ":" in name else name + ":latest"


def model_names(serving: OpenAIServing) -> list[str]:
    """The names this server answers to: its served names, then its LoRA adapters'."""
    names = list(serving.served_model_names)
    if serving.lora_modules is not None:
        names += [card.id for card in serving.lora_modules.model_cards(serving.max_model_len)]
    return names


def served_name(serving: OpenAIServing, model: str) -> str:
    """The served name (or LoRA adapter) ``model`` names, with or without Ollama's ``:latest``; a 404 in Ollama's
    words that names the models there are."""
    candidates = [model, model.removesuffix(":latest")] if model.endswith(":latest") else [model]
    for candidate in candidates:
        if candidate in serving.served_model_names or (serving.lora_modules is not None
                                                       and candidate in serving.lora_modules):
            return candidate
    if not model:
        raise APIError("model is required")
    available = ", ".join(listed_name(name) for name in model_names(serving))
    raise APIError(f"model '{model}' not found; this server serves {available}", 404)


# ---- timing -----------------------------------------------------------------------------------


@dataclass
class Timing:
    """A request's durations as Ollama reports them, from the engine's ``RequestMetrics``: ``load_duration`` the
    time before the engine had the request (template, tokenizing, grammar, images: kvloom loads its model when it
    starts, so no request waits for a load), ``prompt_eval_duration`` from then to the first token (queue and
    prefill), ``eval_duration`` from the first token to the last, ``total_duration`` all of it."""

    received: float = field(default_factory=time.time)
    metrics: RequestMetrics | None = None

    async def watch(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """``outputs`` as they are, their latest metrics kept."""
        async with aclosing(outputs) as items:
            async for output in items:
                if output.metrics is not None:
                    self.metrics = output.metrics
                yield output

    def fields(self, prompt_eval_count: int, eval_count: int) -> dict[str, int]:
        now = time.time()
        arrival = self.metrics.arrival_time if self.metrics is not None else now
        first = self.metrics.first_token_time if self.metrics is not None else None
        first = now if first is None else first
        last = self.metrics.last_token_time if self.metrics is not None else None
        last = first if last is None else last
        return {"total_duration": nanoseconds(now - self.received),
                "load_duration": nanoseconds(arrival - self.received),
                "prompt_eval_count": prompt_eval_count, "prompt_eval_duration": nanoseconds(first - arrival),
                "eval_count": eval_count, "eval_duration": nanoseconds(last - first)}


# ---- what a reply is made of ---------------------------------------------------------------------


@dataclass
class Piece:
    """What one delta adds to the reply."""

    content: str = ""
    thinking: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.thinking or self.tool_calls or self.logprobs)

    def extend(self, other: Piece) -> None:
        self.content += other.content
        self.thinking += other.thinking
        self.tool_calls += other.tool_calls
        self.logprobs += other.logprobs


@dataclass
class Finish:
    done_reason: str
    prompt_eval_count: int
    eval_count: int


def done_reason(finish_reason: str | None) -> str:
    """Ollama's done_reason: ``length`` where the output limit (or the context) ended it, else ``stop``."""
    return "length" if finish_reason == "length" else "stop"


class _ToolCalls:
    """Tool-call deltas -> whole calls in Ollama's shape, each given once its arguments are complete (when the
    next call begins, or the reply ends)."""

    def __init__(self) -> None:
        self.open: dict[str, Any] | None = None

    def feed(self, deltas: list[Any]) -> list[dict[str, Any]]:
        done: list[dict[str, Any]] = []
        for delta in deltas:
            if self.open is None or delta.index != self.open["index"]:
                done += self.close()
                name = delta.function.name if delta.function is not None else None
                if delta.id is None or name is None:
                    raise ValueError(f"tool call {delta.index}'s first delta carries no id and name")
                self.open = {"index": delta.index, "id": delta.id, "name": name, "arguments": ""}
            if delta.function is not None and delta.function.arguments:
                self.open["arguments"] += delta.function.arguments
        return done

    def close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        call, self.open = self.open, None
        return [{"id": "call_" + call["id"].rpartition("-")[2],
                 "function": {"index": call["index"], "name": call["name"],
                              "arguments": _arguments_object(call["name"], call["arguments"] or "{}")}}]


def _arguments_object(name: str, arguments: str) -> dict[str, Any]:
    """A call's JSON arguments as the object Ollama's ``arguments`` is; a model that called a tool with anything
    else is a 500 that shows it (a forced or parsed call is always an object)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise APIError(f"the model called the tool {name!r} with arguments that are not a JSON object: "
                       f"{arguments[:100]!r}", 500)
    return value


def _logprobs(logprobs: ChatCompletionLogProbs | None) -> list[dict[str, Any]]:
    """Chat logprobs as Ollama's: ``[{"token", "logprob", "bytes", "top_logprobs": [...]}]``."""
    if logprobs is None or not logprobs.content:
        return []
    return [entry.model_dump(exclude_none=True) for entry in logprobs.content]


# ---- the serving ------------------------------------------------------------------------------


class OllamaServingChat:
    """``/api/chat`` and ``/api/generate`` over the chat serving ``chat``."""

    def __init__(self, chat: OpenAIServingChat, can_unload: bool = False) -> None:
        """``can_unload``: whether the server can unload this model and load it again (several models behind one
        server), so that ``keep_alive: 0`` with nothing to generate unloads it once idle."""
        self.chat = chat
        self.can_unload = can_unload

    # ---- request -------------------------------------------------------------------------------
    def sampling_fields(self, request: OllamaGenerationFields) -> dict[str, Any]:
        """The sampling fields of a chat or completion request from ``options`` and ``format``; always a stream of
        deltas with usage (``stream: false`` gathers it)."""
        options = request.options or OllamaOptions()
        for name, neutral in REFUSED_OPTIONS.items():
            value = getattr(options, name)
            if value is not None and value not in neutral:
                raise APIError(f"options.{name} is not supported by kvloom; leave it out or set it to {neutral[0]}")
        if (options.repeat_last_n not in (None, -1) and options.repeat_penalty not in (None, 1.0)):
            raise APIError("options.repeat_last_n is not supported by kvloom: repeat_penalty applies over the whole "
                           "context (as repeat_last_n -1); leave it out or set it to -1")
        fields: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True},
                                  "temperature": DEFAULT_TEMPERATURE, "top_k": DEFAULT_TOP_K, "top_p": DEFAULT_TOP_P}
        for option, name in OPTIONS_TO_FIELDS.items():
            value = getattr(options, option)
            if value is not None:
                fields[name] = value
        if options.seed is not None and options.seed >= 0:
            fields["seed"] = options.seed
        if options.stop:
            fields["stop"] = options.stop
        num_predict = options.num_predict
        if num_predict is not None and (num_predict == 0 or num_predict < -2):
            raise APIError(f"options.num_predict must be a number of tokens (at least 1), or -1 (until the context "
                           f"ends), got {num_predict}")
        fields["max_tokens"] = num_predict if num_predict is not None and num_predict > 0 else None
        if options.num_ctx is not None and options.num_ctx > self.chat.max_model_len:
            logger.warning("options.num_ctx %d is over the server's context (--max-model-len %d): using %d",
                           options.num_ctx, self.chat.max_model_len, self.chat.max_model_len)
        for name, value in (options.model_extra or {}).items():
            if name in OPTION_EXTRAS:
                fields[name] = value
            else:
                logger.warning("Ignoring the unknown option %r", name)
        fields.update(_response_format(request.format))
        return fields

    def template_kwargs(self, request: OllamaGenerationFields, model: str) -> dict[str, Any]:
        """``think`` as the chat template's variables (a 400 for a bad value, or where no parser splits it)."""
        think = request.think
        if think is None:
            return {}
        if isinstance(think, str) and think not in THINK_LEVELS:
            raise APIError(f"invalid think value: {think!r} (must be \"high\", \"medium\", \"low\", \"max\", true, "
                           f"or false)")
        wants = think is not False
        if wants and self.chat.reasoning_parser is None:
            raise APIError(f"\"{model}\" does not support thinking: kvloom splits a reply's reasoning with "
                           f"--reasoning-parser, and this server runs without one")
        kwargs: dict[str, Any] = {"enable_thinking": wants}
        if isinstance(think, str):
            kwargs["reasoning_effort"] = think
        return kwargs

    def chat_request(self, request: OllamaChatRequest | OllamaGenerateRequest, model: str,
                     messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The Chat Completions request of ``messages`` (already translated) and the request's other fields."""
        fields: dict[str, Any] = {"model": model, "messages": messages, **self.sampling_fields(request)}
        tools = getattr(request, "tools", None)
        if tools:
            if not (self.chat.enable_auto_tools and self.chat.tool_parser is not None):
                raise APIError(f"\"{request.model}\" does not support tools: kvloom reads tool calls with "
                               f"--enable-auto-tool-choice --tool-call-parser, and this server runs without them")
            fields["tools"] = tools
        template_kwargs = self.template_kwargs(request, request.model)
        if template_kwargs:
            fields["chat_template_kwargs"] = template_kwargs
        if request.logprobs:
            fields["logprobs"] = True
            fields["top_logprobs"] = request.top_logprobs or 0
        try:
            return ChatCompletionRequest(**fields)
        except ValidationError as e:
            raise APIError(describe_validation_error(e.errors(include_url=False))[0]) from None

    # ---- routes --------------------------------------------------------------------------------
    async def create_chat(self, request: OllamaChatRequest, raw_request: Request) -> Response:
        timing = Timing()
        model = served_name(self.chat, request.model)
        raw_request.state.keep_alive = keep_alive = keep_alive_seconds(request.keep_alive)
        if not request.messages:
            return _load_response(request.model, keep_alive, "chat", self.can_unload)
        run = await self.chat.start_chat(self.chat_request(request, model, _chat_messages(request.messages)))
        run.generator = timing.watch(run.generator)
        return await self._answer(self._chat_pieces(run), "chat", request, timing, raw_request)

    async def create_generate(self, request: OllamaGenerateRequest, raw_request: Request) -> Response:
        timing = Timing()
        model = served_name(self.chat, request.model)
        raw_request.state.keep_alive = keep_alive = keep_alive_seconds(request.keep_alive)
        if request.template:
            raise APIError("template is not supported: kvloom renders prompts with the model's chat template "
                           "(--chat-template); send raw: true with a prompt you have rendered")
        if request.context is not None:
            raise APIError("context is not supported (Ollama deprecated it): send the conversation to /api/chat")
        if request.raw and request.system:
            raise APIError("raw mode does not support template, system, or context")
        if request.suffix and request.system:
            raise APIError("suffix makes a fill-in-the-middle prompt, which has no system message: leave system out")
        if not request.prompt:
            return _load_response(request.model, keep_alive, "generate", self.can_unload)
        if request.raw or request.suffix:
            if request.images:
                raise APIError("images need the chat template: send them without raw and suffix")
            if request.think is not None and request.think is not False:
                raise APIError("think needs the chat template (its reasoning is split from the templated reply): "
                               "send it without raw and suffix")
            if request.logprobs:
                raise APIError("logprobs are given for templated prompts: send them without raw and suffix")
            prompt: str | list[int] = request.prompt
            stop_token_ids: list[int] = []
            if request.suffix:
                fim = fim_tokens(self.chat, request.model)
                prompt = list((await self.chat.infill_prompt(fim, request.prompt, request.suffix, [], [])).token_ids)
                stop_token_ids = fim.end_of_generation_ids
            pieces = await self._start_plain(request, model, prompt, timing, stop_token_ids)
            return await self._answer(pieces, "generate", request, timing, raw_request)
        messages: list[dict[str, Any]] = [{"role": "system", "content": request.system}] if request.system else []
        messages.append({"role": "user", "content": chat_content(
            [*_image_parts(request.images or [], "images"), {"type": "text", "text": request.prompt}])})
        run = await self.chat.start_chat(self.chat_request(request, model, messages))
        run.generator = timing.watch(run.generator)
        return await self._answer(self._chat_pieces(run), "generate", request, timing, raw_request)

    # ---- running -------------------------------------------------------------------------------
    async def _start_plain(self, request: OllamaGenerateRequest, model: str, prompt: str | list[int],
                           timing: Timing, stop_token_ids: list[int]) -> AsyncIterator[Piece | Finish]:
        """A raw or fill-in-the-middle prompt started on the engine, as the completion serving starts one
        (``stop_token_ids``: a FIM prompt's end-of-generation tokens, beside the request's own)."""
        chat = self.chat
        chat.check_engine()
        try:
            fields = CompletionRequest(model=model, prompt=prompt, **self.sampling_fields(request))
            if stop_token_ids:
                fields.stop_token_ids = [*(fields.stop_token_ids or []), *stop_token_ids]
        except ValidationError as e:
            raise APIError(describe_validation_error(e.errors(include_url=False))[0]) from None
        constraint, constraint_param = chat.structured_outputs_of(fields)
        if constraint is not None:
            await chat.check_structured_outputs(constraint, constraint_param)
        tokenized = await chat.tokenize_prompt(prompt, True, "prompt")
        params = chat.sampling_params(fields, chat.max_tokens(len(tokenized.token_ids), fields.max_tokens), None,
                                      names={"max_tokens": "num_predict"}, structured_outputs=constraint)
        engine_request = chat.engine_request(f"cmpl-{uuid.uuid4().hex}", tokenized, params, "prompt",
                                             "num_predict" if fields.max_tokens is not None else None, model=model)
        outputs = timing.watch(chat.engine.generate(engine_request))
        return _plain_pieces(outputs, len(tokenized.token_ids))

    async def _chat_pieces(self, run: ChatRun) -> AsyncIterator[Piece | Finish]:
        calls = _ToolCalls()
        finish_reason = None
        prompt_tokens, eval_count = run.num_prompt_tokens, 0
        async with aclosing(self.chat.chat_chunks(run)) as chunks:
            async for chunk in chunks:
                if chunk.usage is not None:
                    prompt_tokens, eval_count = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
                for choice in chunk.choices:
                    delta = choice.delta
                    piece = Piece(content=delta.content or "", thinking=delta.reasoning_content or "",
                                  tool_calls=calls.feed(delta.tool_calls or []), logprobs=_logprobs(choice.logprobs))
                    if choice.finish_reason is not None:
                        finish_reason = choice.finish_reason
                        piece.tool_calls += calls.close()
                    if piece:
                        yield piece
        yield Finish(done_reason(finish_reason), prompt_tokens, eval_count)

    async def _answer(self, pieces: AsyncIterator[Piece | Finish], kind: str, request: OllamaGenerationFields,
                      timing: Timing, raw_request: Request) -> Response:
        """The reply as an NDJSON stream, or (``stream: false``) gathered into one object."""
        if request.stream:
            return StreamingResponse(_ndjson(pieces, kind, request.model, timing), media_type="application/x-ndjson")

        async def collect() -> Response:
            whole = Piece()
            async with aclosing(pieces) as items:
                async for item in items:
                    if isinstance(item, Piece):
                        whole.extend(item)
                    else:
                        return JSONResponse(_final_object(kind, request.model, whole, item, timing))
            raise EngineDeadError("the engine returned no output")

        return await run_until_disconnected(collect(), raw_request)


async def _plain_pieces(outputs: AsyncIterator[RequestOutput], num_prompt_tokens: int) -> AsyncIterator[Piece | Finish]:
    finish_reason = None
    eval_count = 0
    async with aclosing(outputs) as items:
        async for output in items:
            for completion in output.outputs:
                eval_count += len(completion.token_ids)
                if completion.finish_reason is not None:
                    finish_reason = completion.finish_reason
                if completion.text:
                    yield Piece(content=completion.text)
    yield Finish(done_reason(finish_reason), num_prompt_tokens, eval_count)


# ---- answers ----------------------------------------------------------------------------------


def _object(kind: str, model: str, piece: Piece, done: bool) -> dict[str, Any]:
    """A chat or generate object: ``message`` (chat) or ``response`` / ``thinking`` (generate)."""
    body: dict[str, Any] = {"model": model, "created_at": rfc3339(time.time())}
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": piece.content}
        if piece.thinking:
            message["thinking"] = piece.thinking
        if piece.tool_calls:
            message["tool_calls"] = piece.tool_calls
        body["message"] = message
    else:
        body["response"] = piece.content
        if piece.thinking:
            body["thinking"] = piece.thinking
    body["done"] = done
    if piece.logprobs:
        body["logprobs"] = piece.logprobs
    return body


def _final_object(kind: str, model: str, piece: Piece, finish: Finish, timing: Timing) -> dict[str, Any]:
    body = _object(kind, model, piece, True)
    body["done_reason"] = finish.done_reason
    body.update(timing.fields(finish.prompt_eval_count, finish.eval_count))
    return body


async def _ndjson(pieces: AsyncIterator[Piece | Finish], kind: str, model: str, timing: Timing) -> AsyncIterator[str]:
    try:
        async with aclosing(pieces) as items:
            async for item in items:
                body = (_object(kind, model, item, False) if isinstance(item, Piece)
                        else _final_object(kind, model, Piece(), item, timing))
                yield json.dumps(body, ensure_ascii=False, separators=(",", ":")) + "\n"
    except (APIError, EngineDeadError, ValueError) as e:
        yield json.dumps({"error": error_status(e)[0]}, ensure_ascii=False) + "\n"


def _load_response(model: str, keep_alive: float | None, kind: str, can_unload: bool) -> JSONResponse:
    """Ollama's answer to a request with nothing to generate: the model is loaded. ``keep_alive: 0`` asks to unload
    it: done (``done_reason`` "unload") once idle where the server can load it again (the pool applies the request's
    keep-alive as its exchange ends), a 400 where it cannot (a server started with one engine)."""
    if keep_alive == 0 and not can_unload:
        raise APIError(f"kvloom keeps \"{model}\" loaded for the server's life: it cannot unload it (keep_alive 0 "
                       f"with nothing to generate)")
    body = _object(kind, model, Piece(), True)
    body["done_reason"] = "unload" if keep_alive == 0 else "load"
    return JSONResponse(body)


def keep_alive_seconds(value: Any) -> float | None:
    """``parse_keep_alive``, a 400 for a bad value."""
    try:
        return parse_keep_alive(value)
    except ValueError as e:
        raise APIError(str(e)) from None


def _response_format(format_: str | dict[str, Any] | None) -> dict[str, Any]:
    """``format`` as the chat request's ``response_format``."""
    if format_ is None or format_ == "":
        return {}
    if format_ == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(format_, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": format_}}}
    raise APIError(f"invalid format: {format_!r}; expected \"json\" or a JSON schema object")


# ---- messages ---------------------------------------------------------------------------------


def _chat_messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """Ollama's messages as chat messages; a tool result is matched to the call it answers."""
    chat: list[dict[str, Any]] = []
    unanswered: list[tuple[str, str]] = []  # (call id, name) of the latest assistant's calls, oldest first
    for index, message in enumerate(messages):
        role = message.role.lower()
        where = f"messages[{index}]"
        if role not in ROLES:
            raise APIError(f"{where}.role must be one of {', '.join(ROLES)}, got {message.role!r}")
        if message.images and role != "user":
            raise APIError(f"{where} holds images, which only a user message can hold")
        if message.tool_calls and role != "assistant":
            raise APIError(f"{where} holds tool_calls, which only an assistant message can hold")
        if role == "assistant":
            entry: dict[str, Any] = {"role": "assistant", "content": message.content}
            if message.tool_calls:
                calls = []
                for number, call in enumerate(message.tool_calls):
                    call_id = call.id or f"call_{index}_{number}"
                    calls.append({"id": call_id, "type": "function", "function": {
                        "name": call.function.name,
                        "arguments": json.dumps(call.function.arguments, ensure_ascii=False)}})
                entry["tool_calls"] = calls
                unanswered = [(call["id"], call["function"]["name"]) for call in calls]
            if message.thinking:
                entry["reasoning_content"] = message.thinking
            chat.append(entry)
        elif role == "tool":
            call_id = message.tool_call_id or _answered_call(unanswered, message.tool_name, index)
            unanswered = [(i, name) for i, name in unanswered if i != call_id]
            entry = {"role": "tool", "tool_call_id": call_id, "content": message.content}
            if message.tool_name:
                entry["name"] = message.tool_name
            chat.append(entry)
        elif role == "user" and message.images:
            chat.append({"role": "user", "content": chat_content(
                [*_image_parts(message.images, f"{where}.images"), {"type": "text", "text": message.content}])})
        else:
            chat.append({"role": role, "content": message.content})
    return chat


def _answered_call(unanswered: list[tuple[str, str]], tool_name: str | None, index: int) -> str:
    """The call a tool message without ``tool_call_id`` answers: the oldest unanswered one named ``tool_name``, or
    the oldest unanswered one."""
    for call_id, name in unanswered:
        if name == tool_name:
            return call_id
    if unanswered:
        return unanswered[0][0]
    return f"call_{index}"


def _image_parts(images: list[str], where: str) -> list[dict[str, Any]]:
    """Base64 images as ``image_url`` parts with data URLs (the media type read from the image's first bytes)."""
    parts = []
    for number, data in enumerate(images):
        try:
            head = base64.b64decode(data[:32], validate=True)
        except (binascii.Error, ValueError):
            raise APIError(f"{where}[{number}] is not base64 image data: {data[:20]!r}") from None
        media_type = next((kind for signature, kind in IMAGE_SIGNATURES if head.startswith(signature)),
                          "image/webp" if head[8:12] == b"WEBP" else "image/png")
        parts.append({"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}})
    return parts


# ---- fill in the middle --------------------------------------------------------------------------


def fim_tokens(serving: OpenAIServing, model: str) -> FimTokens:
    """The model's fill-in-the-middle tokens (``OpenAIServing.fim_tokens``: fim.py, as llama.cpp finds them); its 400
    in Ollama's words for a model without them."""
    try:
        return serving.fim_tokens("suffix")
    except APIError as e:
        raise APIError(f"\"{model}\" does not support insert: suffix needs a code model trained for fill-in-the-"
                       f"middle ({e.message})") from None


# ---- errors -----------------------------------------------------------------------------------


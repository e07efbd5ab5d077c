"""The OpenAI endpoints' logic: request -> EngineRequests -> AsyncLLM -> response.

Prompts are tokenized and validated once, by the engine's InputProcessor, into the EngineRequests
handed to ``AsyncLLM.generate``. Every client mistake becomes an ``APIError`` (OpenAI's error
shape, a 4xx that names the bad parameter) before anything is queued. A streamed response asks
the engine for deltas (``RequestOutputKind.DELTA``) and sends each as a server-sent event, ending
with ``data: [DONE]``; a whole response asks for the final output only. A consumer that goes away
(a client that disconnects) cancels the generators, which abort their requests in the engine.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from kvloom.engine.async_engine import AsyncLLM, EngineDeadError
from kvloom.engine.input_processor import EngineRequest, TokenizedPrompt
from kvloom.engine.request import ContextLengthError
from kvloom.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    SamplingFields,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
)
from kvloom.outputs import CompletionOutput, Logprob, RequestOutput
from kvloom.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams

# What OpenAI's API returns for a -inf logprob (JSON has no infinity).
_MIN_LOGPROB = -9999.0
# Tokenizing a long text blocks; beyond this many characters it runs in a worker thread.
_INLINE_TOKENIZE_CHARS = 8192
# A prompt of more than max_model_len * chars-per-token characters cannot fit, and is refused
# before it is tokenized. Chars-per-token is the longest vocabulary entry's length (a token never
# stands for more characters than its own spelling; byte-level entries spell one byte per
# character), and at least this: English text averages ~4 characters per token, and long
# whitespace or punctuation runs, the longest common tokens, stay under 16 in most vocabularies.
MIN_CHARS_PER_TOKEN = 16


def max_chars_per_token_of(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` can stand for (at least MIN_CHARS_PER_TOKEN)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        return MIN_CHARS_PER_TOKEN
    vocab = backend.get_vocab(with_added_tokens=True)
    return max(MIN_CHARS_PER_TOKEN, max(map(len, vocab), default=0))


class APIError(Exception):
    """A request the server refuses, in OpenAI's error shape."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.type = type
        self.code = code

    def response(self) -> JSONResponse:
        return error_response(self.message, self.status_code, self.param, self.type, self.code)


def error_response(message: str, status_code: int = 400, param: str | None = None,
                   type: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status_code)


def _sse(payload: BaseModel | dict) -> str:
    """One server-sent event. Chunks leave out null fields, but every choice keeps its
    finish_reason and logprobs keys, as OpenAI's chunks do."""
    data = payload.model_dump(exclude_none=True) if isinstance(payload, BaseModel) else payload
    for choice in data.get("choices", ()):
        choice.setdefault("logprobs", None)
        choice.setdefault("finish_reason", None)
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def merge_async_iterators(iterators: Sequence[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Yield (index, item) from several async iterators as items arrive.

    Closing or cancelling the merged iterator cancels the producers, so their ``finally`` blocks
    (request aborts) run at once.
    """
    if len(iterators) == 1:
        async with aclosing(iterators[0]) as iterator:
            async for item in iterator:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def produce(index: int, iterator: AsyncIterator[Any]) -> None:
        try:
            async for item in iterator:
                await queue.put((index, item))
            await queue.put((index, done))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, e))

    tasks = [asyncio.ensure_future(produce(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _last(generator: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async with aclosing(generator) as outputs:
        async for output in outputs:
            last = output
    if last is None:
        raise EngineDeadError("the engine returned no output")
    return last


async def run_until_disconnected(coro: Any, raw_request: Request) -> Response:
    """Await a handler, cancelling it (and so aborting its requests) if the client goes away."""

    async def wait_for_disconnect() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    handler = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not handler.done():
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
    if handler.cancelled():
        return Response(status_code=499)  # nobody is listening any more
    return handler.result()


class OpenAIServing:
    """Shared by the endpoints: the model names, prompt building, sampling parameters, limits."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], chat_template: str | None = None,
                 *, max_logprobs: int = MAX_LOGPROBS, max_chars_per_token: int | None = None) -> None:
        """``max_logprobs``: the most logprobs per position a request may ask for.
        ``max_chars_per_token``: the character cap's factor (default: from the tokenizer)."""
        self.engine = engine
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.chat_template = chat_template
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.input_processor.vocab_size
        self.max_num_seqs = engine.max_num_seqs
        self.max_logprobs = max_logprobs
        if max_chars_per_token is None:
            max_chars_per_token = max_chars_per_token_of(self.tokenizer)
        self.max_prompt_chars = self.max_model_len * max_chars_per_token

    # ---- checks ----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise APIError(f"The model `{model}` does not exist.", 404, "model", code="model_not_found")

    def check_engine(self) -> None:
        if self.engine.errored:
            raise APIError(f"The engine is not running: {self.engine.dead_error}", 503,
                           type="server_error", code="engine_dead")

    def check_limits(self, n: int, logprobs: int | None, logprobs_param: str) -> None:
        """``n`` and the logprobs a request asks for against the server's limits (a 400 otherwise)."""
        if n > self.max_num_seqs:
            raise APIError(f"n must be at most {self.max_num_seqs} (the engine's max_num_seqs: one "
                           f"batch's worth), got {n}", param="n")
        if logprobs is not None and logprobs > self.max_logprobs:
            raise APIError(f"{logprobs_param} must be at most {self.max_logprobs} (the server's "
                           f"--max-logprobs), got {logprobs}", param=logprobs_param)

    def check_prompt_chars(self, num_chars: int, prompt_name: str) -> None:
        """Refuse a prompt of more characters than any prompt that fits the context can have."""
        if num_chars > self.max_prompt_chars:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                           f"the {prompt_name} has {num_chars} characters, more than any prompt of "
                           f"{self.max_model_len} tokens can hold (at most {self.max_prompt_chars}). "
                           f"Please reduce the length of the {prompt_name}.", param=prompt_name,
                           code="context_length_exceeded")

    def check_prompt_size(self, prompt: str | list[int], prompt_name: str) -> None:
        """Refuse, before tokenizing, a prompt too long for any tokenization to fit the context."""
        # Token ids need no tokenizing: the input processor checks their length, with the one message.
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt), prompt_name)

    def max_tokens(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """OpenAI's default when the client gave none: the rest of the context (a prompt that fills
        it is refused by the input processor, with the context-length message)."""
        return max_tokens if max_tokens is not None else max(1, self.max_model_len - num_prompt_tokens)

    def sampling_params(self, request: SamplingFields, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        names: dict[str, str] | None = None) -> SamplingParams:
        """OpenAI's defaults where the client sent nothing; a 400 naming the field otherwise."""
        top_k = request.top_k
        if top_k is not None and top_k >= self.vocab_size:
            top_k = 0  # every token is in the top k: no filter
        kwargs: dict[str, Any] = dict(
            n=request.n, temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
            top_k=0 if top_k is None else top_k, min_p=request.min_p or 0.0, seed=request.seed,
            stop=request.stop, stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos,
            max_tokens=max_tokens, min_tokens=request.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
            # A stream sends what each step adds; a whole response needs only the end.
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY)
        if request.logit_bias:
            raise APIError("logit_bias is not supported", param="logit_bias")
        if request.stream_options is not None and not request.stream:
            raise APIError("stream_options can only be set when stream is true", param="stream_options")
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            raise APIError(str(e), param=_param_of(str(e), kwargs, names)) from None

    async def tokenize_prompt(self, prompt: str | list[int], add_special_tokens: bool,
                              prompt_name: str) -> TokenizedPrompt:
        """A prompt's checked token ids; a 400 naming ``prompt_name`` when it is not valid."""
        self.check_prompt_size(prompt, prompt_name)
        tokenize = self.engine.input_processor.tokenize
        try:
            if isinstance(prompt, str) and len(prompt) > _INLINE_TOKENIZE_CHARS:
                return await asyncio.to_thread(tokenize, prompt, add_special_tokens)
            return tokenize(prompt, add_special_tokens)
        except ValueError as e:
            raise APIError(str(e), param=prompt_name) from None

    def engine_request(self, request_id: str, prompt: TokenizedPrompt, params: SamplingParams,
                       prompt_name: str, max_tokens_param: str | None) -> EngineRequest:
        """The request for the engine, validated once; a 400 naming the parameter at fault.

        ``max_tokens_param``: the field the client set max_tokens with (None: it set none)."""
        try:
            return self.engine.input_processor.process(request_id, prompt, params, max_tokens_must_fit=True)
        except ContextLengthError as e:
            raise APIError(e.message(prompt_name), param=max_tokens_param or prompt_name,
                           code="context_length_exceeded") from None
        except ValueError as e:
            message = str(e)
            name = prompt_name if "prompt" in message.lower() else _param_of(message, vars(params), None)
            raise APIError(message, param=name) from None

    async def render_chat_checked(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                                  template_kwargs: dict[str, Any] | None = None) -> str:
        """``render_chat`` behind the character cap: messages whose text alone is over it are
        refused before rendering (a template writes every message's text), and long ones are
        rendered in a worker thread so the event loop keeps serving."""
        num_chars = sum(_text_length(message.get("content")) for message in messages
                        if isinstance(message, dict))
        self.check_prompt_chars(num_chars, "messages")
        if num_chars > _INLINE_TOKENIZE_CHARS:
            return await asyncio.to_thread(self.render_chat, messages, add_generation_prompt, template_kwargs)
        return self.render_chat(messages, add_generation_prompt, template_kwargs)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text of a conversation, rendered as ``LLM.chat`` renders it."""
        kwargs = dict(template_kwargs or {})
        for reserved in ("messages", "add_generation_prompt", "chat_template", "tools"):
            kwargs.pop(reserved, None)
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      chat_template=self.chat_template, **kwargs)
        except ValueError as e:
            raise APIError(str(e), param="messages") from None
        except (TypeError, KeyError, AttributeError, IndexError) as e:
            raise APIError(f"chat template failed to render the messages: {e}", param="messages") from None

    def decoded(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _param_of(message: str, fields: dict[str, Any], names: dict[str, str] | None) -> str | None:
    """The parameter a SamplingParams / engine error message is about (its first word)."""
    match = re.match(r"\s*([a-z_]+)", message)
    if match is None:
        return None
    word = match.group(1)
    if word not in fields:
        return None
    return (names or {}).get(word, word)


def _text_length(content: Any) -> int:
    """The characters of a chat message's content: a string or a list of text parts."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(part["text"]) for part in content
                   if isinstance(part, dict) and isinstance(part.get("text"), str))
    return 0


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def _error_event(error: BaseException) -> str:
    if isinstance(error, APIError):
        info = ErrorInfo(message=error.message, type=error.type, param=error.param, code=error.code)
    elif isinstance(error, EngineDeadError):
        info = ErrorInfo(message=str(error), type="server_error", code="engine_dead")
    elif isinstance(error, ValueError):
        info = ErrorInfo(message=str(error), type="invalid_request_error")
    else:
        info = ErrorInfo(message=f"internal error: {error!r}", type="server_error")
    return _sse(ErrorResponse(error=info).model_dump())


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---------------------------------------------------------------------------------------------
# /v1/completions
# ---------------------------------------------------------------------------------------------

class _ChoiceState:
    """What one streamed choice has sent so far."""

    __slots__ = ("offset", "finished", "started")

    def __init__(self) -> None:
        self.offset = 0  # text offset of the next logprob token
        self.finished = False
        self.started = False


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        self.check_engine()
        if request.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise APIError(f"best_of must equal n ({request.n}) when given; kvloom does not rank "
                           f"extra completions", param="best_of")
        self.check_limits(request.n, request.logprobs, "logprobs")
        prompts = await self._prompts(request)
        logprobs = request.logprobs
        prompt_logprobs = logprobs if request.echo and logprobs is not None else None
        request_id = f"cmpl-{uuid.uuid4().hex}"
        max_tokens_param = "max_tokens" if request.max_tokens is not None else None
        requests = []
        for i, prompt in enumerate(prompts):
            params = self.sampling_params(request, self.max_tokens(len(prompt.token_ids), request.max_tokens),
                                          logprobs, prompt_logprobs)
            requests.append(self.engine_request(f"{request_id}-{i}", prompt, params, "prompt", max_tokens_param))
        echo_texts = None
        if request.echo:
            echo_texts = [p.text if p.text is not None
                          else self.tokenizer.decode(list(p.token_ids), skip_special_tokens=False)
                          for p in prompts]

        created = int(time.time())
        model = request.model or self.model_name
        generators = [self.engine.generate(r) for r in requests]
        if request.stream:
            return _event_stream(self._stream(request, request_id, created, model, prompts, echo_texts,
                                              generators))

        async def collect() -> Response:
            outputs = await asyncio.gather(*[_last(g) for g in generators])
            return JSONResponse(self._response(request, request_id, created, model, prompts, echo_texts,
                                               outputs).model_dump())

        return await run_until_disconnected(collect(), raw_request)

    async def _prompts(self, request: CompletionRequest) -> list[TokenizedPrompt]:
        prompt = request.prompt
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise APIError("prompt must not be empty", param="prompt")
        return [await self.tokenize_prompt(item, request.add_special_tokens, "prompt") for item in items]

    def _logprobs(self, token_ids: list[int], entries: Sequence[dict[int, Logprob] | None],
                  offset: int) -> CompletionLogProbs:
        result = CompletionLogProbs()
        for token_id, entry in zip(token_ids, entries, strict=False):
            if entry is None:  # the first prompt token has no logprob
                token = self.decoded(token_id)
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                chosen = entry.get(token_id)
                token = self.decoded(token_id, chosen)
                result.token_logprobs.append(max(chosen.logprob, _MIN_LOGPROB) if chosen else None)
                result.top_logprobs.append({self.decoded(t, lp): max(lp.logprob, _MIN_LOGPROB)
                                            for t, lp in entry.items()})
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
        return result

    def _choice_logprobs(self, request: CompletionRequest, output: RequestOutput,
                         completion: CompletionOutput) -> CompletionLogProbs | None:
        if request.logprobs is None:
            return None
        token_ids, entries = list(completion.token_ids), list(completion.logprobs or [])
        if request.echo:
            token_ids = list(output.prompt_token_ids) + token_ids
            prompt_entries = list(output.prompt_logprobs or [])
            prompt_entries += [None] * (len(output.prompt_token_ids) - len(prompt_entries))
            entries = prompt_entries + entries
        return self._logprobs(token_ids, entries, 0)

    def _response(self, request: CompletionRequest, request_id: str, created: int, model: str,
                  prompts: list[TokenizedPrompt], echo_texts: list[str] | None,
                  outputs: list[RequestOutput]) -> CompletionResponse:
        choices = []
        num_generated = 0
        for prompt_index, output in enumerate(outputs):
            for completion in output.outputs:
                text = echo_texts[prompt_index] + completion.text if echo_texts else completion.text
                choices.append(CompletionResponseChoice(
                    index=prompt_index * request.n + completion.index, text=text,
                    logprobs=self._choice_logprobs(request, output, completion),
                    finish_reason=completion.finish_reason, stop_reason=completion.stop_reason))
                num_generated += len(completion.token_ids)
        num_prompt = sum(len(p.token_ids) for p in prompts)
        return CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                  usage=_usage(num_prompt, num_generated))

    async def _stream(self, request: CompletionRequest, request_id: str, created: int, model: str,
                      prompts: list[TokenizedPrompt], echo_texts: list[str] | None,
                      generators: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
        n = request.n
        states = [_ChoiceState() for _ in range(len(prompts) * n)]
        # A delta stream carries the prompt's logprobs once; every choice of the prompt echoes them.
        prompt_logprobs: list[Any] = [None] * len(prompts)
        num_generated = 0
        try:
            async with aclosing(merge_async_iterators(generators)) as merged:
                async for prompt_index, output in merged:
                    if output.prompt_logprobs is not None:
                        prompt_logprobs[prompt_index] = output.prompt_logprobs
                    for completion in output.outputs:
                        index = prompt_index * n + completion.index
                        state = states[index]
                        if state.finished:
                            continue
                        num_generated += len(completion.token_ids)
                        choice = self._delta_choice(request, prompts[prompt_index],
                                                    echo_texts[prompt_index] if echo_texts else None,
                                                    prompt_logprobs[prompt_index], completion, state, index)
                        if choice is not None:
                            yield _sse(CompletionStreamResponse(id=request_id, created=created, model=model,
                                                                choices=[choice]))
            if request.stream_options is not None and request.stream_options.include_usage:
                num_prompt = sum(len(p.token_ids) for p in prompts)
                yield _sse(CompletionStreamResponse(id=request_id, created=created, model=model,
                                                    choices=[], usage=_usage(num_prompt, num_generated)))
        except (APIError, EngineDeadError, ValueError) as e:
            yield _error_event(e)
        yield "data: [DONE]\n\n"

    def _delta_choice(self, request: CompletionRequest, prompt: TokenizedPrompt, echo_text: str | None,
                      prompt_logprobs: Any, completion: CompletionOutput, state: _ChoiceState,
                      index: int) -> CompletionResponseChoice | None:
        """One chunk of a choice from one delta output (None when it adds nothing)."""
        text = completion.text
        logprobs = None
        if not state.started:
            state.started = True
            if echo_text is not None:
                text = echo_text + text
                if request.logprobs is not None:
                    entries = list(prompt_logprobs or [])
                    entries += [None] * (len(prompt.token_ids) - len(entries))
                    logprobs = self._logprobs(list(prompt.token_ids), entries, 0)
                    state.offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        if request.logprobs is not None and completion.token_ids:
            more = self._logprobs(completion.token_ids, completion.logprobs or [], state.offset)
            if more.tokens:
                state.offset = more.text_offset[-1] + len(more.tokens[-1])
            if logprobs is None:
                logprobs = more
            else:
                for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
                    getattr(logprobs, name).extend(getattr(more, name))
        finish_reason = completion.finish_reason
        state.finished = finish_reason is not None
        if not text and logprobs is None and finish_reason is None:
            return None
        choice = CompletionResponseChoice(index=index, text=text, logprobs=logprobs,
                                          finish_reason=finish_reason)
        if finish_reason is not None:
            choice.stop_reason = completion.stop_reason
        return choice


# ---------------------------------------------------------------------------------------------
# /v1/chat/completions
# ---------------------------------------------------------------------------------------------

class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        self.check_engine()
        if request.tools:
            raise APIError("tools are not supported: kvloom does not parse tool calls", param="tools")
        if request.response_format and request.response_format.get("type") not in (None, "text"):
            raise APIError("response_format must be {'type': 'text'}; structured outputs are not "
                           "supported", param="response_format")
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
        self.check_limits(request.n, request.top_logprobs, "top_logprobs")
        prompt_text = await self.render_chat_checked(request.messages, request.add_generation_prompt,
                                                     request.chat_template_kwargs)
        # The template already wrote any BOS it wants.
        prompt = await self.tokenize_prompt(prompt_text, add_special_tokens=False, prompt_name="messages")
        if request.max_completion_tokens is not None:
            max_tokens, param = request.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = request.max_tokens, "max_tokens"
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, self.max_tokens(len(prompt.token_ids), max_tokens), logprobs,
                                      names={"max_tokens": param, "logprobs": "top_logprobs"})
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        engine_request = self.engine_request(request_id, prompt, params, "messages",
                                             param if max_tokens is not None else None)

        created = int(time.time())
        model = request.model or self.model_name
        generator = self.engine.generate(engine_request)
        if request.stream:
            return _event_stream(self._stream(request, request_id, created, model,
                                              len(prompt.token_ids), generator))

        async def collect() -> Response:
            output = await _last(generator)
            return JSONResponse(self._response(request, request_id, created, model, output).model_dump())

        return await run_until_disconnected(collect(), raw_request)

    def _logprobs(self, token_ids: list[int], entries: Sequence[dict[int, Logprob]],
                  num: int) -> ChatCompletionLogProbs:
        content = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            chosen = entry.get(token_id)
            token = self.decoded(token_id, chosen)
            top = sorted(entry.items(), key=lambda item: 1 << 30 if item[1].rank is None else item[1].rank)
            top_logprobs = []
            for t, lp in top:
                if len(top_logprobs) >= num or (lp.rank is not None and lp.rank > num):
                    break
                top_token = self.decoded(t, lp)
                top_logprobs.append(TopLogprob(token=top_token, logprob=max(lp.logprob, _MIN_LOGPROB),
                                               bytes=list(top_token.encode("utf-8"))))
            content.append(ChatCompletionLogProb(
                token=token, logprob=max(chosen.logprob, _MIN_LOGPROB) if chosen else _MIN_LOGPROB,
                bytes=list(token.encode("utf-8")), top_logprobs=top_logprobs))
        return ChatCompletionLogProbs(content=content)

    def _response(self, request: ChatCompletionRequest, request_id: str, created: int, model: str,
                  output: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for completion in output.outputs:
            logprobs = None
            if request.logprobs:
                logprobs = self._logprobs(completion.token_ids, completion.logprobs or [],
                                          request.top_logprobs or 0)
            choices.append(ChatCompletionResponseChoice(
                index=completion.index, message=ChatMessage(role="assistant", content=completion.text),
                logprobs=logprobs, finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason))
        num_generated = sum(len(c.token_ids) for c in output.outputs)
        return ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                      usage=_usage(len(output.prompt_token_ids), num_generated))

    async def _stream(self, request: ChatCompletionRequest, request_id: str, created: int, model: str,
                      num_prompt_tokens: int, generator: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        states = [_ChoiceState() for _ in range(request.n)]

        def chunk(choice: ChatCompletionResponseStreamChoice) -> str:
            return _sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                     choices=[choice]))

        try:
            for index in range(request.n):
                yield chunk(ChatCompletionResponseStreamChoice(
                    index=index, delta=DeltaMessage(role="assistant", content=""), logprobs=None,
                    finish_reason=None))
            num_generated = 0
            saw_output = False
            async with aclosing(generator) as outputs:
                async for output in outputs:
                    saw_output = True
                    for completion in output.outputs:
                        state = states[completion.index]
                        if state.finished:
                            continue
                        num_generated += len(completion.token_ids)
                        choice = self._delta_choice(request, completion, state)
                        if choice is not None:
                            yield chunk(choice)
            if request.stream_options is not None and request.stream_options.include_usage and saw_output:
                yield _sse(ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[],
                    usage=_usage(num_prompt_tokens, num_generated)))
        except (APIError, EngineDeadError, ValueError) as e:
            yield _error_event(e)
        yield "data: [DONE]\n\n"

    def _delta_choice(self, request: ChatCompletionRequest, completion: CompletionOutput,
                      state: _ChoiceState) -> ChatCompletionResponseStreamChoice | None:
        """One chunk of a choice from one delta output (None when it adds nothing)."""
        text = completion.text
        logprobs = None
        if request.logprobs and completion.token_ids:
            logprobs = self._logprobs(completion.token_ids, completion.logprobs or [], request.top_logprobs or 0)
        finish_reason = completion.finish_reason
        state.finished = finish_reason is not None
        if not text and logprobs is None and finish_reason is None:
            return None
        choice = ChatCompletionResponseStreamChoice(
            index=completion.index, delta=DeltaMessage(content=text) if text else DeltaMessage(),
            logprobs=logprobs, finish_reason=finish_reason)
        if finish_reason is not None:
            choice.stop_reason = completion.stop_reason
        return choice


# ---------------------------------------------------------------------------------------------
# /tokenize, /detokenize
# ---------------------------------------------------------------------------------------------

class OpenAIServingTokenization(OpenAIServing):
    """/tokenize and /detokenize: the tokenizer itself, for any text (nothing goes to the engine)."""

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) <= _INLINE_TOKENIZE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)

    def token_ids(self, ids: list[int], param: str) -> list[int]:
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise APIError(f"token ids must be integers in [0, {self.vocab_size}), got {t}", param=param)
        return ids

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError("give exactly one of prompt (text) or messages (a chat)", param="prompt")
        if request.messages is not None:
            text = await self.render_chat_checked(request.messages, request.add_generation_prompt)
            add_special = bool(request.add_special_tokens)
        else:
            text = request.prompt or ""
            add_special = request.add_special_tokens is not False
        self.check_prompt_size(text, "messages" if request.messages is not None else "prompt")
        ids = await self.encode(text, add_special)
        token_strs = [self.tokenizer.id_to_token(t) for t in ids] if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids,
                                token_strs=token_strs)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        ids = self.token_ids(request.tokens, "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(ids, skip_special_tokens=False))

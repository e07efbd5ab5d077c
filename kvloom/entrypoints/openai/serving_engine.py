"""What every OpenAI endpoint family shares: ``OpenAIServing`` (the base class of
``serving_completion``, ``serving_chat`` and ``serving_tokenization``), OpenAI's error shape, and
the server-sent-event stream.

Prompts are tokenized and validated once, by the engine's InputProcessor, into the EngineRequests
handed to ``generate`` of the engine client (``AsyncLLM``, or the data-parallel ``ReplicaRouter``).
Every client mistake becomes an ``APIError`` (OpenAI's error shape, a 4xx that names the bad
parameter) before anything is queued. A streamed response asks the engine for deltas
(``RequestOutputKind.DELTA``) and sends each as a server-sent event, ending with ``data: [DONE]``;
a whole response asks for the final output only. A consumer that goes away (a client that
disconnects) cancels the generators, which abort their requests in the engine.

A new endpoint family (embeddings, ...) is a module with one ``OpenAIServing`` subclass: the model
check, engine health, limits, prompt tokenization and ``engine_request`` are here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from kvloom.engine.engine_client import EngineClient, EngineDeadError
from kvloom.engine.input_processor import EngineRequest, TokenizedPrompt
from kvloom.engine.request import ContextLengthError
from kvloom.entrypoints.openai.fim import (
    LLAMA_SERVER_N_BATCH,
    LLAMA_SERVER_N_PREDICT,
    FimTokens,
    InfillUnsupportedError,
    format_prompt_infill,
)
from kvloom.entrypoints.openai.protocol import (
    ErrorInfo,
    ErrorResponse,
    PromptProgress,
    PromptTokensDetails,
    RequestModel,
    SamplingFields,
    Timings,
    UsageInfo,
)
from kvloom.outputs import Logprob, RequestOutput
from kvloom.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams, StructuredOutputsParams

logger = logging.getLogger("kvloom")

# vLLM request fields kvloom does not implement: a request that sets one (to anything but null / false) is
# refused with a 400 naming it, rather than served as if it had not asked (docs/serving.md).
REFUSED_FIELDS = ("use_beam_search", "length_penalty", "early_stopping", "truncate_prompt_tokens", "truncation_side",
                  "prompt_logprob_token_ids", "prompt_logprob_start", "logprob_token_ids", "flat_logprobs",
                  "thinking_token_budget", "repetition_detection", "trace_decode_token_ids", "watermarking",
                  "vllm_xargs", "extra_args", "return_tokens_as_token_ids", "return_token_ids", "guided_json",
                  "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_decoding",
                  "logits_processors", "continue_final_message", "stream_interval", "skip_reading_prefix_cache",
                  "routed_experts_prompt_start", "detokenize", "output_kind", "skip_clone",
                  "output_text_buffer_length",
                  # OpenAI's fields for what a text model served here cannot do.
                  "functions", "function_call", "audio", "modalities", "prediction", "reasoning_effort",
                  "web_search_options")
# The values of a refused field that ask for nothing kvloom lacks (default: null and false).
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {"detokenize": (None, True), "routed_experts_prompt_start": (None, 0),
                                               "modalities": (None, ["text"])}

# What OpenAI's API returns for a -inf logprob (JSON has no infinity).
MIN_LOGPROB = -9999.0
# Tokenizing a long text blocks; beyond this many characters it runs in a worker thread.
INLINE_TOKENIZE_CHARS = 8192
# A prompt of more than max_model_len * chars-per-token characters cannot fit, and is refused
# before it is tokenized. Chars-per-token is the longest vocabulary entry's length (a token never
# stands for more characters than its own spelling; byte-level entries spell one byte per
# character), and at least this: English text averages ~4 characters per token, and long
# whitespace or punctuation runs, the longest common tokens, stay under 16 in most vocabularies.
MIN_CHARS_PER_TOKEN = 16


# vLLM's extra sampling fields, which a Messages or Responses body may carry as a Chat Completions body does:
# each dialect passes them through to the chat request it translates into.
EXTRA_SAMPLING_FIELDS = ("seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens",
                         "ignore_eos", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                         "logit_bias", "allowed_token_ids", "bad_words")


def chat_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A chat message's content from a dialect's parts: one text part as a string (what every template renders);
    several, or images, as parts."""
    if not parts:
        return ""
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]
    return parts


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


def error_status(error: BaseException) -> tuple[str, int]:
    """The message and HTTP status an error is answered with, in every API's shape: a refused request's own, 503 for
    a dead engine, 400 for a ValueError, 500 for anything else (no request should cause one)."""
    if isinstance(error, APIError):
        return error.message, error.status_code
    if isinstance(error, EngineDeadError):
        return str(error), 503
    if isinstance(error, ValueError):
        return str(error), 400
    return f"internal error: {error!r}", 500


Handler = Callable[[Request], Awaitable[Response]]


def answered_in_shape(error_response: Callable[[str, int], Response], api: str) -> Callable[[Handler], Handler]:
    """A decorator for another dialect's routes (Anthropic's Messages API, Ollama's): every error the handler raises
    answered by ``error_response(message, status)`` in that API's shape; 500s logged, naming ``api``."""
    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def answer(raw_request: Request) -> Response:
            try:
                return await handler(raw_request)
            except Exception as e:  # noqa: BLE001 - every error is answered in the API's shape
                message, status = error_status(e)
                if status == 500:
                    logger.exception("internal error while serving %s request", api)
                return error_response(message, status)

        return answer

    return decorate


def sse_event(payload: BaseModel | dict) -> str:
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


async def last_output(generator: AsyncIterator[RequestOutput]) -> RequestOutput:
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

    # The engine's runner (--runner): 'pooling' serves embeddings only, so generation requests are refused.
    runner = "auto"
    # Set by the app: why the served model does not generate (a sequence classifier: serving_score.py), or None.
    generation_refusal: Callable[[], str | None] | None = None

    def __init__(self, engine: EngineClient, served_model_names: list[str], chat_template: str | None = None,
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
        # The LoRA adapters offered by name (serving_lora.LoRAModules), set by the app; None: none.
        self.lora_modules: Any = None

    # ---- checks ----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names and not (
                self.lora_modules is not None and model in self.lora_modules):
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

    def check_prompt_logprobs(self, request: SamplingFields) -> None:
        """vLLM's prompt_logprobs: within --max-logprobs, and not on a stream (as vLLM: a 400)."""
        if request.prompt_logprobs is None:
            return
        if request.stream:
            raise APIError("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
        self.check_limits(1, request.prompt_logprobs, "prompt_logprobs")

    def prompt_logprobs_field(self, output: RequestOutput) -> list[dict[str, Any] | None] | None:
        """vLLM's prompt_logprobs of a response: per prompt position (None first), token id -> logprob,
        rank and decoded token; -inf as MIN_LOGPROB (JSON has no infinity)."""
        if output.prompt_logprobs is None:
            return None
        return [None if entry is None else {
            str(token_id): {"logprob": max(lp.logprob, MIN_LOGPROB), "rank": lp.rank,
                            "decoded_token": self.decoded(token_id, lp)}
            for token_id, lp in entry.items()} for entry in output.prompt_logprobs]

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
                        names: dict[str, str] | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """OpenAI's defaults where the client sent nothing; a 400 naming the field otherwise.
        ``structured_outputs``: the request's constraint (``structured_outputs_of``, or a forced tool call)."""
        if self.runner == "pooling":
            raise APIError("this server runs with --runner pooling (embeddings only): use /v1/embeddings, or serve "
                           "with --runner auto to generate too", param="model")
        refusal = None if self.generation_refusal is None else self.generation_refusal()
        if refusal is not None:
            raise APIError(refusal, param="model")
        self.check_refused_fields(request)
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
            skip_special_tokens=request.skip_special_tokens, structured_outputs=structured_outputs,
            logit_bias=self.logit_bias_of(request.logit_bias), allowed_token_ids=request.allowed_token_ids,
            bad_words=request.bad_words or None,
            # A stream sends what each step adds; a whole response needs only the end.
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY)
        if not request.spaces_between_special_tokens and not request.skip_special_tokens:
            # The one case it changes vLLM's text (no space between two special tokens shown): not implemented.
            raise APIError("spaces_between_special_tokens=false with skip_special_tokens=false is not supported "
                           "by kvloom", param="spaces_between_special_tokens")
        if request.stream_options is not None and not request.stream:
            raise APIError("stream_options can only be set when stream is true", param="stream_options")
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            raise APIError(str(e), param=_param_of(str(e), kwargs, names)) from None

    @staticmethod
    def check_refused_fields(request: RequestModel) -> None:
        """A 400 for a vLLM field kvloom does not implement (REFUSED_FIELDS), set to something."""
        for name, value in (request.model_extra or {}).items():
            if name in REFUSED_FIELDS and value not in _NEUTRAL_VALUES.get(name, (None, False)):
                raise APIError(f"{name} is not supported by kvloom; leave it out (docs/serving.md lists every "
                               f"request field and whether it is honoured)", param=name)

    def logit_bias_of(self, logit_bias: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's logit_bias (JSON keys are strings) as token id -> bias; a 400 for a key that is not a
        token id of this model's vocabulary (values are checked by SamplingParams: -100..100)."""
        if not logit_bias:
            return None
        bias = {}
        for key, value in logit_bias.items():
            token = key.strip()
            if not token.isdigit() or int(token) >= self.vocab_size:
                raise APIError(f"logit_bias keys must be token ids in [0, {self.vocab_size}), got {key!r}",
                               param="logit_bias")
            bias[int(token)] = value
        return bias

    def structured_outputs_of(self, request: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
        """The constraint ``response_format`` or vLLM's ``structured_outputs`` asks for, and the field it came
        from; a 400 naming that field when it is malformed or both are given."""
        response_format, extra = request.response_format, request.structured_outputs
        kind = None if response_format is None else response_format.get("type")
        if kind not in (None, "text") and extra is not None:
            raise APIError("give response_format or structured_outputs, not both", param="structured_outputs")
        if extra is not None:
            allowed = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
            unknown = sorted(set(extra) - allowed)
            if unknown:
                raise APIError(f"structured_outputs got unknown field(s) {unknown}; allowed: {sorted(allowed)}",
                               param="structured_outputs")
            try:
                return StructuredOutputsParams(**extra), "structured_outputs"
            except (ValueError, TypeError) as e:
                raise APIError(str(e), param="structured_outputs") from None
        if kind in (None, "text"):
            return None, None
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise APIError("response_format json_schema needs {'type': 'json_schema', 'json_schema': "
                               "{'name': ..., 'schema': {...}, 'strict': ...}}", param="response_format")
            return StructuredOutputsParams(json=schema), "response_format"
        raise APIError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                       param="response_format")

    async def check_structured_outputs(self, params: StructuredOutputsParams, param: str) -> None:
        """Check the constraint and wait for its grammar (compiled off the event loop, cached for the engine);
        a 400 naming ``param`` when it is malformed, does not compile or takes too long to."""
        check = self.engine.input_processor.check_structured_outputs
        if check is None:
            raise APIError("structured outputs are not available on this server's engine", param=param)
        manager = getattr(check, "__self__", None)
        if manager is not None and manager.is_compiled(params):
            return  # a cached grammar: no thread hop on the way to the first token
        try:
            # The first constrained request builds the backend's token tables: not on the event loop.
            await asyncio.to_thread(check, params)
            if manager is not None:
                future = manager.compile_async(params)
                await asyncio.wait_for(asyncio.wrap_future(future), timeout=manager.compile_timeout)
        except TimeoutError:
            raise APIError(f"the {param} grammar did not compile within {manager.compile_timeout:g} s; "
                           f"simplify it", param=param) from None
        except ValueError as e:
            raise APIError(str(e), param=param) from None

    async def tokenize_prompt(self, prompt: str | list[int], add_special_tokens: bool,
                              prompt_name: str) -> TokenizedPrompt:
        """A prompt's checked token ids; a 400 naming ``prompt_name`` when it is not valid."""
        self.check_prompt_size(prompt, prompt_name)
        tokenize = self.engine.input_processor.tokenize
        try:
            if isinstance(prompt, str) and len(prompt) > INLINE_TOKENIZE_CHARS:
                return await asyncio.to_thread(tokenize, prompt, add_special_tokens)
            return tokenize(prompt, add_special_tokens)
        except ValueError as e:
            raise APIError(str(e), param=prompt_name) from None

    def fim_tokens(self, param: str) -> FimTokens:
        """The model's fill-in-the-middle tokens; a 400 naming ``param`` when it has none (fim.py)."""
        try:
            return FimTokens.of(self.tokenizer)
        except InfillUnsupportedError as e:
            raise APIError(str(e), param=param, code="infill_not_supported") from None

    async def infill_prompt(self, fim: FimTokens, input_prefix: str | list[str | int],
                            input_suffix: str | list[str | int], input_extra: list[dict[str, Any]],
                            prompt_tokens: Sequence[int]) -> TokenizedPrompt:
        """The FIM prompt llama-server builds (fim.format_prompt_infill, with its default batch and n_predict and
        this server's context length); long inputs are tokenized in a worker thread."""
        pieces = [input_prefix, input_suffix, *(chunk.get("text", "") for chunk in input_extra)]
        num_chars = sum(len(p) if isinstance(p, str) else sum(len(x) for x in p if isinstance(x, str))
                        for p in pieces)
        self.check_prompt_chars(num_chars, "input_prefix")

        def build() -> list[int]:
            return format_prompt_infill(self.tokenizer, fim, input_prefix, input_suffix, input_extra,
                                        LLAMA_SERVER_N_BATCH, LLAMA_SERVER_N_PREDICT, self.max_model_len, False,
                                        prompt_tokens)

        token_ids = await asyncio.to_thread(build) if num_chars > INLINE_TOKENIZE_CHARS else build()
        return TokenizedPrompt(None, tuple(token_ids))

    def engine_request(self, request_id: str, prompt: TokenizedPrompt, params: SamplingParams,
                       prompt_name: str, max_tokens_param: str | None, model: str | None = None,
                       return_progress: bool = False) -> EngineRequest:
        """The request for the engine, validated once; a 400 naming the parameter at fault.

        ``max_tokens_param``: the field the client set max_tokens with (None: it set none). ``model``: the
        request's model field, which may name a LoRA adapter. ``return_progress``: outputs after each prefill
        chunk too (llama-server's return_progress; a stream's)."""
        lora_request = None if self.lora_modules is None else self.lora_modules.lora_request(model)
        try:
            request = self.engine.input_processor.process(request_id, prompt, params, max_tokens_must_fit=True,
                                                          lora_request=lora_request)
            return dataclasses.replace(request, return_progress=True) if return_progress else request
        except ContextLengthError as e:
            raise APIError(e.message(prompt_name), param=max_tokens_param or prompt_name,
                           code="context_length_exceeded") from None
        except ValueError as e:
            message = str(e)
            name = prompt_name if "prompt" in message.lower() else _param_of(message, vars(params), None)
            raise APIError(message, param=name) from None

    async def render_chat_checked(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                                  template_kwargs: dict[str, Any] | None = None,
                                  tools: list[dict[str, Any]] | None = None) -> str:
        """``render_chat`` behind the character cap: messages whose text alone is over it are
        refused before rendering (a template writes every message's text), and long ones are
        rendered in a worker thread so the event loop keeps serving."""
        num_chars = sum(_text_length(message.get("content")) for message in messages
                        if isinstance(message, dict))
        self.check_prompt_chars(num_chars, "messages")
        if num_chars > INLINE_TOKENIZE_CHARS:
            return await asyncio.to_thread(self.render_chat, messages, add_generation_prompt, template_kwargs, tools)
        return self.render_chat(messages, add_generation_prompt, template_kwargs, tools)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text of a conversation, rendered as ``LLM.chat`` renders it."""
        kwargs = dict(template_kwargs or {})
        for reserved in ("messages", "add_generation_prompt", "chat_template", "tools"):
            kwargs.pop(reserved, None)
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      chat_template=self.chat_template, tools=tools, **kwargs)
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


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> UsageInfo:
    """OpenAI's usage; ``cached_tokens``: the prompt tokens the prefix cache served (prompt_tokens_details)."""
    details = None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


def timings_of(outputs: Sequence[RequestOutput | None], num_generated: int) -> Timings:
    """llama-server's timings of a response from its prompts' latest outputs: the prompt tokens the prefix cache held
    and those computed, from first scheduling to the first token (the longest prompt's), and the tokens generated
    from the first token to the last. A rate over no time or no tokens is 0."""
    seen = [o for o in outputs if o is not None]
    cache_n = sum(o.num_cached_tokens for o in seen)
    prompt_n = sum(len(o.prompt_token_ids) for o in seen) - cache_n
    metrics = [o.metrics for o in seen if o.metrics is not None]
    prompt_s = max((m.first_token_time - m.first_scheduled_time for m in metrics
                    if m.first_token_time is not None and m.first_scheduled_time is not None), default=0.0)
    firsts = [m.first_token_time for m in metrics if m.first_token_time is not None]
    lasts = [m.last_token_time for m in metrics if m.last_token_time is not None]
    predicted_s = max(lasts) - min(firsts) if firsts and lasts else 0.0
    prompt_ms, predicted_ms = max(prompt_s, 0.0) * 1e3, max(predicted_s, 0.0) * 1e3
    return Timings(cache_n=cache_n, prompt_n=prompt_n, prompt_ms=prompt_ms,
                   prompt_per_token_ms=prompt_ms / prompt_n if prompt_n else 0.0,
                   prompt_per_second=1e3 * prompt_n / prompt_ms if prompt_ms else 0.0,
                   predicted_n=num_generated, predicted_ms=predicted_ms,
                   predicted_per_token_ms=predicted_ms / num_generated if num_generated else 0.0,
                   predicted_per_second=1e3 * num_generated / predicted_ms if predicted_ms else 0.0)


def progress_of(output: RequestOutput) -> PromptProgress | None:
    """The output's prompt_progress as llama-server sends it (None: it carries none)."""
    progress = output.prompt_progress
    if progress is None:
        return None
    return PromptProgress(total=progress.total, cache=progress.cache, processed=progress.processed,
                          time_ms=progress.time_ms)


def error_event(error: BaseException) -> str:
    if isinstance(error, APIError):
        info = ErrorInfo(message=error.message, type=error.type, param=error.param, code=error.code)
    elif isinstance(error, EngineDeadError):
        info = ErrorInfo(message=str(error), type="server_error", code="engine_dead")
    elif isinstance(error, ValueError):
        info = ErrorInfo(message=str(error), type="invalid_request_error")
    else:
        info = ErrorInfo(message=f"internal error: {error!r}", type="server_error")
    return sse_event(ErrorResponse(error=info).model_dump())


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class ChoiceState:
    """What one streamed choice has sent so far."""

    __slots__ = ("offset", "finished", "started", "tools")

    def __init__(self) -> None:
        self.offset = 0  # text offset of the next logprob token
        self.finished = False
        self.started = False
        self.tools: Any = None  # chat with tools: its ToolCallStream (tool_calls.py)

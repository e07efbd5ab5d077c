"""/v1/chat/completions: a conversation rendered by the chat template -> n assistant replies,
whole or streamed (a role chunk first, then content and tool-call deltas). Tools and tool_choice are
handled by ``tool_calls.py``; response_format / structured_outputs by the shared base. Usage counts the prompt
tokens the prefix cache served (``prompt_tokens_details.cached_tokens``); llama-server's ``timings`` come with the
response (the last chunk of a stream, every chunk with ``timings_per_token``), and a stream with
``return_progress`` gets ``prompt_progress`` chunks while a long prompt is prefilled."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvloom.engine.engine_client import EngineDeadError
from kvloom.engine.input_processor import TokenizedPrompt
from kvloom.entrypoints.openai.chat_media import multimodal_chat_prompt
from kvloom.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    TopLogprob,
)
from kvloom.entrypoints.openai.serving_engine import (
    MIN_LOGPROB,
    APIError,
    ChoiceState,
    OpenAIServing,
    error_event,
    event_stream,
    last_output,
    progress_of,
    run_until_disconnected,
    sse_event,
    timings_of,
    usage_info,
)
from kvloom.entrypoints.openai.tool_calls import (
    ParsedToolCall,
    ToolCallStream,
    ToolError,
    check_tools,
    forced_tool_calls,
    forced_tool_constraint,
    get_tool_parser,
    resolve_tool_choice,
)
from kvloom.multimodal.chat import has_image_parts
from kvloom.outputs import CompletionOutput, Logprob, RequestOutput
from kvloom.reasoning import Phase, ReasoningStream, get_reasoning_parser


@dataclass
class ChatRun:
    """A chat request started on the engine: what its response or stream is built from."""

    request: ChatCompletionRequest
    request_id: str
    created: int
    model: str
    num_prompt_tokens: int
    generator: AsyncIterator[RequestOutput]
    tool_choice: str  # "none", "auto", "required" or "function:NAME" (resolve_tool_choice)
    reasoning_phase: Phase | None = None  # with --reasoning-parser: where the reply starts (reasoning/parsers.py)
    # Set as the engine's outputs arrive: the prompt tokens the prefix cache served, and the last output with
    # metrics (what timings are computed from). None until the first output.
    num_cached_tokens: int | None = None
    latest: RequestOutput | None = None


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args: Any, enable_auto_tools: bool = False, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, **kwargs: Any) -> None:
        """``enable_auto_tools`` / ``tool_parser``: --enable-auto-tool-choice and --tool-call-parser;
        ``reasoning_parser``: --reasoning-parser."""
        super().__init__(*args, **kwargs)
        self.enable_auto_tools = enable_auto_tools
        self.tool_parser = get_tool_parser(tool_parser) if tool_parser is not None else None
        self.reasoning_parser = (get_reasoning_parser(reasoning_parser, self.tokenizer)
                                 if reasoning_parser is not None else None)

    def _tool_choice(self, request: ChatCompletionRequest) -> tuple[str, dict[str, dict[str, Any]]]:
        try:
            functions = check_tools(request.tools)
            choice = resolve_tool_choice(request.tool_choice, functions,
                                         self.enable_auto_tools and self.tool_parser is not None)
        except ToolError as e:
            raise APIError(str(e), param=e.param) from None
        return choice, functions

    async def start_chat(self, request: ChatCompletionRequest) -> ChatRun:
        """Validate a chat request, render and tokenize its conversation, and start it on the engine: the one
        path every API dialect (Chat Completions, Responses, Anthropic Messages) takes into the engine."""
        self.check_model(request.model)
        self.check_engine()
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
        self.check_limits(request.n, request.top_logprobs, "top_logprobs")
        self.check_prompt_logprobs(request)
        tool_choice, functions = self._tool_choice(request)
        constraint, constraint_param = self.structured_outputs_of(request)
        forced = forced_tool_constraint(tool_choice, functions, request.parallel_tool_calls)
        if forced is not None:
            if constraint is not None:
                raise APIError(f"tool_choice {request.tool_choice!r} forces a tool call; it cannot be combined "
                               f"with {constraint_param}", param=constraint_param)
            constraint, constraint_param = forced, "tool_choice"
        if constraint is not None:
            await self.check_structured_outputs(constraint, constraint_param)
        prompt = await self.chat_prompt(request)
        if request.max_completion_tokens is not None:
            max_tokens, param = request.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = request.max_tokens, "max_tokens"
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, self.max_tokens(len(prompt.token_ids), max_tokens), logprobs,
                                      request.prompt_logprobs,
                                      names={"max_tokens": param, "logprobs": "top_logprobs"},
                                      structured_outputs=constraint)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        engine_request = self.engine_request(request_id, prompt, params, "messages",
                                             param if max_tokens is not None else None, model=request.model,
                                             return_progress=request.stream and request.return_progress)
        reasoning_phase = None
        thinking = (request.chat_template_kwargs or {}).get("enable_thinking", True) is not False
        if not thinking:  # the grammar's reasoning gate (structured_output/reasoning.py) opens at once too
            engine_request = dataclasses.replace(engine_request, enable_thinking=False)
        if self.reasoning_parser is not None:
            reasoning_phase = self.reasoning_parser.start_phase(prompt.token_ids, thinking)
        return ChatRun(request=request, request_id=request_id, created=int(time.time()),
                       model=request.model or self.model_name, num_prompt_tokens=len(prompt.token_ids),
                       generator=self.engine.generate(engine_request), tool_choice=tool_choice,
                       reasoning_phase=reasoning_phase)

    async def chat_prompt(self, request: ChatCompletionRequest) -> TokenizedPrompt:
        """The conversation rendered by the chat template (with its tools) and tokenized: what ``start_chat``
        runs, and what the Messages API's count_tokens counts."""
        if has_image_parts(request.messages):  # images: loaded and preprocessed off the event loop
            return await multimodal_chat_prompt(self, request.messages, request.add_generation_prompt,
                                                request.chat_template_kwargs, request.tools or None)
        prompt_text = await self.render_chat_checked(request.messages, request.add_generation_prompt,
                                                     request.chat_template_kwargs, request.tools or None)
        # The template already wrote any BOS it wants.
        return await self.tokenize_prompt(prompt_text, add_special_tokens=False, prompt_name="messages")

    async def chat_response(self, run: ChatRun) -> ChatCompletionResponse:
        """A started chat run, whole."""
        output = await last_output(run.generator)
        run.num_cached_tokens, run.latest = output.num_cached_tokens, output
        return self._response(run.request, run.request_id, run.created, run.model, output, run.tool_choice,
                              run.reasoning_phase)

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        run = await self.start_chat(request)
        if request.stream:
            return event_stream(self._stream(run))

        async def collect() -> Response:
            return JSONResponse((await self.chat_response(run)).model_dump())

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
                top_logprobs.append(TopLogprob(token=top_token, logprob=max(lp.logprob, MIN_LOGPROB),
                                               bytes=list(top_token.encode("utf-8"))))
            content.append(ChatCompletionLogProb(
                token=token, logprob=max(chosen.logprob, MIN_LOGPROB) if chosen else MIN_LOGPROB,
                bytes=list(token.encode("utf-8")), top_logprobs=top_logprobs))
        return ChatCompletionLogProbs(content=content)

    def _message(self, text: str, finish_reason: str | None, tool_choice: str,
                 reasoning_phase: Phase | None = None) -> tuple[ChatMessage, str | None]:
        """The assistant message of a whole completion, its reasoning and tool calls read out (tool calls from the
        content after the reasoning), and its finish reason."""
        calls: list[ParsedToolCall] = []
        reasoning = None
        content: str | None = text
        if reasoning_phase is not None:
            reasoning, content = self.reasoning_parser.extract(text, reasoning_phase)
            text = content or ""
        if tool_choice == "required" or tool_choice.startswith("function:"):
            calls = forced_tool_calls(tool_choice, text)
            content = None  # the forced output is the calls' JSON, never content (also when cut by max_tokens)
        elif tool_choice == "auto" and content is not None:
            content, calls = self.tool_parser.extract(text)
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        tool_calls = [ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
                      for call in calls]
        return ChatMessage(role="assistant", content=content, reasoning_content=reasoning,
                           tool_calls=tool_calls), finish_reason

    def _response(self, request: ChatCompletionRequest, request_id: str, created: int, model: str,
                  output: RequestOutput, tool_choice: str = "none",
                  reasoning_phase: Phase | None = None) -> ChatCompletionResponse:
        choices = []
        for completion in output.outputs:
            logprobs = None
            if request.logprobs:
                logprobs = self._logprobs(completion.token_ids, completion.logprobs or [],
                                          request.top_logprobs or 0)
            message, finish_reason = self._message(completion.text, completion.finish_reason, tool_choice,
                                                   reasoning_phase)
            if not request.parallel_tool_calls:  # 'auto' keeps the first call (the grammar bounds forced ones)
                message.tool_calls = message.tool_calls[:1]
            choices.append(ChatCompletionResponseChoice(
                index=completion.index, message=message,
                logprobs=logprobs, finish_reason=finish_reason,
                stop_reason=completion.stop_reason))
        num_generated = sum(len(c.token_ids) for c in output.outputs)
        return ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                      usage=usage_info(len(output.prompt_token_ids), num_generated,
                                                       output.num_cached_tokens),
                                      prompt_logprobs=self.prompt_logprobs_field(output),
                                      timings=timings_of([output], num_generated))

    async def chat_chunks(self, run: ChatRun) -> AsyncIterator[ChatCompletionStreamResponse]:
        """A started chat run as Chat Completions stream chunks: a role chunk per choice, then content and
        tool-call deltas, and a usage chunk where ``stream_options.include_usage`` asks. Errors are raised
        (``APIError``, ``EngineDeadError``, ``ValueError``), for each dialect to send in its own shape."""
        request = run.request
        states = [ChoiceState() for _ in range(request.n)]
        for state in states:
            state.tools = None if run.tool_choice == "none" else ToolCallStream(
                self.tool_parser if run.tool_choice == "auto" else None,
                None if run.tool_choice == "auto" else run.tool_choice,
                max_calls=None if request.parallel_tool_calls else 1)
        reasoning = [None if run.reasoning_phase is None else self.reasoning_parser.stream(run.reasoning_phase)
                     for _ in states]

        def chunk(choice: ChatCompletionResponseStreamChoice) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(id=run.request_id, created=run.created, model=run.model,
                                                choices=[choice])

        for index in range(request.n):
            yield chunk(ChatCompletionResponseStreamChoice(
                index=index, delta=DeltaMessage(role="assistant", content=""), logprobs=None,
                finish_reason=None))
        num_generated = 0
        saw_output = False
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        async with aclosing(run.generator) as outputs:
            async for output in outputs:
                saw_output = True
                run.num_cached_tokens = output.num_cached_tokens
                if output.metrics is not None:
                    run.latest = output
                chunks = []
                progress = progress_of(output) if request.return_progress else None
                if progress is not None:  # llama-server's progress chunk: an assistant delta with no content
                    chunks.append(ChatCompletionStreamResponse(
                        id=run.request_id, created=run.created, model=run.model, prompt_progress=progress,
                        choices=[ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(role="assistant"))]))
                for completion in output.outputs:
                    state = states[completion.index]
                    if state.finished:
                        continue
                    num_generated += len(completion.token_ids)
                    choice = self._delta_choice(request, completion, state, reasoning[completion.index])
                    if choice is not None:
                        chunks.append(chunk(choice))
                last = output.finished and not include_usage  # llama-server: timings on the last chunk
                if request.timings_per_token or last:
                    if last and not chunks:
                        chunks.append(ChatCompletionStreamResponse(id=run.request_id, created=run.created,
                                                                   model=run.model, choices=[]))
                    if chunks:
                        chunks[-1].timings = timings_of([run.latest], num_generated)
                for item in chunks:
                    yield item
        if include_usage and saw_output:
            yield ChatCompletionStreamResponse(
                id=run.request_id, created=run.created, model=run.model, choices=[],
                usage=usage_info(run.num_prompt_tokens, num_generated, run.num_cached_tokens or 0),
                timings=timings_of([run.latest], num_generated))

    async def _stream(self, run: ChatRun) -> AsyncIterator[str]:
        try:
            async with aclosing(self.chat_chunks(run)) as chunks:
                async for chunk in chunks:
                    yield sse_event(chunk)
        except (APIError, EngineDeadError, ValueError) as e:
            yield error_event(e)
        yield "data: [DONE]\n\n"

    def _delta_choice(self, request: ChatCompletionRequest, completion: CompletionOutput, state: ChoiceState,
                      reasoning: ReasoningStream | None = None) -> ChatCompletionResponseStreamChoice | None:
        """One chunk of a choice from one delta output (None when it adds nothing); ``reasoning``: the choice's
        reasoning stream, which takes the text first (the tool calls are read from the content after it)."""
        text = completion.text
        logprobs = None
        if request.logprobs and completion.token_ids:
            logprobs = self._logprobs(completion.token_ids, completion.logprobs or [], request.top_logprobs or 0)
        finish_reason = completion.finish_reason
        state.finished = finish_reason is not None
        reasoning_text = ""
        if reasoning is not None:
            reasoning_text, text = reasoning.feed(text, state.finished)
        tool_deltas = None
        tools: ToolCallStream | None = state.tools
        if tools is not None:
            text, deltas = tools.feed(text, state.finished)
            if deltas:
                tool_deltas = [DeltaToolCall(**delta.to_dict()) for delta in deltas]
            if tools.calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        if not text and not reasoning_text and logprobs is None and finish_reason is None and not tool_deltas:
            return None
        delta = DeltaMessage(content=text or None, reasoning_content=reasoning_text or None)
        delta.tool_calls = tool_deltas
        choice = ChatCompletionResponseStreamChoice(
            index=completion.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        if finish_reason is not None:
            choice.stop_reason = completion.stop_reason
        return choice


"""/v1/chat/completions: a conversation rendered by the chat template -> n assistant replies,
whole or streamed (a role chunk first, then content deltas)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvloom.engine.engine_client import EngineDeadError
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
    run_until_disconnected,
    sse_event,
    usage_info,
)
from kvloom.outputs import CompletionOutput, Logprob, RequestOutput


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
            return event_stream(self._stream(request, request_id, created, model,
                                              len(prompt.token_ids), generator))

        async def collect() -> Response:
            output = await last_output(generator)
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
                top_logprobs.append(TopLogprob(token=top_token, logprob=max(lp.logprob, MIN_LOGPROB),
                                               bytes=list(top_token.encode("utf-8"))))
            content.append(ChatCompletionLogProb(
                token=token, logprob=max(chosen.logprob, MIN_LOGPROB) if chosen else MIN_LOGPROB,
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
                                      usage=usage_info(len(output.prompt_token_ids), num_generated))

    async def _stream(self, request: ChatCompletionRequest, request_id: str, created: int, model: str,
                      num_prompt_tokens: int, generator: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        states = [ChoiceState() for _ in range(request.n)]

        def chunk(choice: ChatCompletionResponseStreamChoice) -> str:
            return sse_event(ChatCompletionStreamResponse(id=request_id, created=created, model=model,
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
                yield sse_event(ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[],
                    usage=usage_info(num_prompt_tokens, num_generated)))
        except (APIError, EngineDeadError, ValueError) as e:
            yield error_event(e)
        yield "data: [DONE]\n\n"

    def _delta_choice(self, request: ChatCompletionRequest, completion: CompletionOutput,
                      state: ChoiceState) -> ChatCompletionResponseStreamChoice | None:
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


"""/v1/completions: one or several prompts (text or token ids) -> n completions each, whole or
streamed; ``echo`` prepends the prompt (with its logprobs when asked). ``echo`` with ``max_tokens=0`` returns
only the prompt and its logprobs (what lm-evaluation-harness sends for log-likelihoods): as vLLM, one token
is generated and dropped. vLLM's ``prompt_logprobs`` come back on each choice. A ``suffix`` makes each prompt the
prefix of a fill-in-the-middle prompt (prefix-suffix-middle, built as llama-server builds ``/infill``'s: fim.py);
a model without FIM tokens refuses it. ``usage.prompt_tokens_details.cached_tokens`` counts the prompt tokens the
prefix cache served; llama-server's ``timings`` come with the response (the last chunk of a stream, every chunk
with ``timings_per_token``), and a stream with ``return_progress`` gets ``prompt_progress`` chunks as a long prompt
is prefilled."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvloom.engine.engine_client import EngineDeadError
from kvloom.engine.input_processor import TokenizedPrompt
from kvloom.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
)
from kvloom.entrypoints.openai.serving_engine import (
    MIN_LOGPROB,
    APIError,
    ChoiceState,
    OpenAIServing,
    error_event,
    event_stream,
    last_output,
    merge_async_iterators,
    progress_of,
    run_until_disconnected,
    sse_event,
    timings_of,
    usage_info,
)
from kvloom.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        self.check_engine()
        if request.suffix and request.echo:
            raise APIError("echo cannot be combined with suffix (a fill-in-the-middle prompt is not the text sent)",
                           param="echo")
        if request.best_of is not None and request.best_of != request.n:
            raise APIError(f"best_of must equal n ({request.n}) when given; kvloom does not rank "
                           f"extra completions", param="best_of")
        self.check_limits(request.n, request.logprobs, "logprobs")
        self.check_prompt_logprobs(request)
        if request.max_tokens == 0 and not request.echo:
            raise APIError("max_tokens must be at least 1 (0 only with echo, to score the prompt)",
                           param="max_tokens")
        constraint, constraint_param = self.structured_outputs_of(request)
        if constraint is not None:
            await self.check_structured_outputs(constraint, constraint_param)
        prompts = await self._prompts(request)
        logprobs = request.logprobs
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None and request.echo and logprobs is not None:
            prompt_logprobs = logprobs
        request_id = f"cmpl-{uuid.uuid4().hex}"
        max_tokens_param = "max_tokens" if request.max_tokens is not None else None
        requests = []
        for i, prompt in enumerate(prompts):
            max_tokens = 1 if _echo_only(request) else self.max_tokens(len(prompt.token_ids), request.max_tokens)
            params = self.sampling_params(request, max_tokens, logprobs, prompt_logprobs,
                                          structured_outputs=constraint)
            requests.append(self.engine_request(f"{request_id}-{i}", prompt, params, "prompt", max_tokens_param,
                                                model=request.model,
                                                return_progress=request.stream and request.return_progress))
        echo_texts = None
        if request.echo:
            echo_texts = [p.text if p.text is not None
                          else self.tokenizer.decode(list(p.token_ids), skip_special_tokens=False)
                          for p in prompts]

        created = int(time.time())
        model = request.model or self.model_name
        generators = [self.engine.generate(r) for r in requests]
        if request.stream:
            return event_stream(self._stream(request, request_id, created, model, prompts, echo_texts,
                                              generators))

        async def collect() -> Response:
            outputs = await asyncio.gather(*[last_output(g) for g in generators])
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
        if request.suffix:
            fim = self.fim_tokens("suffix")
            # llama.cpp also ends generation at the FIM padding / repository / file-separator tokens.
            request.stop_token_ids = [*(request.stop_token_ids or []), *fim.end_of_generation_ids]
            return [await self.infill_prompt(fim, item, request.suffix, [], []) for item in items]
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
                result.token_logprobs.append(max(chosen.logprob, MIN_LOGPROB) if chosen else None)
                result.top_logprobs.append({self.decoded(t, lp): max(lp.logprob, MIN_LOGPROB)
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
        if _echo_only(request):
            token_ids, entries = [], []
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
            prompt_logprobs = self.prompt_logprobs_field(output) if request.prompt_logprobs is not None else None
            for completion in output.outputs:
                generated = "" if _echo_only(request) else completion.text
                text = echo_texts[prompt_index] + generated if echo_texts else generated
                choices.append(CompletionResponseChoice(
                    index=prompt_index * request.n + completion.index, text=text,
                    logprobs=self._choice_logprobs(request, output, completion),
                    finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                    prompt_logprobs=prompt_logprobs))
                if not _echo_only(request):
                    num_generated += len(completion.token_ids)
        num_prompt = sum(len(p.token_ids) for p in prompts)
        num_cached = sum(output.num_cached_tokens for output in outputs)
        return CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                  usage=usage_info(num_prompt, num_generated, num_cached),
                                  timings=timings_of(outputs, num_generated))

    async def _stream(self, request: CompletionRequest, request_id: str, created: int, model: str,
                      prompts: list[TokenizedPrompt], echo_texts: list[str] | None,
                      generators: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
        n = request.n
        states = [ChoiceState() for _ in range(len(prompts) * n)]
        # A delta stream carries the prompt's logprobs once; every choice of the prompt echoes them.
        prompt_logprobs: list[Any] = [None] * len(prompts)
        latest: list[RequestOutput | None] = [None] * len(prompts)  # each prompt's last output with metrics
        num_generated = 0
        num_unfinished = len(prompts)
        include_usage = request.stream_options is not None and request.stream_options.include_usage

        def chunk(choices: list[CompletionResponseChoice], **fields: Any) -> CompletionStreamResponse:
            return CompletionStreamResponse(id=request_id, created=created, model=model, choices=choices, **fields)

        try:
            async with aclosing(merge_async_iterators(generators)) as merged:
                async for prompt_index, output in merged:
                    if output.metrics is not None:
                        latest[prompt_index] = output
                    if output.prompt_logprobs is not None:
                        prompt_logprobs[prompt_index] = output.prompt_logprobs
                    chunks = []
                    progress = progress_of(output) if request.return_progress else None
                    if progress is not None:
                        chunks.append(chunk([CompletionResponseChoice(index=prompt_index * n, text="")],
                                            prompt_progress=progress))
                    for completion in output.outputs:
                        index = prompt_index * n + completion.index
                        state = states[index]
                        if state.finished:
                            continue
                        if not _echo_only(request):
                            num_generated += len(completion.token_ids)
                        choice = self._delta_choice(request, prompts[prompt_index],
                                                    echo_texts[prompt_index] if echo_texts else None,
                                                    prompt_logprobs[prompt_index], completion, state, index)
                        if choice is not None:
                            chunks.append(chunk([choice]))
                    num_unfinished -= output.finished
                    last = num_unfinished == 0 and not include_usage  # llama-server: timings on the last chunk
                    if request.timings_per_token or last:
                        if last and not chunks:
                            chunks.append(chunk([]))
                        if chunks:
                            chunks[-1].timings = timings_of(latest, num_generated)
                    for event in chunks:
                        yield sse_event(event)
            if include_usage:
                num_prompt = sum(len(p.token_ids) for p in prompts)
                num_cached = sum(o.num_cached_tokens for o in latest if o is not None)
                yield sse_event(chunk([], usage=usage_info(num_prompt, num_generated, num_cached),
                                      timings=timings_of(latest, num_generated)))
        except (APIError, EngineDeadError, ValueError) as e:
            yield error_event(e)
        yield "data: [DONE]\n\n"

    def _delta_choice(self, request: CompletionRequest, prompt: TokenizedPrompt, echo_text: str | None,
                      prompt_logprobs: Any, completion: CompletionOutput, state: ChoiceState,
                      index: int) -> CompletionResponseChoice | None:
        """One chunk of a choice from one delta output (None when it adds nothing)."""
        text = "" if _echo_only(request) else completion.text
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
        if request.logprobs is not None and completion.token_ids and not _echo_only(request):
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


def _echo_only(request: CompletionRequest) -> bool:
    """echo with max_tokens=0: the prompt (and its logprobs) is the whole answer."""
    return request.echo and request.max_tokens == 0

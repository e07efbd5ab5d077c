"""llama-server's ``POST /infill``: code completion between a prefix and a suffix (fill-in-the-middle).

The body is llama-server's: ``input_prefix``, ``input_suffix`` (strings, or lists of strings and token ids),
``input_extra`` (other files, ``[{"filename", "text"}]``), ``prompt`` (text already typed after the prefix),
``n_predict`` (or ``max_tokens``; -1 or absent: up to the context), ``stream``, and the usual sampling fields
(``repeat_penalty`` is ``repetition_penalty``). The prompt is built as llama-server builds it (``fim.py``); a
model without FIM tokens is refused with a 400. The answer is llama-server's own (not OpenAI's) completion
object: ``content``, ``tokens``, ``stop``, ``stop_type`` (``eos``, ``word``, ``limit``), ``stopping_word``,
``tokens_predicted``, ``tokens_evaluated``, ``tokens_cached``, ``timings``; a stream sends one such object per
delta (``stop`` false) and a last one with ``stop`` true and the timings, with no ``[DONE]``.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvloom.engine.engine_client import EngineDeadError
from kvloom.engine.input_processor import TokenizedPrompt
from kvloom.entrypoints.openai.fim import check_input_extra
from kvloom.entrypoints.openai.protocol import InfillRequest
from kvloom.entrypoints.openai.serving_engine import (
    APIError,
    OpenAIServing,
    error_event,
    event_stream,
    last_output,
    progress_of,
    run_until_disconnected,
    sse_event,
    timings_of,
)
from kvloom.outputs import CompletionOutput, RequestOutput


class OpenAIServingInfill(OpenAIServing):
    async def create_infill(self, request: InfillRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        self.check_engine()
        fim = self.fim_tokens("input_prefix")
        if request.n != 1:
            raise APIError(f"n must be 1 for /infill (one completion of the gap), got {request.n}", param="n")
        try:
            extra = check_input_extra(request.input_extra)
        except ValueError as e:
            raise APIError(str(e), param="input_extra") from None
        # llama-server tokenizes prompt with special tokens parsed and none added.
        prompt_tokens = list((await self.tokenize_prompt(request.prompt, False, "prompt")).token_ids) \
            if request.prompt else []
        prompt = await self.infill_prompt(fim, request.input_prefix, request.input_suffix, extra, prompt_tokens)
        if request.n_predict is not None and request.n_predict >= 0:
            max_tokens, param = request.n_predict, "n_predict"
        else:
            max_tokens, param = request.max_tokens, "max_tokens"
        if max_tokens == 0:
            raise APIError(f"{param} must be at least 1 (or -1 for no limit but the context)", param=param)
        if request.repeat_penalty is not None:
            request.repetition_penalty = request.repeat_penalty
        # llama.cpp also ends generation at the FIM padding / repository / file-separator tokens.
        request.stop_token_ids = [*(request.stop_token_ids or []), *fim.end_of_generation_ids]
        params = self.sampling_params(request, self.max_tokens(len(prompt.token_ids), max_tokens), None,
                                      names={"max_tokens": param, "repetition_penalty": "repeat_penalty"})
        engine_request = self.engine_request(f"infill-{uuid.uuid4().hex}", prompt, params, "input_prefix",
                                             param if max_tokens is not None else None, model=request.model,
                                             return_progress=request.stream and request.return_progress)
        generator = self.engine.generate(engine_request)
        model = request.model or self.model_name
        if request.stream:
            return event_stream(self._stream(request, prompt, model, generator))

        async def collect() -> Response:
            output = await last_output(generator)
            completion = output.outputs[0]
            return JSONResponse(self._final(prompt, model, output, completion.text, list(completion.token_ids)))

        return await run_until_disconnected(collect(), raw_request)

    def _final(self, prompt: TokenizedPrompt, model: str, output: RequestOutput, text: str, tokens: list[int],
               num_generated: int | None = None, has_new_line: bool | None = None) -> dict[str, Any]:
        """llama-server's final completion object (``stop`` true)."""
        completion = output.outputs[0] if output.outputs else None
        stop_type, stopping_word = _stop_type(completion)
        generated = len(tokens) if num_generated is None else num_generated
        return {"index": 0, "content": text, "tokens": tokens, "id_slot": 0, "stop": True, "model": model,
                "tokens_predicted": generated, "tokens_evaluated": len(prompt.token_ids),
                "prompt": self.tokenizer.decode(list(prompt.token_ids), skip_special_tokens=False),
                "has_new_line": "\n" in text if has_new_line is None else has_new_line, "truncated": False,
                "stop_type": stop_type, "stopping_word": stopping_word,
                "tokens_cached": len(prompt.token_ids) + generated,
                "timings": timings_of([output], generated).model_dump()}

    async def _stream(self, request: InfillRequest, prompt: TokenizedPrompt, model: str,
                      generator: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        num_generated = 0
        has_new_line = False
        latest: RequestOutput | None = None
        try:
            async with aclosing(generator) as outputs:
                async for output in outputs:
                    if output.metrics is not None:
                        latest = output
                    progress = progress_of(output) if request.return_progress else None
                    if progress is not None:
                        yield sse_event(self._partial(prompt, "", [], num_generated, None, progress.model_dump()))
                    if not output.outputs:
                        continue
                    completion = output.outputs[0]
                    num_generated += len(completion.token_ids)
                    has_new_line = has_new_line or "\n" in completion.text
                    if completion.text or completion.token_ids:
                        timings = timings_of([latest], num_generated).model_dump() if request.timings_per_token \
                            else None
                        yield sse_event(self._partial(prompt, completion.text, list(completion.token_ids),
                                                   num_generated, timings, None))
                    if output.finished:
                        yield sse_event(self._final(prompt, model, latest or output, "", [], num_generated,
                                                 has_new_line))
        except (APIError, EngineDeadError, ValueError) as e:
            yield error_event(e)

    @staticmethod
    def _partial(prompt: TokenizedPrompt, text: str, tokens: list[int], num_generated: int,
                 timings: dict[str, Any] | None, progress: dict[str, Any] | None) -> dict[str, Any]:
        """llama-server's streamed completion object (``stop`` false)."""
        body: dict[str, Any] = {"index": 0, "content": text, "tokens": tokens, "stop": False, "id_slot": 0,
                                "tokens_predicted": num_generated, "tokens_evaluated": len(prompt.token_ids)}
        if timings is not None:
            body["timings"] = timings
        if progress is not None:
            body["prompt_progress"] = progress
        return body


def _stop_type(completion: CompletionOutput | None) -> tuple[str, str]:
    """llama-server's stop_type and stopping_word of a finished completion."""
    if completion is None or completion.finish_reason is None or completion.finish_reason == "abort":
        return "none", ""
    if completion.finish_reason == "length":
        return "limit", ""
    if isinstance(completion.stop_reason, str):
        return "word", completion.stop_reason
    return "eos", ""




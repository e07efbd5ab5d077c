"""The engine step's post-processing: each request's new tokens -> text, stop strings, logprobs, outputs.

After the scheduler has appended a step's sampled tokens (and applied the token-level stops: EOS,
stop token ids, ``max_tokens``, ``max_model_len``), ``LLMEngine.step()`` hands each request's new
token ids to ``process_tokens``, which detokenizes them incrementally, looks for stop strings and
converts logprobs; ``make_outputs`` then builds the step's ``RequestOutput`` objects, one per
request (parent of its n completions) that progressed, as the request's ``output_kind`` asks:

- ``DELTA``: what this step added (new text, token ids, logprobs), the way the server streams;
- ``FINAL_ONLY``: one output with the whole completion when the request finishes (``LLM.generate``);
- ``CUMULATIVE``: the whole completion so far at every step (vLLM's default).

Each step costs what its new tokens cost, however long the output already is: stop strings are
searched in the new text and the few characters before it, the text is kept in pieces, and the
whole completion is copied only for CUMULATIVE outputs (which ask for exactly that).

Text that could still become the start of a stop string is held back while a request runs (unless
``include_stop_str_in_output``), so no output ever shows text that a stop string later removes.
"""

from __future__ import annotations

from kvloom.engine.detokenizer import IncrementalDetokenizer
from kvloom.engine.input_processor import EngineRequest
from kvloom.engine.request import Request, RequestStatus
from kvloom.loader.tokenizer import Tokenizer
from kvloom.outputs import CompletionOutput, Logprob, PromptProgress, RequestMetrics, RequestOutput
from kvloom.sampling_params import RequestOutputKind
from kvloom.stats import FinishedRequestStats, IterationStats
from kvloom.step_io import LogprobsRow


def raise_if_failed(output: RequestOutput) -> None:
    """ValueError when the engine ended a completion of ``output`` with an error: its logits held NaN or
    inf, so nothing it sampled could be trusted, or its grammar did not compile. ``LLM`` and ``AsyncLLM``
    both raise it to their caller."""
    for completion in output.outputs:
        # A grammar that failed to compile (or timed out) ends its request with the reason as stop_reason.
        if completion.finish_reason == "error" and isinstance(completion.stop_reason, str):
            raise ValueError(f"request {output.request_id}: {completion.stop_reason}")
    if any(completion.finish_reason == "error" for completion in output.outputs):
        raise ValueError(f"request {output.request_id}: the model produced NaN or infinite logits, so its "
                         f"output would be garbage; check the checkpoint's weights, or run it in float32 or "
                         f"bfloat16 if float16 overflows")


class CompletionState:
    """One completion (child Request) of a request: its text so far, and what its next output adds."""

    def __init__(self, request: Request, index: int, parent: RequestOutputState, tokenizer: Tokenizer) -> None:
        self.request = request
        self.index = index
        self.parent = parent
        params = request.sampling_params
        self.detokenizer = (IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params.skip_special_tokens)
                            if params.detokenize else None)
        # Stop strings: the text's last longest-1 characters (where one could still start) and how
        # many characters to hold back from outputs while running.
        self.longest_stop = max((len(s) for s in params.stop), default=0)
        self.hold = max(self.longest_stop - 1, 0) if not params.include_stop_str_in_output else 0
        self.tail = ""
        self.unsent = ""  # text held back (it could still become a stop string), and this step's
        self.wants_logprobs = params.logprobs is not None
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        # DELTA: what the next output carries. Otherwise: the whole completion so far (the token
        # ids are the request's own).
        self.new_text = ""
        self.new_token_ids: list[int] = []
        self.new_logprobs: list[dict[int, Logprob]] = []
        self.text_pieces: list[str] = []
        self.logprobs: list[dict[int, Logprob]] = []

    @property
    def finish_reason(self) -> str | None:
        status = self.request.status
        return status.value if status.finished else None

    def take_text(self, finishing: bool) -> str:
        """The text an output may show now. While the request runs (and once it is aborted), what
        could still start a stop string waits; ``finishing``: a stop string has just ended it."""
        unsent = self.unsent
        if self.hold and not finishing:
            status = self.request.status
            if not status.finished or status == RequestStatus.FINISHED_ABORTED:
                visible = len(unsent) - self.hold
                if visible <= 0:
                    return ""
                self.unsent = unsent[visible:]
                return unsent[:visible]
        self.unsent = ""
        return unsent


class RequestOutputState:
    """A request as its caller submitted it, one prompt and its n completions: what its RequestOutputs
    are built from (the runner keeps its own per-request sampling state, `worker/model_runner.py`)."""

    def __init__(self, engine_request: EngineRequest, children: list[Request], tokenizer: Tokenizer) -> None:
        self.request_id = engine_request.request_id
        self.prompt = engine_request.prompt
        self.prompt_token_ids = list(engine_request.prompt_token_ids)
        self.output_kind = engine_request.sampling_params.output_kind
        self.deltas = self.output_kind == RequestOutputKind.DELTA
        self.arrival_time = engine_request.arrival_time
        self.completions = [CompletionState(child, i, self, tokenizer) for i, child in enumerate(children)]
        self.changed: list[CompletionState] = []  # DELTA: the completions with news for the next output
        self.a_completion_finished = False
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.sent_prompt_logprobs = False
        self.pooler_output: list[float] | None = None  # an embedding request's vector, once its prompt ran
        self.return_progress = (engine_request.return_progress
                                and self.output_kind != RequestOutputKind.FINAL_ONLY)
        self.progress: PromptProgress | None = None  # not sent yet

    @property
    def finished(self) -> bool:
        return self.a_completion_finished and all(c.request.is_finished for c in self.completions)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestOutputState] = {}
        self._completions: dict[str, CompletionState] = {}  # by child request id
        self._touched: dict[str, RequestOutputState] = {}  # the requests with new tokens since make_outputs
        self._progressed: dict[str, RequestOutputState] = {}  # return_progress: prompts advanced since then
        # The first completions of return_progress requests, by request id: the only ones add_prompt_progress serves.
        self.progress_requests: set[str] = set()
        self._num_new_tokens = 0

    def add_request(self, engine_request: EngineRequest, children: list[Request]) -> None:
        state = RequestOutputState(engine_request, children, self.tokenizer)
        self.request_states[state.request_id] = state
        for completion in state.completions:
            self._completions[completion.request.request_id] = completion
        if state.return_progress:
            self.progress_requests.add(state.completions[0].request.request_id)

    # ---- per request, per step -------------------------------------------------------------
    def add_prompt_logprobs(self, request: Request, num_computed_tokens: int, rows: list[LogprobsRow]) -> None:
        """Logprobs of prompt positions computed this step, which began at ``num_computed_tokens``."""
        completion = self._completions.get(request.request_id)
        if completion is None or completion.prompt_logprobs is None:
            return
        # Row k predicts prompt position num_computed_tokens + 1 + k; after a preemption the same
        # positions are computed again and must not be appended twice.
        start = num_computed_tokens + 1
        have = len(completion.prompt_logprobs)
        rows = rows[have - start:] if have >= start else []
        completion.prompt_logprobs.extend(
            self._logprob_dicts(rows, request.sampling_params.prompt_logprobs or 0))

    def add_prompt_progress(self, request: Request, num_processed: int, now: float) -> None:
        """A prefill chunk of ``request`` ran: ``num_processed`` of its prompt's tokens are in the KV cache. With
        return_progress its next output says so (the first completion's; its siblings share its prompt)."""
        completion = self._completions.get(request.request_id)
        if completion is None or completion.index != 0 or not completion.parent.return_progress:
            return
        state = completion.parent
        start = request.first_scheduled_time if request.first_scheduled_time is not None else now
        state.progress = PromptProgress(total=len(state.prompt_token_ids), cache=max(request.num_cached_tokens, 0),
                                        processed=num_processed, time_ms=int((now - start) * 1000))
        self._progressed[state.request_id] = state

    def add_pooler_output(self, request: Request, vector: list[float]) -> None:
        """An embedding request's pooled vector; its RequestOutput carries it as extra["pooler_output"]."""
        completion = self._completions.get(request.request_id)
        if completion is not None:
            completion.parent.pooler_output = vector

    def process_tokens(self, request: Request, new_token_ids: list[int],
                       new_logprobs: list[LogprobsRow] | None = None) -> bool:
        """Take the tokens the scheduler appended to ``request`` this step (and their logprobs rows).

        Detokenizes them and looks for stop strings; True when a stop string ended the request (the
        engine then finishes it in the scheduler).
        """
        completion = self._completions.get(request.request_id)
        if completion is None or not new_token_ids:
            return False
        state = completion.parent
        self._num_new_tokens += len(new_token_ids)
        if new_logprobs:
            for row in new_logprobs:
                completion.cumulative_logprob += row[1][0]
            if completion.wants_logprobs:
                dicts = self._logprob_dicts(new_logprobs, request.sampling_params.logprobs or 0)
                (completion.new_logprobs if state.deltas else completion.logprobs).extend(dicts)
        stopped = self._update_text(completion, new_token_ids)
        text = completion.take_text(finishing=stopped)
        if state.deltas:
            completion.new_token_ids.extend(new_token_ids)
            completion.new_text += text
            if completion not in state.changed:
                state.changed.append(completion)
        elif text:
            completion.text_pieces.append(text)
        if stopped or request.is_finished:
            state.a_completion_finished = True
        self._touched[state.request_id] = state
        return stopped

    def finish_failed(self, request: Request) -> None:
        """A completion the engine ended with an error (its logits held NaN or inf, so it sampled
        nothing): its request's next output carries finish_reason "error"."""
        completion = self._completions.get(request.request_id)
        if completion is None:
            return
        state = completion.parent
        state.a_completion_finished = True
        if state.deltas and completion not in state.changed:
            state.changed.append(completion)
        self._touched[state.request_id] = state

    def _update_text(self, completion: CompletionState, new_token_ids: list[int]) -> bool:
        """Detokenize the new tokens onto ``completion.unsent``; True if a stop string ended it."""
        detokenizer = completion.detokenizer
        if detokenizer is None:
            return False
        request = completion.request
        params = request.sampling_params
        stopped_by_token = request.status == RequestStatus.FINISHED_STOPPED
        if stopped_by_token and not params.include_stop_str_in_output:
            # The EOS / stop token's text is not part of the output; what came before it is.
            completion.unsent += detokenizer.flush()
            return False
        new_text = detokenizer.step(new_token_ids)
        if request.is_finished:
            # An output that ends inside a multi-byte character still shows its tail (as U+FFFD).
            new_text += detokenizer.flush()
        if not new_text:
            return False
        if not params.stop or stopped_by_token:
            completion.unsent += new_text
            return False
        # A stop string that ends in the new text starts at most longest-1 characters before it.
        window = completion.tail + new_text
        best: tuple[int, str] | None = None
        for stop in params.stop:
            index = window.find(stop)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            completion.unsent += new_text
            keep = completion.longest_stop - 1
            completion.tail = window[max(0, len(window) - keep):] if keep else ""
            return False
        index, stop = best
        end = index + len(stop) if params.include_stop_str_in_output else index
        # The text ends at `end` of the window; what is cut was never shown (it was held back or new).
        unsent = completion.unsent + new_text
        completion.unsent = unsent[:max(0, len(unsent) - (len(window) - end))]
        request.stop_reason = stop
        if request.is_finished:  # it also hit max_tokens this step: the stop string names the end
            request.status = RequestStatus.FINISHED_STOPPED
            return False
        return True

    def make_outputs(self, now: float, stats: IterationStats | None = None) -> list[RequestOutput]:
        """The outputs of the requests that progressed since the last call; forgets finished ones."""
        outputs = []
        for state in self._touched.values():
            if stats is not None:
                if state.first_token_time is None:
                    stats.time_to_first_tokens.append(now - state.arrival_time)
                else:
                    stats.inter_token_latencies.append(now - state.last_token_time)
            if state.first_token_time is None:
                state.first_token_time = now
            state.last_token_time = now
            finished = state.finished
            if finished or state.output_kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(self._make_output(state, finished, now))
            if finished:
                self._forget(state, now, stats)
        for state in self._progressed.values():
            if state.progress is not None and state.request_id in self.request_states:
                # A chunk that sampled nothing: an output with no completions, carrying only the progress.
                outputs.append(RequestOutput(
                    request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
                    prompt_logprobs=None, outputs=[], finished=False,
                    num_cached_tokens=state.progress.cache, prompt_progress=state.progress))
                state.progress = None
        self._progressed.clear()
        if stats is not None:
            stats.num_generation_tokens += self._num_new_tokens
        self._num_new_tokens = 0
        self._touched.clear()
        return outputs

    def abort_requests(self, request_ids: list[str], now: float,
                       stats: IterationStats | None = None) -> list[RequestOutput]:
        """Last outputs of requests the engine has just aborted (their children's status is set)."""
        outputs = []
        for request_id in request_ids:
            state = self.request_states.get(request_id)
            if state is None:
                continue
            self._touched.pop(request_id, None)
            for completion in state.completions:
                if state.deltas and completion.finish_reason == "abort" and completion not in state.changed:
                    state.changed.append(completion)
            outputs.append(self._make_output(state, True, now))
            self._forget(state, now, stats, aborted=True)
        return outputs

    # ---- outputs ---------------------------------------------------------------------------
    def _make_output(self, state: RequestOutputState, finished: bool, now: float) -> RequestOutput:
        if state.deltas:
            state.changed.sort(key=lambda c: c.index)
            completions = [self._take_delta(c) for c in state.changed]
            state.changed.clear()
        else:
            completions = [self._whole(c) for c in state.completions]
        first = state.completions[0]
        prompt_logprobs = self._prompt_logprobs(state)
        if prompt_logprobs is not None:
            if state.deltas and state.sent_prompt_logprobs:
                prompt_logprobs = None  # a delta stream carries them once, in its first output
            else:
                prompt_logprobs = list(prompt_logprobs)
                state.sent_prompt_logprobs = True
        metrics = RequestMetrics(arrival_time=state.arrival_time,
                                 first_scheduled_time=first.request.first_scheduled_time,
                                 first_token_time=state.first_token_time,
                                 last_token_time=state.last_token_time,
                                 finished_time=now if finished else None)
        progress, state.progress = state.progress, None
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids, prompt_logprobs=prompt_logprobs,
                             outputs=completions, finished=finished, metrics=metrics,
                             num_cached_tokens=max(first.request.num_cached_tokens, 0),
                             extra={} if state.pooler_output is None else {"pooler_output": state.pooler_output},
                             prompt_progress=progress)

    def _prompt_logprobs(self, state: RequestOutputState) -> list[dict[int, Logprob] | None] | None:
        """The prompt's logprobs, from the first completion that has them all (each computes them; one
        that has sampled a token has), else the first's so far."""
        first = state.completions[0].prompt_logprobs
        if first is None:
            return None
        num_positions = len(state.prompt_token_ids)
        for completion in state.completions:
            if completion.prompt_logprobs is not None and len(completion.prompt_logprobs) >= num_positions:
                return completion.prompt_logprobs
        return None if state.output_kind == RequestOutputKind.DELTA else first

    def _take_delta(self, completion: CompletionState) -> CompletionOutput:
        """What the completion's next output adds; its new text, tokens and logprobs are handed over."""
        text, completion.new_text = completion.new_text, ""
        token_ids, completion.new_token_ids = completion.new_token_ids, []
        logprobs = None
        if completion.wants_logprobs:
            logprobs, completion.new_logprobs = completion.new_logprobs, []
        return CompletionOutput(
            index=completion.index, text=text, token_ids=token_ids,
            cumulative_logprob=completion.cumulative_logprob if completion.wants_logprobs else None,
            logprobs=logprobs, finish_reason=completion.finish_reason,
            stop_reason=completion.request.stop_reason)

    def _whole(self, completion: CompletionState) -> CompletionOutput:
        text = "".join(completion.text_pieces)
        completion.text_pieces = [text] if text else []
        return CompletionOutput(
            index=completion.index, text=text, token_ids=list(completion.request.output_token_ids),
            cumulative_logprob=completion.cumulative_logprob if completion.wants_logprobs else None,
            logprobs=list(completion.logprobs) if completion.wants_logprobs else None,
            finish_reason=completion.finish_reason, stop_reason=completion.request.stop_reason)

    def _forget(self, state: RequestOutputState, now: float, stats: IterationStats | None,
                aborted: bool = False) -> None:
        del self.request_states[state.request_id]
        for completion in state.completions:
            self._completions.pop(completion.request.request_id, None)
        self.progress_requests.discard(state.completions[0].request.request_id)
        if stats is None:
            return
        first = state.completions[0].request
        reasons = ["abort"] if aborted else sorted({c.finish_reason or "stop" for c in state.completions})
        stats.finished_requests.append(FinishedRequestStats(
            request_id=state.request_id, finish_reasons=reasons, arrival_time=state.arrival_time,
            first_scheduled_time=first.first_scheduled_time, first_token_time=state.first_token_time,
            finished_time=now, num_prompt_tokens=len(state.prompt_token_ids),
            num_cached_tokens=max(first.num_cached_tokens, 0),
            num_generation_tokens=sum(c.request.num_output_tokens for c in state.completions)))

    def _logprob_dicts(self, rows: list[LogprobsRow], num: int) -> list[dict[int, Logprob]]:
        """Runner rows -> vLLM's {token id: Logprob} per position: the chosen token, then the top ``num``."""
        decode = self.tokenizer.decode
        result = []
        for ids, values, rank in rows:
            entry: dict[int, Logprob] = {ids[0]: Logprob(values[0], rank, decode([ids[0]], skip_special_tokens=False))}
            for position, (token_id, value) in enumerate(zip(ids[1:num + 1], values[1:num + 1])):
                if token_id not in entry:
                    entry[token_id] = Logprob(value, position + 1, decode([token_id], skip_special_tokens=False))
            result.append(entry)
        return result

"""LLMEngine: the synchronous core. Each step() is three verbs: schedule, run, postprocess.

Requests come in as EngineRequests (``input_processor.py``: tokenized and validated once). A request
with n > 1 is split into n child Requests that share the prompt's cached blocks. A request that waits for
its grammar, its LoRA adapter or its first sibling's prompt waits in the ``WaitingRoom``
(``waiting_room.py``) until the scheduler may see it. After the runner has sampled, the scheduler appends
the tokens and applies the token-level stops, and the OutputProcessor (``output_processor.py``) turns each
request's new tokens into text, stop strings, logprobs and vLLM's RequestOutputs (deltas, the final output,
or the whole output at every step).

A step takes one of three paths, by how the device work and the host's work meet:

    synchronous   schedule -> run -> update -> postprocess
    overlapped    schedule -> launch -> postprocess the step before -> read back -> update   (CUDA)
    async         schedule -> launch -> read back the step before -> update it -> postprocess it
                  (``async_scheduling``: the scheduler runs ahead of the device by one step)
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from kvloom.config import EngineConfig, resolve_config
from kvloom.engine.input_processor import EngineRequest, InputProcessor, PromptInput
from kvloom.engine.kv_cache_manager import KVCacheManager
from kvloom.engine.output_processor import IterationStats, OutputProcessor
from kvloom.engine.request import Request, RequestStatus
from kvloom.engine.scheduler import Scheduler
from kvloom.engine.waiting_room import Polled, Wait, WaitingRoom
from kvloom.executor import build_executor
from kvloom.loader.tokenizer import Tokenizer, load_tokenizer
from kvloom.loader.weights import resolve_model
from kvloom.lora.peft import model_shape
from kvloom.lora.registry import LoRAChecker
from kvloom.multimodal.processor import multimodal_processor
from kvloom.outputs import RequestOutput
from kvloom.platform import configure_host
from kvloom.sampling_params import SamplingParams
from kvloom.step_io import ModelRunnerOutput, SchedulerOutput
from kvloom.structured_output import StructuredOutputManager

logger = logging.getLogger("kvloom")


class InFlight(NamedTuple):
    """Async scheduling: the step launched and not yet read back."""

    scheduler_output: SchedulerOutput
    result: Callable[[], ModelRunnerOutput]  # waits for the step and reads its output back
    requests: list[Request]
    needs_tokens: bool  # a request in it needs that step's token before its next one


class LLMEngine:
    def __init__(self, config: EngineConfig, log_stats: bool = False) -> None:
        """``log_stats``: record IterationStats (token counts, latencies) for ``take_iteration_stats``."""
        start = time.perf_counter()
        if config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size={config.data_parallel_size}: replicas run behind the server "
                             f"(kvloom serve --data-parallel-size N); LLM and LLMEngine run one engine")
        self.config = config
        self.resolved = resolved = resolve_config(config)
        self.source = resolved.source
        self.model_config = resolved.model
        tokenizer_source = resolve_model(config.tokenizer) if config.tokenizer else self.source
        self.tokenizer: Tokenizer = load_tokenizer(tokenizer_source)
        self.device = resolved.device
        configure_host(config, self.device)
        self.dtype = resolved.dtype
        self.max_model_len = resolved.max_model_len
        self.block_size = resolved.block_size
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_ids)

        self.executor = build_executor(resolved)
        num_blocks = self.executor.determine_num_kv_blocks()
        self.executor.init_kv_cache(num_blocks)
        speculative = config.speculative
        self.kv_cache_manager = KVCacheManager(num_blocks, self.block_size, config.enable_prefix_caching,
                                               name_with_next_token=speculative is not None
                                               and speculative.method in ("eagle", "eagle3"))
        self.max_num_batched_tokens = resolved.max_num_batched_tokens
        # The runner proposes every draft; the scheduler carries them and reserves their slots.
        self.scheduler = Scheduler(
            self.kv_cache_manager, config.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
            num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0,
            num_lookahead_tokens=speculative.num_speculative_tokens if speculative and speculative.uses_draft_model
            else 0, speculative_max_model_len=speculative.max_model_len if speculative else None,
            max_loras=config.max_loras if config.enable_lora else 0, async_scheduling=resolved.async_scheduling)
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids),
            config.structured_outputs.backend, config.structured_outputs.compile_timeout,
            config.structured_outputs.disable_any_whitespace, config.reasoning_parser)
        # Requests waiting for their grammar, their LoRA adapter or (n > 1) their first sibling's prompt.
        self.waiting_room = WaitingRoom()
        self.input_processor = InputProcessor(self.tokenizer, self.model_config.vocab_size,
                                              self.scheduler.check_fits, self.structured_output.validate,
                                              multimodal_processor(resolved, self.tokenizer))
        self.lora_checker = LoRAChecker(config.enable_lora, model_shape(self.model_config), config.max_lora_rank,
                                        speculative is not None)
        self.input_processor.check_lora_request = self.lora_checker.check
        self.output_processor = OutputProcessor(self.tokenizer)
        self.log_stats = log_stats
        self._iteration_stats = IterationStats()
        self._request_counter = itertools.count()
        # CUDA runs a step asynchronously: the previous step's text work overlaps it.
        self.overlap_postprocess = self.device.type == "cuda" and config.tensor_parallel_size == 1
        self._deferred: tuple[SchedulerOutput, ModelRunnerOutput, list[Request], list[int]] | None = None
        self._release_after_step: list[str] = []
        # Async scheduling: the step launched last and not yet read back.
        self.async_scheduling = resolved.async_scheduling
        self._in_flight: InFlight | None = None
        self.startup_seconds = time.perf_counter() - start
        logger.info("kvloom engine ready: model=%s dtype=%s device=%s max_model_len=%d blocks=%d x %d "
                    "tokens, start-up %.1fs", self.source.name, str(self.dtype).replace("torch.", ""),
                    self.device, self.max_model_len, num_blocks - 1, self.block_size, self.startup_seconds)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    # ---- requests --------------------------------------------------------------------------
    def shutdown(self) -> None:
        self.executor.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def add_request(self, request_id: str, prompt: PromptInput | EngineRequest,
                    params: SamplingParams | None = None, arrival_time: float | None = None) -> None:
        """Queue a request; ValueError (and nothing queued) if it is invalid or can never fit.

        ``prompt`` is a prompt (text, token ids, a prompt dict), tokenized and validated here, or an
        EngineRequest from ``input_processor.process``, queued as it is (its parameters with it).
        """
        request = self.input_processor.engine_request(prompt, params, request_id, arrival_time=arrival_time)
        if request_id in self.output_processor.request_states:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = request.sampling_params
        if request.lora_request is not None:  # an EngineRequest made elsewhere: its adapter checked here too
            self.lora_checker.check(request.lora_request)
        children = []
        for index in range(params.n):
            child_params = params
            child_id = request_id
            if params.n > 1:
                child_id = f"{index}_{request_id}"
                child_params = params.clone()
                child_params.n = 1
                if params.seed is not None:
                    child_params.seed = params.seed + index
            children.append(Request(child_id, request.prompt_token_ids, child_params, self.eos_token_ids,
                                    self.max_model_len, request.arrival_time, request.mm_features))
            children[-1].lora_request = request.lora_request
        self.output_processor.add_request(request, children)
        # The adapter's read from disk starts now, off this thread; the request waits for it, not the step.
        loading = None if request.lora_request is None else self.executor.prefetch_lora(request.lora_request)
        # Fork after prefill: the first completion computes the prompt; the others join once its KV blocks are in
        # the prefix cache, so they compute only the prompt's last partial block, not all of it.
        fork = (len(children) > 1 and params.structured_outputs is None
                and self.kv_cache_manager.enable_prefix_caching and not params.computes_whole_prompt)
        for index, child in enumerate(children):
            waits: list[Wait] = []
            if loading is not None and (not loading.done() or loading.exception() is not None):
                waits.append(loading)  # an adapter already in memory is no wait
            if params.structured_outputs is not None:
                child.structured_output = state = self.structured_output.start(
                    params.structured_outputs, child.prompt_token_ids, enable_thinking=request.enable_thinking)
                waits.append(Polled(functools.partial(self.structured_output.ready, state), state.future))
            if fork and index > 0:
                waits.append(Polled(functools.partial(_prompt_computed, children[0])))
            if waits:
                self.waiting_room.add(child, waits)
            else:
                self.scheduler.add_request(child)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Stop requests now and free their KV blocks; returns their last outputs (finish reason
        "abort" for the completions still running). Unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        child_ids = []
        for request_id in request_ids:
            state = self.output_processor.request_states.get(request_id)
            if state is not None:
                child_ids.extend(c.request.request_id for c in state.completions)
        finished = self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        for request in self.waiting_room.remove(child_ids):
            request.status = RequestStatus.FINISHED_ABORTED
        self._release([r.request_id for r in finished])
        return self.output_processor.abort_requests(request_ids, time.time(), self._stats())

    def get_unfinished_request_ids(self) -> list[str]:
        return list(self.output_processor.request_states)

    def has_unfinished_requests(self) -> bool:
        return (bool(self.output_processor.request_states) or self.scheduler.has_unfinished_requests()
                or self._in_flight is not None)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.request_states)

    def take_iteration_stats(self) -> IterationStats:
        """What the steps and aborts since the last call did (empty unless ``log_stats``)."""
        stats, self._iteration_stats = self._iteration_stats, IterationStats()
        return stats

    def _stats(self) -> IterationStats | None:
        return self._iteration_stats if self.log_stats else None

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit the requests whose waits are over, then schedule, run and update one step; return the outputs
        of the requests that progressed (or failed while they waited).

        On CUDA the step's device work is launched first and the previous step's text work (detokenize,
        stop strings, outputs) is done while the device computes, so outputs come one step later; a
        request a stop string ends then computes one token more, which is dropped.
        """
        failed = self._admit_waiting() if self.waiting_room else False
        if self.async_scheduling:
            outputs = self._step_async()
        elif self.overlap_postprocess:
            outputs = self._step_overlapped()
        else:
            outputs = self._step_sync()
        if failed and not outputs:  # a request that failed while it waited ends in this step's outputs
            outputs = self.output_processor.make_outputs(time.time(), self._stats())
        return outputs

    def _step_sync(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        requests = self._prepare_launch(scheduler_output)
        runner_output = self.executor.execute(scheduler_output)
        self._update(scheduler_output, runner_output, requests)
        return self._postprocess_deferred()

    def _step_overlapped(self) -> list[RequestOutput]:
        """Launch this step, postprocess the one before while the device runs it, then update this one (its
        text work waits for the next step)."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return self._postprocess_deferred()
        requests = self._prepare_launch(scheduler_output)
        pending = self.executor.execute_async(scheduler_output)
        outputs = self._postprocess_deferred(in_flight=True)
        runner_output = pending()
        self._update(scheduler_output, runner_output, requests)
        self.executor.release_requests(self._release_after_step)
        self._release_after_step = []
        return outputs

    def _step_async(self) -> list[RequestOutput]:
        """Async scheduling: schedule while the step before still runs, then launch this one and read that one
        back. When a request in the step in flight needs its token first (grammar, penalties, bad words,
        min_tokens), that step is read back before this one is scheduled, so no request sits a step out."""
        drained: list[RequestOutput] = []
        if self._in_flight is not None and self._in_flight.needs_tokens:
            drained = self._launch_and_read_back(SchedulerOutput())
        return drained + self._launch_and_read_back(self.scheduler.schedule())

    def _update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                requests: list[Request]) -> None:
        """Append the new tokens (token-level stops apply); the text work waits in ``_deferred``."""
        num_outputs_before = [request.num_output_tokens for request in requests]
        stats = self._stats()
        if stats is not None:
            stats.num_prompt_tokens += sum(
                max(0, min(s.num_computed_tokens + s.num_new_tokens, r.num_prompt_tokens) - s.num_computed_tokens)
                for s, r in zip(scheduler_output.scheduled, requests))
        failed = self.scheduler.finish_requests(runner_output.failed_request_ids, RequestStatus.FINISHED_ERROR)
        finished = self.scheduler.update_from_output(scheduler_output, runner_output)
        finished += self._advance_grammars(requests, num_outputs_before)
        self._release([r.request_id for r in failed + finished])
        self._deferred = (scheduler_output, runner_output, requests, num_outputs_before)

    def _postprocess_deferred(self, in_flight: bool = False) -> list[RequestOutput]:
        """Postprocess the last updated step: each request's new tokens go to the output processor
        (detokenize, stop strings, logprobs); a stop string ends its request here. ``in_flight``: a
        step is running, so the runner forgets the requests that end here only after it."""
        if self._deferred is None:
            return []
        scheduler_output, runner_output, requests, num_outputs_before = self._deferred
        self._deferred = None
        output_processor = self.output_processor
        stopped_by_string: list[str] = []
        progress_requests = output_processor.progress_requests
        for index, (item, request) in enumerate(zip(scheduler_output.scheduled, requests)):
            if progress_requests and request.request_id in progress_requests \
                    and item.num_computed_tokens < request.num_prompt_tokens:  # a prefill chunk: return_progress news
                output_processor.add_prompt_progress(
                    request, min(item.num_computed_tokens + item.num_new_tokens, request.num_prompt_tokens),
                    time.time())
            rows = runner_output.prompt_logprobs.get(request.request_id)
            if rows:
                output_processor.add_prompt_logprobs(request, item.num_computed_tokens, rows)
            if runner_output.pooler_output:
                pooled = runner_output.pooler_output.get(request.request_id)
                if pooled is not None:
                    output_processor.add_pooler_output(request, pooled)
            if request.status == RequestStatus.FINISHED_ERROR:
                output_processor.finish_failed(request)
                continue
            # What the scheduler appended: the runner's tokens up to a token-level stop.
            new_token_ids = request.output_token_ids[num_outputs_before[index]:num_outputs_before[index] + len(
                runner_output.sampled_token_ids.get(request.request_id, ()))]
            if not new_token_ids:
                continue
            rows = runner_output.logprobs.get(request.request_id)
            new_logprobs = None if rows is None else rows[:len(new_token_ids)]
            if output_processor.process_tokens(request, new_token_ids, new_logprobs):
                stopped_by_string.append(request.request_id)
        if stopped_by_string:
            finished = self.scheduler.finish_requests(stopped_by_string, RequestStatus.FINISHED_STOPPED)
            released = [r.request_id for r in finished]
            if in_flight:
                self._release_after_step.extend(released)
            else:
                self._release(released)
        return output_processor.make_outputs(time.time(), self._stats())

    def _launch_and_read_back(self, scheduler_output: SchedulerOutput) -> list[RequestOutput]:
        """Launch this step (if anything is scheduled), then read back, update and postprocess the one in flight
        (the device runs this one meanwhile). Outputs come one step late, as with the overlap."""
        launched = None
        if not scheduler_output.is_empty:
            # A constrained request never runs ahead of its last token: its grammar saw every token so far.
            requests = self._prepare_launch(scheduler_output)
            needs_tokens = any(request.needs_last_token() for item, request in zip(scheduler_output.scheduled, requests)
                               if item.samples and len(request.output_token_ids) + 1 < request.max_tokens)
            launched = InFlight(scheduler_output, self.executor.execute_async(scheduler_output), requests,
                                needs_tokens)
        previous, self._in_flight = self._in_flight, None
        outputs: list[RequestOutput] = []
        if previous is not None:
            runner_output = previous.result()
            # Requests that ended before ``previous`` ran are in no step still running.
            done, self._release_after_step = self._release_after_step, []
            self.executor.release_requests(done)
        self._in_flight = launched  # from here on, a request that ends waits for this step before it is released
        if previous is not None:
            self._update(previous.scheduler_output, runner_output, previous.requests)
            outputs = self._postprocess_deferred()
        if self._in_flight is None:
            done, self._release_after_step = self._release_after_step, []
            self.executor.release_requests(done)
        return outputs

    def _prepare_launch(self, scheduler_output: SchedulerOutput) -> list[Request]:
        """The scheduled requests (looked up before the scheduler lets go of those that finish), and the step's
        grammar masks as a job the runner runs once the forward is launched."""
        requests = [self.scheduler.requests[s.request_id] for s in scheduler_output.scheduled]
        scheduler_output.grammar_bitmask = self.structured_output.grammar_bitmask_job(
            [(item.request_id, request.structured_output) for item, request in zip(scheduler_output.scheduled, requests)
             if request.structured_output is not None and item.samples])
        return requests

    def _release(self, request_ids: list[str]) -> None:
        """The runner forgets ended requests: at once, or (async scheduling) once the step in flight, which may
        hold them, is done."""
        if self._in_flight is not None:
            self._release_after_step.extend(request_ids)
        else:
            self.executor.release_requests(request_ids)

    def _admit_waiting(self) -> bool:
        """Hand the requests whose waits are over to the scheduler, in the order they came; end with an error
        those whose grammar or adapter failed. True when one ended. With nothing else to run, wait a little
        for a future rather than spin."""
        admitted, failed = self.waiting_room.take(idle=not self.scheduler.has_unfinished_requests())
        for request in admitted:
            self.scheduler.add_request(request)
        for request, error in failed:
            logger.warning("request %s: %s", request.request_id, error)
            request.status = RequestStatus.FINISHED_ERROR
            request.stop_reason = str(error)
            self.output_processor.finish_failed(request)
        return bool(failed)

    # ---- structured outputs ----------------------------------------------------------------------
    def _advance_grammars(self, requests: list[Request], num_outputs_before: list[int]) -> list[Request]:
        """Move each constrained request's matcher over the tokens it kept this step; a request whose
        grammar has ended stops (even when its stop token is not an EOS it stops on, e.g. ignore_eos), and
        one that sampled a token its grammar refuses ends with an error. Returns the requests ended here."""
        ended = []
        for request, before in zip(requests, num_outputs_before):
            state = request.structured_output
            if state is None or state.matcher is None or request.num_output_tokens == before:
                continue
            if not state.matcher.accept_tokens(request.output_token_ids[before:]):
                logger.warning("request %s sampled a token its grammar refuses; ending it", request.request_id)
                ended += self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR)
            elif state.matcher.is_terminated() and not request.is_finished:
                ended += self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        return ended


def _prompt_computed(first: Request) -> bool:
    """Whether an n > 1 request's first completion has computed its prompt (or ended): its siblings may join."""
    return first.num_computed_tokens >= first.num_prompt_tokens or first.is_finished

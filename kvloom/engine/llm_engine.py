"""LLMEngine: the synchronous core. Each step() is three verbs: schedule, run, postprocess.

Postprocessing appends sampled tokens, applies token-level stops (in the scheduler), detokenizes
incrementally, applies stop strings, and builds vLLM's RequestOutput objects. A request with n > 1
is split into n child Requests (sharing the prompt's cached blocks) and gathered back here.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvloom.config import EngineConfig, resolve_config
from kvloom.engine.detokenizer import IncrementalDetokenizer
from kvloom.engine.kv_cache_manager import KVCacheManager
from kvloom.engine.request import Request, RequestStatus
from kvloom.engine.scheduler import Scheduler
from kvloom.executor import build_executor
from kvloom.loader.tokenizer import Tokenizer, load_tokenizer
from kvloom.loader.weights import resolve_model
from kvloom.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvloom.platform import configure_host
from kvloom.sampling_params import SamplingParams
from kvloom.step_io import LogprobsRow

logger = logging.getLogger("kvloom")

PromptInput = str | list[int] | dict[str, Any]


@dataclass
class ParentRequest:
    """What the caller submitted: one prompt and n completions (child Requests)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request] = field(default_factory=list)
    arrival_time: float = 0.0

    @property
    def finished(self) -> bool:
        return all(child.is_finished for child in self.children)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
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
        self.kv_cache_manager = KVCacheManager(num_blocks, self.block_size, config.enable_prefix_caching)
        self.max_num_batched_tokens = resolved.max_num_batched_tokens
        self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_seqs,
                                   self.max_num_batched_tokens, self.max_model_len)
        self.parents: dict[str, ParentRequest] = {}
        # Offline generate() reads only finished outputs; streaming callers want every step's.
        self.final_outputs_only = False
        self._request_counter = itertools.count()
        # Counters for the metrics (tokens computed, tokens generated).
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
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

    def process_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """A text, token ids or {"prompt": ...} / {"prompt_token_ids": [...]} -> (text, ids)."""
        text: str | None = None
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
            if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
                raise ValueError(f"a prompt dict needs exactly one of 'prompt' (text) or "
                                 f"'prompt_token_ids' (list of ints), got keys {sorted(prompt)}")
            if prompt.get("multi_modal_data"):
                raise ValueError("multi_modal_data is not supported: kvloom serves text models")
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                prompt = prompt["prompt_token_ids"]
                if not isinstance(prompt, list):
                    raise ValueError(f"prompt_token_ids must be a list of ints, got {type(prompt).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; give at least one character or token")
            text = prompt
            try:
                token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            except TypeError:  # the tokenizers library's answer to lone surrogates
                raise ValueError("the prompt is not valid Unicode text (it holds a lone surrogate)") from None
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            vocab = self.model_config.vocab_size
            for t in token_ids:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                    raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {t!r}")
        else:
            raise ValueError(f"a prompt must be a string, a list of token ids or a dict, "
                             f"got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty; give at least one character or token")
        return text, token_ids

    def validate_request(self, token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        self.scheduler.check_fits(len(token_ids), params.max_tokens)
        vocab = self.model_config.vocab_size
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {t}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise ValueError(f"{name} must be at most the vocabulary size {vocab}, got {value}")

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None,
                    arrival_time: float | None = None, prompt_text: str | None = None) -> None:
        """Queue a request; ValueError (and nothing queued) if it is invalid or can never fit."""
        params = SamplingParams() if params is None else params
        text, token_ids = self.process_prompt(prompt)
        self.validate_request(token_ids, params)
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival_time = time.time() if arrival_time is None else arrival_time
        parent = ParentRequest(request_id, prompt_text if prompt_text is not None else text, token_ids,
                               params, arrival_time=arrival_time)
        for index in range(params.n):
            child_params = params
            child_id = request_id
            if params.n > 1:
                child_id = f"{index}_{request_id}"
                child_params = params.clone()
                child_params.n = 1
                if params.seed is not None:
                    child_params.seed = params.seed + index
            child = Request(child_id, token_ids, child_params, self.eos_token_ids, self.max_model_len,
                            arrival_time)
            child.parent_id = request_id
            child.index = index
            if child_params.detokenize:
                child.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids,
                                                           child_params.skip_special_tokens)
            parent.children.append(child)
        self.parents[request_id] = parent
        for child in parent.children:
            self.scheduler.add_request(child)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests now and free their KV blocks."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        child_ids = []
        for request_id in request_ids:
            parent = self.parents.pop(request_id, None)
            if parent is not None:
                child_ids.extend(c.request_id for c in parent.children)
        finished = self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        self.executor.release_requests([r.request_id for r in finished])

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents) or self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        runner_output = self.executor.execute(scheduler_output)
        # The scheduled requests, looked up before the scheduler lets go of those that finish.
        requests = [self.scheduler.requests[s.request_id] for s in scheduler_output.scheduled]
        self.num_prompt_tokens_total += sum(
            max(0, min(s.num_computed_tokens + s.num_new_tokens, r.num_prompt_tokens) - s.num_computed_tokens)
            for s, r in zip(scheduler_output.scheduled, requests))
        finished = self.scheduler.update_from_output(scheduler_output, runner_output)
        now = time.time()
        touched: dict[str, ParentRequest] = {}
        stopped_by_string: list[str] = []
        for item, request in zip(scheduler_output.scheduled, requests):
            rows = runner_output.prompt_logprobs.get(request.request_id)
            if rows and request.prompt_logprobs is not None:
                # Row k predicts prompt position start + 1 + k; after a preemption the same
                # positions are computed again and must not be appended twice.
                start = item.num_computed_tokens + 1
                rows = rows[len(request.prompt_logprobs) - start:] if len(request.prompt_logprobs) >= start else []
                request.prompt_logprobs.extend(self._logprob_dicts(rows, request.sampling_params.prompt_logprobs))
            token_ids = runner_output.sampled_token_ids.get(request.request_id)
            if not token_ids:
                continue
            self.num_generation_tokens_total += len(token_ids)
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            for row in runner_output.logprobs.get(request.request_id, []):
                request.cumulative_logprob += row[1][0]
                if request.logprobs is not None:
                    request.logprobs.extend(self._logprob_dicts([row], request.sampling_params.logprobs))
            for token_id in token_ids:
                if self._postprocess_text(request, token_id):
                    stopped_by_string.append(request.request_id)
                    break
            parent = self.parents.get(request.parent_id)
            if parent is not None:
                touched[parent.request_id] = parent
        if stopped_by_string:
            finished += self.scheduler.finish_requests(stopped_by_string, RequestStatus.FINISHED_STOPPED)
        self.executor.release_requests([r.request_id for r in finished])

        outputs = []
        for parent in touched.values():
            finished_parent = parent.finished
            if self.final_outputs_only and not finished_parent:
                continue
            output = self._make_output(parent)
            if finished_parent:
                del self.parents[parent.request_id]
            outputs.append(output)
        return outputs

    def _postprocess_text(self, request: Request, token_id: int) -> bool:
        """Detokenize the new token and look for stop strings. True if a stop string ended it."""
        if request.detokenizer is None:
            return False
        params = request.sampling_params
        stopped_by_token = request.status == RequestStatus.FINISHED_STOPPED
        if stopped_by_token and not params.include_stop_str_in_output:
            # The EOS / stop token's text is not part of the output; what came before it is.
            request.output_text += request.detokenizer.flush()
            return False
        new_text = request.detokenizer.step([token_id])
        if request.is_finished:
            # An output that ends inside a multi-byte character still shows its tail (as U+FFFD).
            new_text += request.detokenizer.flush()
        if not new_text:
            return False
        previous_length = len(request.output_text)
        request.output_text += new_text
        if not params.stop or stopped_by_token:
            return False
        longest = max(len(s) for s in params.stop)
        search_from = max(0, previous_length - longest + 1)
        best: tuple[int, str] | None = None
        for stop in params.stop:
            index = request.output_text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        end = index + len(stop) if params.include_stop_str_in_output else index
        request.output_text = request.output_text[:end]
        request.stop_reason = stop
        if request.is_finished:  # it also hit max_tokens this step: the stop string names the end
            request.status = RequestStatus.FINISHED_STOPPED
            return False
        return True

    def _visible_text(self, request: Request) -> str:
        """Text safe to show: while running, hold back what could still become a stop string."""
        params = request.sampling_params
        if request.is_finished or not params.stop or params.include_stop_str_in_output:
            return request.output_text
        hold = max(len(s) for s in params.stop) - 1
        return request.output_text[:len(request.output_text) - hold] if hold else request.output_text

    def _logprob_dicts(self, rows: list[LogprobsRow], num: int) -> list[dict[int, Logprob]]:
        result = []
        for ids, values, rank in rows:
            entry: dict[int, Logprob] = {}
            entry[ids[0]] = Logprob(values[0], rank, self.tokenizer.decode([ids[0]], skip_special_tokens=False))
            for position, (token_id, value) in enumerate(zip(ids[1:num + 1], values[1:num + 1])):
                if token_id not in entry:
                    entry[token_id] = Logprob(value, position + 1,
                                              self.tokenizer.decode([token_id], skip_special_tokens=False))
            result.append(entry)
        return result

    def _make_output(self, parent: ParentRequest) -> RequestOutput:
        completions = []
        for child in parent.children:
            status = child.status
            finish_reason = status.value if status.finished else None
            completions.append(CompletionOutput(
                index=child.index,
                text=self._visible_text(child),
                token_ids=list(child.output_token_ids),
                cumulative_logprob=child.cumulative_logprob if child.logprobs is not None else None,
                logprobs=list(child.logprobs) if child.logprobs is not None else None,
                finish_reason=finish_reason,
                stop_reason=child.stop_reason,
            ))
        first = parent.children[0]
        finished = parent.finished
        metrics = RequestMetrics(
            arrival_time=parent.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=min((c.first_token_time for c in parent.children if c.first_token_time),
                                 default=None),
            last_token_time=max((c.last_token_time for c in parent.children if c.last_token_time),
                                default=None),
            finished_time=time.time() if finished else None,
        )
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
            outputs=completions,
            finished=finished,
            metrics=metrics,
            num_cached_tokens=max(first.num_cached_tokens, 0),
        )

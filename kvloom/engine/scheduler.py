"""The scheduler: each step, hand out tokens under a budget to close every request's gap.

There is no separate prefill phase. A request's gap is ``num_tokens - num_computed_tokens``: a
whole prompt (minus prefix-cache hits) when new, a chunk of it when the budget is short, one token
when decoding, everything again after preemption. Running requests are served first, in arrival
order; waiting requests are admitted while budget, sequence slots and blocks last. When a running
request cannot get a block, the newest running request is preempted (its blocks freed, its
progress reset) and recomputed later. The scheduler never touches tensors.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvloom.engine.kv_cache_manager import KVCacheManager
from kvloom.engine.request import ContextLengthError, Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute tokens [num_computed_tokens, +num_new_tokens)."""

    request: Request
    num_computed_tokens: int
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step reaches the request's last known token, so it yields a new token."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's state now; the counters are totals since start-up."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks held by requests, 0..1
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int) -> None:
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- admission -------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None,
                   max_tokens_must_fit: bool = False) -> None:
        """Refuse at once a request that could never be scheduled.

        The prompt must leave room for one output token (longer outputs stop at ``max_model_len``);
        with ``max_tokens_must_fit`` (the OpenAI server's rule) all of ``max_tokens`` must fit.
        ContextLengthError when the context is too short, ValueError when the whole KV cache is.
        """
        num_output_tokens = (max_tokens or 1) if max_tokens_must_fit else 1
        if num_prompt_tokens + num_output_tokens > self.max_model_len:
            raise ContextLengthError(self.max_model_len, num_prompt_tokens, num_output_tokens)
        total = num_prompt_tokens + (max_tokens or 1)
        needed = self.kv.blocks_needed(min(total, self.max_model_len))
        if needed > self.kv.num_usable_blocks:
            raise ValueError(f"The request needs {needed} KV cache blocks "
                             f"({min(total, self.max_model_len)} tokens) but the whole cache holds "
                             f"{self.kv.num_usable_blocks} blocks of {self.kv.block_size} tokens; "
                             f"raise kv_cache_memory or lower max_tokens.")

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests (aborts, stop strings): free their blocks at once."""
        finished = []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            request.status = status
            self.kv.free(request)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.time()

        # Running requests first, oldest first; the newest are preempted when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget,
                          self.max_model_len - request.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new))
                budget -= num_new
                i += 1
                continue
            break  # the request preempted itself: nothing behind it is left running

        # Then waiting requests, in order, while budget, slots and blocks last. None after a
        # preemption this step: blocks are short, and the preempted would be re-admitted at once.
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            computed_blocks, num_hit_tokens = [], 0
            # Prompt logprobs need every prompt position computed, so such requests skip the cache.
            if request.num_computed_tokens == 0 and request.sampling_params.prompt_logprobs is None:
                computed_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if not self.kv.allocate_slots(request, num_new, computed_blocks):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_hit_tokens, num_new))
            budget -= num_new

        # The gap closes at schedule time; outputs only append the sampled tokens.
        for item in out.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled_token_ids: dict[str, int]) -> list[Request]:
        """Append each sampled token, apply token-level stop checks. Returns requests that finished."""
        finished = []
        for item in scheduler_output.scheduled:
            request = item.request
            token_id = sampled_token_ids.get(request.request_id)
            if token_id is None or request.is_finished:
                continue
            request.append_output_token(token_id)
            if request.check_stop():
                finished.append(request)
        for request in finished:
            self._remove_finished(request)
        return finished

    def _remove_finished(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        if request in self.running:
            self.running.remove(request)
        self.kv.free(request)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage, num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv.prefix_queries, prefix_cache_hits=self.kv.prefix_hits)

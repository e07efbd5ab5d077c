"""The scheduler: each step, hand out tokens under a budget to close every request's gap.

There is no separate prefill phase. A request's gap is ``num_tokens - num_computed_tokens``: a
whole prompt (minus prefix-cache hits) when new, a chunk of it when the budget is short, one token
when decoding, everything again after preemption. Running requests are served first, in arrival
order; waiting requests are admitted while budget, sequence slots and blocks last. When a running
request cannot get a block, the newest running request is preempted (its blocks freed, its
progress reset) and recomputed later. The scheduler never touches tensors.

Speculative decoding (vLLM V1's shape): the runner proposes every draft (n-gram, draft model, EAGLE) after
a step and returns them with its tokens; the scheduler carries them into the request's next step (cut to the
budget and the request's limits), reserves their slots, and rolls ``num_computed_tokens`` back past the ones
the target rejected. With a draft model it also reserves ``num_lookahead_tokens`` slots past a sampling
step's end, where the draft writes the KV of its own guesses.

Async scheduling (``async_scheduling``, vLLM V1's): the engine schedules step N+1 while step N still runs on
the device. A request step N samples for has that token pending (``num_pending_tokens``); step N+1 may
compute it all the same (a ``PLACEHOLDER_TOKEN_ID`` the runner replaces with step N's output on the device),
unless the request needs the token's value first (a grammar, penalties, bad words, min_tokens not reached; the
engine then reads step N back before it schedules, so this only guards) or it is the request's last
(max_tokens). A request that step N ends (EOS, a stop token) wasted its step N+1 token, which is dropped.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from kvloom.engine.kv_cache_manager import KVCacheManager
from kvloom.engine.request import ContextLengthError, Request, RequestStatus
from kvloom.spec_decode.policy import can_speculate
from kvloom.stats import SchedulerStats
from kvloom.step_io import (
    PLACEHOLDER_TOKEN_ID,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)


def check_request_fits(max_model_len: int, block_size: int, num_usable_blocks: int, num_prompt_tokens: int,
                       max_tokens: int | None, max_tokens_must_fit: bool = False) -> None:
    """Refuse at once a request that could never be scheduled.

    The prompt must leave room for one output token (longer outputs stop at ``max_model_len``);
    with ``max_tokens_must_fit`` (the OpenAI server's rule) all of ``max_tokens`` must fit.
    ContextLengthError when the context is too short, ValueError when the whole KV cache is.
    A function of the limits alone, so a front holding no cache (the replica router) asks the same.
    """
    num_output_tokens = (max_tokens or 1) if max_tokens_must_fit else 1
    if num_prompt_tokens + num_output_tokens > max_model_len:
        raise ContextLengthError(max_model_len, num_prompt_tokens, num_output_tokens)
    total = min(num_prompt_tokens + (max_tokens or 1), max_model_len)
    needed = -(-total // block_size)
    if needed > num_usable_blocks:
        raise ValueError(f"The request needs {needed} KV cache blocks ({total} tokens) but the whole cache "
                         f"holds {num_usable_blocks} blocks of {block_size} tokens; "
                         f"raise kv_cache_memory or lower max_tokens.")


def _adapter_names(requests: Iterable[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None}))


class _LoRAAdmission:
    """Which waiting requests one step may admit under ``max_loras`` distinct adapters in the running set.

    Running requests are always scheduled, so keeping the running set within max_loras adapters keeps every
    step within the runner's compute slots. A request whose adapter would need a slot beyond them waits; from
    then on, until a step in which it is admitted, only base-model requests pass it: requests for adapters
    already running would keep their slots busy for ever (a waiting adapter starving), while base requests
    take no slot. The running adapters' requests finish, a slot frees, and the waiting adapter gets it.
    """

    def __init__(self, max_loras: int, running: list[Request]) -> None:
        self.max_loras = max_loras
        self.adapters = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}
        self.someone_waits = False

    def blocked(self, request: Request) -> bool:
        lora = request.lora_request
        if lora is None:
            return False
        if self.someone_waits or (lora.lora_int_id not in self.adapters and len(self.adapters) >= self.max_loras):
            self.someone_waits = True
            return True
        return False

    def admit(self, request: Request) -> None:
        if request.lora_request is not None:
            self.adapters.add(request.lora_request.lora_int_id)


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, num_speculative_tokens: int = 0,
                 num_lookahead_tokens: int = 0, speculative_max_model_len: int | None = None,
                 max_loras: int = 0, async_scheduling: bool = False) -> None:
        self.kv = kv_cache_manager
        # Steps are scheduled one ahead of the device: sampling steps leave their token pending.
        self.async_scheduling = async_scheduling
        # LoRA: most distinct adapters among the running requests (the runner's compute slots); 0: LoRA off.
        self.max_loras = max_loras
        # Speculative decoding: the runner's drafts come back with each step's tokens (at most
        # num_speculative_tokens a request); with a draft model / EAGLE head, num_lookahead_tokens slots past a
        # sampling step's end are reserved for the draft's own KV.
        self.num_lookahead_tokens = num_lookahead_tokens
        self.speculative_max_model_len = min(speculative_max_model_len or max_model_len, max_model_len)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * num_speculative_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Images the runner found in its encoder cache, and the ones it encoded (vision-language models).
        self.num_encoder_cache_hits = 0
        self.num_encoder_cache_misses = 0

    # ---- admission -------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None,
                   max_tokens_must_fit: bool = False) -> None:
        """Refuse at once a request that could never be scheduled (``check_request_fits``)."""
        check_request_fits(self.max_model_len, self.kv.block_size, self.kv.num_usable_blocks,
                           num_prompt_tokens, max_tokens, max_tokens_must_fit)

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
        # (request, tokens to compute this step, the draft tokens among them)
        scheduled: list[tuple[Request, int, list[int]]] = []
        budget = self.max_num_batched_tokens
        now = time.time()

        # Running requests first, oldest first; the newest are preempted when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens + request.num_pending_tokens - request.num_computed_tokens, budget,
                          self.max_model_len - request.num_computed_tokens)
            if num_new <= 0 or (request.num_pending_tokens and not self._runs_ahead(request)):
                i += 1
                continue
            drafts = self._drafts(request, budget) if num_new == 1 else []
            request.spec_token_ids = []
            num_new += len(drafts)
            lookahead = self._lookahead(request, request.num_computed_tokens + num_new,
                                        request.num_computed_tokens + num_new - len(drafts) == request.num_tokens)
            while not self.kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new, drafts))
                budget -= num_new
                i += 1
                continue
            break  # the request preempted itself: nothing behind it is left running

        # Then waiting requests, in order, while budget, slots and blocks last. None after a
        # preemption this step: blocks are short, and the preempted would be re-admitted at once.
        # LoRA: a request whose adapter would take a compute slot beyond max_loras waits (``_LoRAAdmission``).
        lora = _LoRAAdmission(self.max_loras, self.running) if self.max_loras else None
        position = 0  # the waiting requests before it wait for a LoRA slot
        while (len(self.waiting) > position and budget > 0 and not out.preempted_request_ids
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[position]
            if request.num_pending_tokens:  # preempted while its last step ran: it waits for that token
                position += 1
                continue
            if lora is not None and lora.blocked(request):
                position += 1
                continue
            computed_blocks, num_hit_tokens = [], 0
            # Prompt logprobs (and MEAN / CLS pooling) need every prompt position computed: no cache lookup.
            looks_up = (self.kv.enable_prefix_caching and request.num_computed_tokens == 0
                        and not request.sampling_params.computes_whole_prompt)
            if looks_up:
                computed_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            lookahead = self._lookahead(request, num_hit_tokens + num_new,
                                        num_hit_tokens + num_new == request.num_tokens)
            if not self.kv.allocate_slots(request, num_new, computed_blocks, num_lookahead_tokens=lookahead):
                break
            if looks_up:
                self.kv.record_prefix_lookup(request.num_tokens, num_hit_tokens)
            del self.waiting[position]
            if lora is not None:
                lora.admit(request)
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                out.new_requests.append(self._new_request_data(request))
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new, []))
            budget -= num_new

        for request, num_new, drafts in scheduled:
            start = request.num_computed_tokens
            end = start + num_new - len(drafts)
            token_ids = request.all_token_ids[start:end]
            if request.num_pending_tokens and end > request.num_tokens:
                token_ids.append(PLACEHOLDER_TOKEN_ID)  # the token the step in flight samples
            samples = end == request.num_tokens + request.num_pending_tokens
            out.scheduled.append(ScheduledRequest(request.request_id, start, token_ids + drafts,
                                                  list(request.block_ids), samples=samples,
                                                  num_draft_tokens=len(drafts)))
            # The gap closes at schedule time; outputs only append the sampled tokens.
            request.num_computed_tokens += num_new
            if samples and self.async_scheduling:
                request.num_pending_tokens += 1
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    @staticmethod
    def _runs_ahead(request: Request) -> bool:
        """Whether a request whose last token is still being sampled may compute it now, before its value is
        known: not when choosing the next token needs it, nor when it is the request's last."""
        return (not request.needs_last_token()
                and len(request.output_token_ids) + request.num_pending_tokens < request.max_tokens)

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """The runner's drafts for a decoding request, cut to the budget, its output limit and
        speculative_max_model_len (one token of the step is the target's own)."""
        if not request.spec_token_ids or not can_speculate(request.sampling_params, request.num_output_tokens):
            return []
        room = min(budget - 1, request.max_tokens - request.num_output_tokens - 1,
                   self.speculative_max_model_len - request.num_tokens)
        return request.spec_token_ids[:max(room, 0)]

    def _lookahead(self, request: Request, end: int, samples: bool) -> int:
        """Slots to reserve past ``end`` (the step's last slot, drafts included) for a draft model's own KV: its
        guesses after this step are written there. Only when the step samples (the runner proposes then), and
        never past the request's final length (a guess there could never be used, and check_fits promised no
        more)."""
        if not self.num_lookahead_tokens or not samples or not can_speculate(request.sampling_params,
                                                                            request.num_output_tokens):
            return 0
        final_length = request.num_prompt_tokens + request.max_tokens
        return max(0, min(self.num_lookahead_tokens, final_length - end))

    @staticmethod
    def _new_request_data(request: Request) -> NewRequestData:
        params = request.sampling_params
        stop_ids = frozenset() if params.min_tokens == 0 else frozenset(
            (request.eos_token_ids | params.all_stop_token_ids) - {None})
        return NewRequestData(request.request_id, request.prompt_token_ids, params, stop_ids, request.mm_features,
                              request.lora_request)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[Request]:
        """Append each request's new tokens, applying the token-level stop checks after each (tokens
        past a stop are dropped). Returns the requests that finished."""
        finished = []
        self.num_encoder_cache_hits += runner_output.encoder_cache_hits
        self.num_encoder_cache_misses += runner_output.encoder_cache_misses
        for item in scheduler_output.scheduled:
            request = self.requests.get(item.request_id)
            if request is not None and item.samples and request.num_pending_tokens:
                request.num_pending_tokens -= 1
            token_ids = runner_output.sampled_token_ids.get(item.request_id)
            if request is None or not token_ids or request.is_finished:
                continue
            if item.num_draft_tokens:
                # The drafts the target rejected were computed for nothing: their positions (and KV slots)
                # are computed again. Accepted: len(token_ids) - 1 drafts, then the target's own token.
                accepted = len(token_ids) - 1
                request.num_computed_tokens = item.num_computed_tokens + 1 + accepted
                self.num_drafts += 1
                self.num_draft_tokens += item.num_draft_tokens
                self.num_accepted_tokens += accepted
                for position in range(accepted):
                    self.num_accepted_tokens_per_pos[position] += 1
            for token_id in token_ids:
                request.append_output_token(token_id)
                if request.check_stop():
                    finished.append(request)
                    break
            else:
                request.spec_token_ids = runner_output.draft_token_ids.get(item.request_id, [])
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
            prefix_cache_queries=self.kv.prefix_queries, prefix_cache_hits=self.kv.prefix_hits,
            num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_accepted_tokens_per_pos=tuple(self.num_accepted_tokens_per_pos),
            encoder_cache_hits=self.num_encoder_cache_hits, encoder_cache_misses=self.num_encoder_cache_misses,
            max_lora=self.max_loras, running_lora_adapters=_adapter_names(self.running),
            waiting_lora_adapters=_adapter_names(self.waiting))

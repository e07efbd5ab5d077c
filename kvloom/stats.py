"""The engine's numbers as plain data: the scheduler's state, what the steps did, finished requests.

The engine fills them (the scheduler its ``SchedulerStats``, the output processor its ``IterationStats``),
and the metrics (``kvloom/metrics.py``), the server and the data-parallel router read them: they live here,
below all of those, so a reader imports no engine and no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's state now; the counters are totals since start-up."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks held by requests, 0..1
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_drafts: int = 0  # speculated request-steps (vLLM's spec_decode_num_drafts)
    num_draft_tokens: int = 0  # speculative tokens proposed
    num_accepted_tokens: int = 0  # of those, accepted by the target model
    num_accepted_tokens_per_pos: tuple[int, ...] = ()  # [i]: drafts accepted at draft position i
    encoder_cache_hits: int = 0  # images a step needed that the runner's encoder cache held
    encoder_cache_misses: int = 0  # images the vision encoder ran for
    # LoRA (max_lora 0: off): the adapters of the running and of the waiting requests, by name.
    max_lora: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()


@dataclass
class FinishedRequestStats:
    """A request that finished (or was aborted), for the metrics and the request log line."""

    request_id: str
    finish_reasons: list[str]  # of its completions, sorted, without repeats
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generation_tokens: int

    @property
    def finish_reason(self) -> str:
        """One reason for the request: its completions' common one, else "stop"."""
        return self.finish_reasons[0] if len(self.finish_reasons) == 1 else "stop"


@dataclass
class IterationStats:
    """What the engine's steps (and aborts) did since these stats were taken (vLLM's IterationStats)."""

    num_prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)  # seconds, one per request
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds between a request's steps
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass(frozen=True)
class EngineStats:
    """The engine's state after a step: the scheduler's, and token totals since start-up."""

    scheduler: SchedulerStats = field(default_factory=SchedulerStats)
    prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    generation_tokens: int = 0
    timestamp: float = 0.0

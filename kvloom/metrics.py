"""Serving metrics: vLLM's Prometheus metrics under a ``kvloom:`` prefix, and the periodic log line.

Two kinds of numbers:
- engine state (requests running and waiting, KV cache usage, token / preemption / prefix-cache
  counters) is read from an ``EngineStats`` snapshot that the engine thread publishes after every
  step (the scheduler's own ``SchedulerStats`` plus the token totals), so a scrape never touches
  the scheduler while it runs;
- per-request latencies (time to first token, inter-token latency, end-to-end latency, queue
  time) are observed by the engine thread from the engine's ``IterationStats``.

Every metric carries a ``model_name`` label, as vLLM's do; a server of several models serves each loaded model's
metrics in one exposition (``merge_metrics``) with ``kvloom:model_loaded`` per model (``served_models_metrics``).
``kvloom:kv_cache_usage_perc`` is exactly 0 when no request holds a block (cached prefix blocks that are free count
as free), which is how the tests check that an aborted request gave its blocks back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvloom.cpu_capability import cpu_capability
from kvloom.stats import EngineStats, FinishedRequestStats, IterationStats

logger = logging.getLogger("kvloom")

# vLLM's buckets, so dashboards built for vLLM read kvloom's histograms the same way.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0]
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")

__all__ = ["EngineMetrics", "EngineStats", "StatLogger"]  # EngineStats: kvloom.stats, named here for the server

# No "<name>_created" series next to every counter and histogram (as vLLM).
disable_created_metrics()


def _token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_model_len:
                return buckets
            buckets.append(value)
        exponent += 1


class _EngineStatsCollector(Collector):
    """Gauges and counters read from the latest EngineStats at scrape time."""

    def __init__(self, model_name: str, get_stats: Callable[[], EngineStats]) -> None:
        self.model_name = model_name
        self.get_stats = get_stats

    def collect(self) -> Iterator[Metric]:
        stats = self.get_stats()
        scheduler = stats.scheduler
        labels = [self.model_name]

        def gauge(name: str, documentation: str, value: float) -> Metric:
            family = GaugeMetricFamily(f"kvloom:{name}", documentation, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, documentation: str, value: float) -> Metric:
            family = CounterMetricFamily(f"kvloom:{name}", documentation, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        yield gauge("num_requests_running", "Number of requests in model execution batches.",
                    scheduler.num_running)
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.",
                    scheduler.num_waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    scheduler.kv_cache_usage)
        yield counter("num_preemptions", "Cumulative number of preemptions from the engine.",
                      scheduler.num_preemptions)
        yield counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
                      "tokens.", scheduler.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      scheduler.prefix_cache_hits)
        yield counter("encoder_cache_hits", "Images whose encoder output was found in the encoder cache "
                      "(by content hash) when a step needed it.", scheduler.encoder_cache_hits)
        yield counter("encoder_cache_misses", "Images the vision encoder ran for.", scheduler.encoder_cache_misses)
        yield counter("spec_decode_num_drafts", "Speculative steps of a request (drafts verified at once).",
                      scheduler.num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Speculative draft tokens proposed.",
                      scheduler.num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Speculative draft tokens the target model accepted.",
                      scheduler.num_accepted_tokens)
        if scheduler.num_accepted_tokens_per_pos:
            family = CounterMetricFamily("kvloom:spec_decode_num_accepted_tokens_per_pos",
                                         "Speculative draft tokens accepted, per draft position.",
                                         labels=["model_name", "position"])
            for position, value in enumerate(scheduler.num_accepted_tokens_per_pos):
                family.add_metric([*labels, str(position)], value)
            yield family
        if scheduler.max_lora:  # vLLM's lora_requests_info: the adapters in the labels, the time as the value
            family = GaugeMetricFamily("kvloom:lora_requests_info", "Running stats on LoRA requests.",
                                       labels=["model_name", "max_lora", "running_lora_adapters",
                                               "waiting_lora_adapters"])
            family.add_metric([*labels, str(scheduler.max_lora), ",".join(scheduler.running_lora_adapters),
                               ",".join(scheduler.waiting_lora_adapters)], time.time())
            yield family
        yield counter("prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
        yield counter("generation_tokens", "Number of generation tokens processed.",
                      stats.generation_tokens)


class EngineMetrics:
    """The Prometheus registry of one served model.

    ``observe_output`` and ``observe_finished`` are called by the engine thread; ``render`` by the
    server. prometheus_client's histograms and counters are thread-safe.
    """

    def __init__(self, model_name: str, max_model_len: int, get_stats: Callable[[], EngineStats]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineStatsCollector(model_name, get_stats))

        def histogram(name: str, documentation: str, buckets: list[float]) -> Histogram:
            metric = Histogram(f"kvloom:{name}", documentation, labelnames=["model_name"],
                               buckets=buckets, registry=self.registry)
            return metric.labels(model_name)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time per output token in seconds, per request.", _ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
            _LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
            _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed, per request.",
            _token_buckets(max_model_len))
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed, per request.",
            _token_buckets(max_model_len))
        request_success = Counter("kvloom:request_success", "Count of finished requests, by reason "
                                  "(stop, length, abort).", labelnames=["model_name", "finished_reason"],
                                  registry=self.registry)
        self.request_success = {reason: request_success.labels(model_name, reason)
                                for reason in FINISH_REASONS}
        # The CPU the engine runs on and the ISA level its kernels use (kvloom env has the whole report).
        capability = cpu_capability()
        Info("kvloom:cpu", "The host CPU, its detected ISA level and the level in force (KVLOOM_CPU_ISA).",
             registry=self.registry).info({
                 "model_name": model_name, "cpu_model": capability.model_name,
                 "architecture": capability.architecture, "isa_detected": capability.detected,
                 "isa_level": capability.level, "features": " ".join(capability.features)})

    def observe_iteration(self, stats: IterationStats) -> None:
        """What the engine's steps did: first tokens, gaps between a request's steps, finished requests."""
        for seconds in stats.time_to_first_tokens:
            self.time_to_first_token.observe(max(0.0, seconds))
        for seconds in stats.inter_token_latencies:
            self.inter_token_latency.observe(max(0.0, seconds))
        for finished in stats.finished_requests:
            self.observe_finished(finished)

    def observe_finished(self, finished: FinishedRequestStats) -> None:
        reason = finished.finish_reason
        self.request_success[reason if reason in FINISH_REASONS else "stop"].inc()
        if reason == "abort":
            return
        num_generated = finished.num_generation_tokens
        self.e2e_request_latency.observe(max(0.0, finished.finished_time - finished.arrival_time))
        if finished.first_scheduled_time is not None:
            self.request_queue_time.observe(max(0.0, finished.first_scheduled_time - finished.arrival_time))
        if finished.first_token_time is not None and num_generated > 1:
            self.time_per_output_token.observe(
                max(0.0, finished.finished_time - finished.first_token_time) / (num_generated - 1))
        self.request_prompt_tokens.observe(finished.num_prompt_tokens)
        self.request_generation_tokens.observe(num_generated)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


def merge_metrics(texts: list[bytes]) -> bytes:
    """Several registries' Prometheus text (one per served model, each sample labelled with its ``model_name``) as
    one exposition: each family once, holding every registry's samples."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            merged.samples.extend(family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def served_models_metrics(rows: list[tuple[str, bool, float | None, int]]) -> bytes:
    """The served models of a many-model server (``served_models.py``), per ``model_name``: whether it is loaded, its
    last load's seconds and its size (weights and KV cache, estimated until it first loads)."""
    loaded = GaugeMetricFamily("kvloom:model_loaded", "1 while the served model is loaded, else 0.",
                               labels=["model_name"])
    load_seconds = GaugeMetricFamily("kvloom:model_load_seconds", "Seconds the served model's last load took.",
                                     labels=["model_name"])
    size = GaugeMetricFamily("kvloom:model_size_bytes", "The served model's weight files and KV cache, in bytes "
                             "(its KV cache budget until it first loads).", labels=["model_name"])
    for name, is_loaded, seconds, size_bytes in rows:
        loaded.add_metric([name], 1.0 if is_loaded else 0.0)
        if seconds is not None:
            load_seconds.add_metric([name], seconds)
        size.add_metric([name], float(size_bytes))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([loaded, load_seconds, size]))
    return generate_latest(registry)


class StatLogger:
    """Logs one engine line every ``interval`` seconds while the engine has work, as vLLM does."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.last: EngineStats | None = None
        self.logged_idle = True

    def maybe_log(self, stats: EngineStats) -> None:
        if self.last is None:
            self.last = stats
            return
        elapsed = stats.timestamp - self.last.timestamp
        if elapsed < self.interval:
            return
        scheduler = stats.scheduler
        busy = (scheduler.num_running or scheduler.num_waiting
                or stats.generation_tokens != self.last.generation_tokens
                or stats.prompt_tokens != self.last.prompt_tokens)
        if busy or not self.logged_idle:
            queries = scheduler.prefix_cache_queries - self.last.scheduler.prefix_cache_queries
            hits = scheduler.prefix_cache_hits - self.last.scheduler.prefix_cache_hits
            logger.info(
                "Engine: running %d reqs, waiting %d reqs, KV cache usage %.1f%%, prefix cache hit rate "
                "%.1f%%, prompt throughput %.1f tokens/s, generation throughput %.1f tokens/s",
                scheduler.num_running, scheduler.num_waiting, 100 * scheduler.kv_cache_usage,
                100 * hits / queries if queries else 0.0,
                (stats.prompt_tokens - self.last.prompt_tokens) / elapsed,
                (stats.generation_tokens - self.last.generation_tokens) / elapsed)
            drafts = scheduler.num_drafts - self.last.scheduler.num_drafts
            if drafts:
                # vLLM's line: tokens per speculated step (the drafts accepted + the target's own).
                accepted = scheduler.num_accepted_tokens - self.last.scheduler.num_accepted_tokens
                drafted = scheduler.num_draft_tokens - self.last.scheduler.num_draft_tokens
                per_position = [(now - before) / drafts for now, before in zip(
                    scheduler.num_accepted_tokens_per_pos,
                    self.last.scheduler.num_accepted_tokens_per_pos or (0,) * len(
                        scheduler.num_accepted_tokens_per_pos))]
                logger.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, Drafted: %d "
                            "tokens, Per-position acceptance rate: %s", 1 + accepted / drafts, accepted, drafted,
                            ", ".join(f"{rate:.3f}" for rate in per_position))
            # One more line once it goes idle, so the last line shows the engine at rest.
            self.logged_idle = not busy
        self.last = stats

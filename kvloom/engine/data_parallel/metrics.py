"""The router's ``/metrics``: every replica's metrics (asked of the replicas at each scrape: a
replica renders them only then, never while it steps unasked) with a ``replica`` label, then the
total over the live replicas without one (``kv_cache_usage_perc`` averaged, the rest summed), and
per replica ``kvloom:replica_up`` and ``kvloom:replica_outstanding_tokens``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector


class ReplicaView(Protocol):
    """What the metrics read of a replica, as the router keeps it."""

    index: int
    alive: bool
    outstanding: int
    metrics_text: bytes  # its latest answer to "metrics" (Prometheus text)


class ReplicaMetricsCollector(Collector):
    def __init__(self, replicas: Sequence[ReplicaView], model_name: str) -> None:
        self.replicas = replicas
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        totals: dict[str, dict[tuple, list[float]]] = {}
        for replica in self.replicas:
            if not replica.alive or not replica.metrics_text:
                continue
            for family in text_string_to_metric_families(replica.metrics_text.decode()):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "replica": str(replica.index)}, sample.value)
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    totals.setdefault(family.name, {}).setdefault(key, []).append(sample.value)
        for name, merged in families.items():
            for (sample_name, labels), values in totals.get(name, {}).items():
                value = sum(values) / len(values) if name == "kvloom:kv_cache_usage_perc" else sum(values)
                merged.add_sample(sample_name, dict(labels), value)
            yield merged
        up = Metric("kvloom:replica_up", "1 while the data-parallel replica serves, 0 once it died.", "gauge")
        outstanding = Metric("kvloom:replica_outstanding_tokens",
                             "Tokens the router counts as still owed by the replica (its routing load).", "gauge")
        for replica in self.replicas:
            labels = {"model_name": self.model_name, "replica": str(replica.index)}
            up.add_sample("kvloom:replica_up", labels, 1.0 if replica.alive else 0.0)
            outstanding.add_sample("kvloom:replica_outstanding_tokens", labels, float(replica.outstanding))
        yield up
        yield outstanding


class RouterMetrics:
    """``render()`` as EngineMetrics has it: the replicas' metrics, labelled, and their total."""

    def __init__(self, replicas: Sequence[ReplicaView], model_name: str, refresh: Callable[[], None]) -> None:
        """``replicas``: the router's list (read at each scrape); ``refresh``: asks the live replicas
        for their metrics and waits briefly for the answers."""
        self.refresh = refresh
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ReplicaMetricsCollector(replicas, model_name))

    def render(self) -> bytes:
        self.refresh()
        return generate_latest(self.registry)

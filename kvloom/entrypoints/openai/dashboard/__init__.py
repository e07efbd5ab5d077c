"""``/dashboard``: a live page of the engine's state (``index.html`` beside this file: static HTML
and JS, no build step, nothing from a CDN) and ``/dashboard/stats``, the numbers it plots: one served model's
(``?model=NAME``), and the list of every served model with its status, which the page offers to pick from."""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import Response

from kvloom.metrics import EngineStats

if TYPE_CHECKING:
    from kvloom.entrypoints.openai.served_models import ServedModels

# What /dashboard/stats gives for a model (beside "model" and "models"); null for one not loaded.
STAT_KEYS = ("num_running", "num_waiting", "kv_cache_usage_percent", "prefix_cache_hit_rate_percent",
             "generation_tokens_total", "generation_tokens_per_second", "num_preemptions",
             "spec_decode_acceptance_percent")


class DashboardRates:
    """Generation tokens over the last few seconds of dashboard polls (a rate from two totals)."""

    WINDOW_S = 5.0

    def __init__(self) -> None:
        self.samples: deque[tuple[float, int]] = deque()

    def tokens_per_second(self, now: float, total: int) -> float | None:
        self.samples.append((now, total))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.WINDOW_S:
            self.samples.popleft()
        start, first = self.samples[0]
        return (total - first) / (now - start) if now > start else None


def dashboard_numbers(stats: EngineStats, rates: DashboardRates, model: str) -> dict[str, Any]:
    scheduler = stats.scheduler
    return {
        "model": model,
        "num_running": scheduler.num_running,
        "num_waiting": scheduler.num_waiting,
        "kv_cache_usage_percent": 100.0 * scheduler.kv_cache_usage,
        "prefix_cache_hit_rate_percent": (100.0 * scheduler.prefix_cache_hits / scheduler.prefix_cache_queries
                                          if scheduler.prefix_cache_queries else None),
        "generation_tokens_total": stats.generation_tokens,
        "generation_tokens_per_second": rates.tokens_per_second(time.monotonic(), stats.generation_tokens),
        "num_preemptions": scheduler.num_preemptions,
        "spec_decode_acceptance_percent": (100.0 * scheduler.num_accepted_tokens / scheduler.num_draft_tokens
                                           if scheduler.num_draft_tokens else None),
    }


def dashboard_routes(models: ServedModels) -> APIRouter:
    """``/dashboard`` and ``/dashboard/stats`` over the served models."""
    routes = APIRouter()
    page = (Path(__file__).parent / "index.html").read_text()
    rates: dict[str, DashboardRates] = {}

    @routes.get("/dashboard")
    async def dashboard() -> Response:
        """A live page of the engine's state (static HTML and JS, no build step, nothing from a CDN)."""
        return Response(page, media_type="text/html")

    @routes.get("/dashboard/stats")
    async def dashboard_stats(model: str | None = None) -> dict[str, Any]:
        """The numbers the dashboard plots for ``model`` (default: the default model, else the first loaded one):
        the ones /metrics exports, with rates and ratios worked out; ``models``: every served model and its status."""
        loaded = models.loaded()
        if model is not None:
            chosen = models.resolve(model)
        else:
            chosen = models.default if models.default in loaded or not loaded else loaded[0]
        engine = chosen.engine
        if engine is None:
            numbers: dict[str, Any] = {"model": chosen.name, **dict.fromkeys(STAT_KEYS)}
        else:
            numbers = dashboard_numbers(engine.get_stats(), rates.setdefault(chosen.name, DashboardRates()),
                                        chosen.name)
        numbers["models"] = [{"id": served.name, "status": served.status} for served in models.models.values()]
        return numbers

    return routes

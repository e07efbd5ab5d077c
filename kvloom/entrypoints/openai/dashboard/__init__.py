"""``/dashboard``: a live page of the engine's state (``index.html`` beside this file: static HTML
and JS, no build step, nothing from a CDN) and ``/dashboard/stats``, the numbers it plots."""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from kvloom.engine.engine_client import EngineClient
from kvloom.metrics import EngineStats


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


def dashboard_routes(engine: EngineClient, model: str) -> APIRouter:
    """``/dashboard`` and ``/dashboard/stats`` for ``engine``, serving ``model``."""
    routes = APIRouter()
    page = (Path(__file__).parent / "index.html").read_text()
    rates = DashboardRates()

    @routes.get("/dashboard")
    async def dashboard() -> Response:
        """A live page of the engine's state (static HTML and JS, no build step, nothing from a CDN)."""
        return Response(page, media_type="text/html")

    @routes.get("/dashboard/stats")
    async def dashboard_stats() -> dict[str, Any]:
        """The numbers the dashboard plots: the ones /metrics exports, with rates and ratios worked out."""
        return dashboard_numbers(engine.get_stats(), rates, model)

    return routes

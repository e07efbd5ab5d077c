"""A short soak (benchmarks/soak.py): 8 streaming clients for 10 s, 30% of requests dropped.

The 5-minute, 64-client run is ``benchmarks/soak.py`` itself; this is its fast part for ``make test``.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

# benchmarks/ holds scripts, not a package: soak.py is imported by file name.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from soak import SoakConfig, SoakResult, parse_metrics, run_soak  # noqa: E402


def test_soak_with_disconnects_loses_nothing_and_frees_the_kv_cache(tiny_llama_dir: str,
                                                                    server_factory: Any) -> None:
    with server_factory(tiny_llama_dir, env={"KVLOOM_API_KEY": ""}) as server:
        config = SoakConfig(base_url=server.url, clients=8, duration=10.0, disconnect_fraction=0.3,
                            max_tokens=64, request_timeout=30.0, idle_timeout=10.0)
        result = asyncio.run(run_soak(config, server_pid=server.process.pid))

    assert result.lost == 0, result.lost_examples
    assert result.hung == 0, result.hung_examples
    assert result.completed > 0 and result.disconnected > 0, result
    assert result.sent == result.completed + result.disconnected
    assert result.idle_metrics["kvloom:kv_cache_usage_perc"] == 0
    assert result.idle_metrics["kvloom:num_requests_running"] == 0
    assert result.idle_metrics["kvloom:num_requests_waiting"] == 0
    # RSS is sampled but not judged over 10 s; the slack is only checked to be computed.
    assert {"warm", "end"} <= result.rss_mib.keys()
    assert result.failures(rss_slack_mib=float("inf")) == []


def test_soak_failures_name_what_broke() -> None:
    result = asyncio.run(_no_server_result())
    result.lost, result.hung = 2, 1
    result.idle_metrics = parse_metrics(
        '# HELP kvloom:kv_cache_usage_perc KV-cache usage.\n'
        'kvloom:num_requests_running{model_name="m"} 0.0\n'
        'kvloom:num_requests_waiting{model_name="m"} 0.0\n'
        'kvloom:kv_cache_usage_perc{model_name="m"} 0.25\n')
    result.rss_mib = {"warm": 300.0, "end": 450.0}
    assert result.failures(rss_slack_mib=100.0) == [
        "2 request(s) lost", "1 request(s) hung", "kvloom:kv_cache_usage_perc is 0.25 after the soak",
        "server RSS grew by 150 MiB (> 100)"]


async def _no_server_result() -> Any:
    return SoakResult(config={}, model="m", elapsed=0.0)

"""``kvloom bench agent`` end to end on the tests' tiny random Llama, briefly: 2 conversations x 2 turns
against one server, and against two data-parallel replicas per routing policy. Every turn's reply is a
tool call (tool_choice required holds even a random model to the tools' schemas), the next turn re-sends
the history, and the prefix-cache counters read from /metrics for turns 2+ are checked against the usage
the server reported for each turn: every prompt token queried once, and where each conversation stays on
one cache, at least the previous turn's prompt (its whole blocks) found cached."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvloom.entrypoints.cli import main

BLOCK = 16  # the tiny engine's KV block size
SESSIONS, TURNS = 2, 2  # the tiny model holds 512 tokens: a turn adds about 230 (its byte-level tokens)


def run_bench(server: Any, tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "agent.json"
    code = main(["bench", "agent", "--base-url", server.url, "--sessions", str(SESSIONS), "--turns", str(TURNS),
                 "--system-tokens", "48", "--max-tokens", "64", "--json", str(out), *extra])
    result = json.loads(out.read_text())
    assert code == 0, result["errors"]
    return result


def check_loop(result: dict[str, Any]) -> None:
    assert result["sessions_completed"] == SESSIONS and result["turns_completed"] == SESSIONS * TURNS
    assert result["system_prompt_tokens"] >= 48
    turns = result["turns_detail"]
    for session in range(SESSIONS):
        mine = [t for t in turns if t["session"] == session]
        assert [t["turn"] for t in mine] == list(range(1, TURNS + 1))
        assert all(len(t["tools"]) == 1 and t["ttft"] > 0 for t in mine)
        # Each turn re-sends the whole history, so its prompt grows by the call and the tool's result.
        assert all(b["prompt_tokens"] > a["prompt_tokens"] for a, b in zip(mine, mine[1:]))
    assert [t["completed"] for t in result["per_turn"]] == [SESSIONS] * TURNS


def cached_at_least(result: dict[str, Any]) -> int:
    """Tokens turns 2+ must find cached where every conversation stays on one cache: the previous
    turn's prompt, whole blocks of it (each turn's prompt starts with the one before)."""
    turns = result["turns_detail"]
    return sum((prev["prompt_tokens"] - 1) // BLOCK * BLOCK for prev, t in zip(turns, turns[1:])
               if t["session"] == prev["session"])


def test_bench_agent_against_one_server(tiny_llama_dir: str, server_factory: Any, tmp_path: Path) -> None:
    with server_factory(tiny_llama_dir, env={"KVLOOM_API_KEY": ""}) as server:
        result = run_bench(server, tmp_path)
    check_loop(result)
    rates = result["prefix_cache_turns2_on"]
    assert set(rates) == {"total"}
    prompt_tokens = sum(t["prompt_tokens"] for t in result["turns_detail"] if t["turn"] > 1)
    assert rates["total"]["queries"] == prompt_tokens  # every prompt token of turns 2+ was queried once
    assert rates["total"]["hits"] >= cached_at_least(result)
    assert result["sessions_per_min"] > 0


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two replicas need 2 cores")
@pytest.mark.parametrize("policy", ["prefix", "round_robin"])
def test_bench_agent_reports_each_replicas_hit_rate(tiny_llama_dir: str, server_factory: Any, tmp_path: Path,
                                                    policy: str) -> None:
    with server_factory(tiny_llama_dir, "--data-parallel-size", "2", "--override-backend-config",
                        json.dumps({"data_parallel_routing": policy}), env={"KVLOOM_API_KEY": ""},
                        timeout=300) as server:
        result = run_bench(server, tmp_path, "--label", policy)
    check_loop(result)
    rates = result["prefix_cache_turns2_on"]
    assert set(rates) == {"total", "replica 0", "replica 1"}
    assert rates["total"]["hits"] == rates["replica 0"]["hits"] + rates["replica 1"]["hits"]
    if policy == "prefix":  # each conversation returns to the replica holding its history
        assert rates["total"]["hits"] >= cached_at_least(result)
    else:  # the turns go to the replicas in turn: both compute
        assert rates["replica 0"]["queries"] > 0 and rates["replica 1"]["queries"] > 0

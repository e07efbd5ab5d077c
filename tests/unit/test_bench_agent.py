"""``kvloom bench agent``'s parts without a server: the prefix-cache counters read from Prometheus text
(checked against prometheus_client's own parser, on kvloom's and vLLM's metric names and a data-parallel
router's labelled series), the tool-call pieces of a stream put together, the next turn's history, a
workload that depends only on its seed, and the flags of the server ``--server`` starts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvloom.bench.agent import (
    TOOL_RESULT,
    TOOLS,
    TurnResult,
    build_parser,
    chunk_has_output,
    execute,
    hit_rates,
    merge_tool_call_deltas,
    next_messages,
    prefix_cache_counters,
    server_flags,
    system_words,
    user_task,
)
from kvloom.engine.data_parallel.metrics import RouterMetrics


def exported(prefix: str, values: dict[str | None, tuple[float, float]], extra_label: str | None = None) -> str:
    """Prometheus text of ``<prefix>:prefix_cache_hits/queries`` counters, one series per replica
    label (None: unlabelled), as prometheus_client renders them (``_total`` and ``_created`` samples)."""
    registry = CollectorRegistry()
    labels = ["model_name"] + (["replica"] if any(k is not None for k in values) else []) + (
        [extra_label] if extra_label else [])
    hits = Counter(f"{prefix}:prefix_cache_hits", "hits", labels, registry=registry)
    queries = Counter(f"{prefix}:prefix_cache_queries", "queries", labels, registry=registry)
    other = Counter(f"{prefix}:mm_cache_queries", "not a prefix-cache counter", ["model_name"], registry=registry)
    other.labels(model_name="m").inc(1e6)
    for replica, (h, q) in values.items():
        label_values = {"model_name": "m"} | ({"replica": replica} if replica is not None else {}) | (
            {extra_label: "0"} if extra_label else {})
        hits.labels(**label_values).inc(h)
        queries.labels(**label_values).inc(q)
    return generate_latest(registry).decode()


def oracle(text: str) -> dict[str, float]:
    """prometheus_client's reading: the sum of every prefix_cache_{hits,queries} _total sample."""
    sums = {"hits": 0.0, "queries": 0.0}
    for family in text_string_to_metric_families(text):
        for kind in sums:
            if family.name.endswith(f"prefix_cache_{kind}"):
                sums[kind] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return sums


@pytest.mark.parametrize("prefix", ["kvloom", "vllm"])
def test_prefix_cache_counters_read_as_prometheus_reads_them(prefix: str) -> None:
    text = exported(prefix, {None: (300.0, 1000.0)}, extra_label="engine" if prefix == "vllm" else None)
    counters = prefix_cache_counters(text)
    assert counters == {"hits": {"total": 300.0}, "queries": {"total": 1000.0}}
    assert oracle(text) == {"hits": 300.0, "queries": 1000.0}


def test_a_routers_replicas_and_total_are_read_apart() -> None:
    """The data-parallel router's /metrics as it renders them: each replica's series with its label, then
    the total without one."""
    replicas = [SimpleNamespace(index=i, alive=True, outstanding=0,
                                metrics_text=exported("kvloom", {None: values}).encode())
                for i, values in enumerate([(90.0, 100.0), (30.0, 60.0)])]
    body = generate_latest(RouterMetrics(replicas, "m", lambda: None).registry).decode()
    counters = prefix_cache_counters(body)
    assert counters["hits"] == {"replica 0": 90.0, "replica 1": 30.0, "total": 120.0}
    assert counters["queries"] == {"replica 0": 100.0, "replica 1": 60.0, "total": 160.0}
    by_scope: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if "prefix_cache_" in sample.name and sample.name.endswith("_total"):
                kind = "hits" if "hits" in sample.name else "queries"
                scope = f"replica {sample.labels['replica']}" if "replica" in sample.labels else "total"
                by_scope[(kind, scope)] = sample.value
    assert by_scope == {(kind, scope): value for kind, values in counters.items() for scope, value in values.items()}


def test_hit_rates_are_of_the_tokens_between_two_scrapes() -> None:
    before = {"hits": {"total": 100.0}, "queries": {"total": 400.0}}
    after = {"hits": {"total": 460.0}, "queries": {"total": 800.0}}
    assert hit_rates(before, after) == {"total": {"hits": 360.0, "queries": 400.0, "hit_rate": 0.9}}
    assert hit_rates(None, after) == {}
    assert prefix_cache_counters("# nothing\nkvloom:num_requests_running{model_name=\"m\"} 3.0\n") == {
        "hits": {}, "queries": {}}


def test_streamed_tool_call_pieces_are_put_together() -> None:
    calls: dict[int, dict] = {}
    merge_tool_call_deltas(calls, [{"index": 0, "id": "call_1", "type": "function",
                                    "function": {"name": "search_code", "arguments": ""}}])
    merge_tool_call_deltas(calls, [{"index": 0, "function": {"arguments": '{"query": "x", '}}])
    merge_tool_call_deltas(calls, [{"index": 0, "function": {"arguments": '"max_results": 3}'}}])
    assert calls == {0: {"id": "call_1", "type": "function",
                         "function": {"name": "search_code", "arguments": '{"query": "x", "max_results": 3}'}}}
    assert json.loads(calls[0]["function"]["arguments"]) == {"query": "x", "max_results": 3}


def test_first_output_is_content_a_tool_call_piece_or_a_logprob() -> None:
    assert not chunk_has_output({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert not chunk_has_output({"choices": [], "usage": {"prompt_tokens": 3}})
    assert chunk_has_output({"choices": [{"delta": {}, "logprobs": {"content": [{"token": "[", "logprob": 0}]}}]})
    assert chunk_has_output({"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]})
    assert chunk_has_output({"choices": [{"delta": {"content": "x"}}]})


def test_the_next_turn_appends_the_call_with_null_content_and_the_fixed_result() -> None:
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    call = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a"}'}}
    turn = TurnResult(0, 1, ok=True, tool_calls=[call])
    assert next_messages(history, turn) == [*history, {"role": "assistant", "content": None, "tool_calls": [call]},
                                            {"role": "tool", "tool_call_id": "c1", "content": TOOL_RESULT}]
    assert len(history) == 2  # not changed in place


def test_the_workload_depends_only_on_the_seed() -> None:
    assert system_words(3, 500) == system_words(3, 500) != system_words(4, 500)
    assert len(system_words(3, 500).split()) > 500
    assert user_task(0, 5) == user_task(0, 5) != user_task(0, 6)
    assert all(t["function"]["strict"] and not t["function"]["parameters"]["additionalProperties"] for t in TOOLS)
    assert len(TOOLS) == 3


def test_bad_flags_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="--sessions must be a positive integer"):
        execute(build_parser().parse_args(["--sessions", "0"]))
    with pytest.raises(ValueError, match="--extra-body"):
        execute(build_parser().parse_args(["--extra-body", "{"]))
    for argv, message in ((["--routing", "prefix"], "--server kvloom"),
                          (["--server", "vllm", "--data-parallel-size", "2"], "--server kvloom"),
                          (["--server", "kvloom", "--routing", "round_robin"], "--data-parallel-size 2 or more")):
        with pytest.raises(ValueError, match=message):
            execute(build_parser().parse_args(argv))


def test_the_started_servers_flags_and_the_runs_label() -> None:
    def flags(*argv: str) -> tuple[list[str], str | None]:
        return server_flags(build_parser().parse_args(list(argv)))

    assert flags() == ([], None)
    assert flags("--server", "kvloom") == ([], "kvloom")
    # vLLM parses Hermes tool calls only when told to (kvloom's parser is on by default).
    assert flags("--server", "vllm") == (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], "vllm")
    assert flags("--server", "kvloom", "--data-parallel-size", "2") == (
        ["--data-parallel-size", "2"], "kvloom dp=2 prefix")
    dp_flags, label = flags("--server", "kvloom", "--data-parallel-size", "2", "--routing", "round_robin")
    assert dp_flags[:3] == ["--data-parallel-size", "2", "--override-backend-config"]
    assert label == "kvloom dp=2 round_robin"
    assert json.loads(dp_flags[3]) == {"data_parallel_routing": "round_robin"}

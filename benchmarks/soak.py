"""A bounded soak of an OpenAI-compatible server: many streams, random disconnects, then checks.

Against a running server (no RSS check: its pid is unknown):
    .venv/bin/python benchmarks/soak.py --base-url http://127.0.0.1:8000 --clients 64 --duration 300
Starting kvloom too (SmolLM2-135M-Instruct, or --model DIR), stopped at the end:
    .venv/bin/python benchmarks/soak.py --server kvloom --clients 64 --duration 300
    .venv/bin/python benchmarks/soak.py --server kvloom --model /tmp/tiny --max-model-len 512 \
        --clients 32 --duration 60

Its fast part (8 clients, 10 s) is ``tests/e2e/test_soak.py``.

``--clients`` closed-loop clients each send streamed ``/v1/completions`` or
``/v1/chat/completions`` requests (half each) with a random ``max_tokens`` in
[1, ``--max-tokens``] until ``--duration`` seconds have passed. A ``--disconnect-fraction`` of
the requests close the connection after a random number of events in [0, max_tokens] (0: right
after the headers); those whose stream ends first count as completed, so somewhat fewer than that
fraction are reported disconnected.
One round of requests first warms the server up; the RSS baseline is taken after it.

Checked at the end (exit code 1 when one fails):

- lost 0: every request that was not dropped got HTTP 200, a ``finish_reason`` and ``[DONE]``;
- hung 0: every request ended (finished or dropped) within ``--request-timeout`` seconds;
- idle: within ``--idle-timeout`` seconds of the last request, ``/metrics`` shows
  ``kvloom:num_requests_running`` and ``kvloom:num_requests_waiting`` 0 and
  ``kvloom:kv_cache_usage_perc`` 0;
- RSS flat (only when the server's pid is known, i.e. this process started it): the server's
  VmRSS at the end is at most ``--rss-slack-mib`` above its VmRSS after the warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from kvloom.bench import common
from kvloom.bench.servers import Server, add_server_options

WORDS = ("the", "fox", "robot", "library", "sun", "number", "story", "code", "river", "city",
         "quiet", "bright", "runs", "writes", "sings", "over", "under", "and", "of", "a")


@dataclass
class SoakConfig:
    base_url: str
    clients: int = 64
    duration: float = 300.0
    disconnect_fraction: float = 0.3
    max_tokens: int = 128
    request_timeout: float = 120.0
    idle_timeout: float = 30.0
    rss_slack_mib: float = 100.0
    seed: int = 0
    model: str | None = None
    api_key: str | None = None


@dataclass
class Outcome:
    """One request as the client saw it."""

    endpoint: str
    max_tokens: int
    disconnect_after: int | None  # events to read before closing; None: read to the end
    status: int = 0
    events: int = 0
    finish_reason: str | None = None
    done: bool = False
    dropped: bool = False  # the client closed the connection on purpose
    hung: bool = False
    error: str | None = None
    latency: float = 0.0

    @property
    def lost(self) -> bool:
        """A request read to the end that did not end the way the API promises."""
        if self.dropped or self.hung:
            return False
        return self.status != 200 or self.error is not None or not self.done or self.finish_reason is None


@dataclass
class SoakResult:
    config: dict[str, Any]
    model: str
    elapsed: float
    sent: int = 0
    completed: int = 0
    disconnected: int = 0
    lost: int = 0
    hung: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    lost_examples: list[dict[str, Any]] = field(default_factory=list)
    hung_examples: list[dict[str, Any]] = field(default_factory=list)
    idle_metrics: dict[str, float] = field(default_factory=dict)
    idle_after_s: float = float("nan")
    rss_mib: dict[str, float] = field(default_factory=dict)  # warm (the baseline), mid, end, max

    def failures(self, rss_slack_mib: float) -> list[str]:
        """What broke the server's contract; empty when every check passed."""
        failed = []
        if self.lost:
            failed.append(f"{self.lost} request(s) lost")
        if self.hung:
            failed.append(f"{self.hung} request(s) hung")
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            value = self.idle_metrics.get(f"kvloom:{name}")
            if value is None:
                failed.append(f"/metrics has no kvloom:{name}")
            elif value != 0:
                failed.append(f"kvloom:{name} is {value} after the soak")
        if "warm" in self.rss_mib and "end" in self.rss_mib:
            growth = self.rss_mib["end"] - self.rss_mib["warm"]
            if growth > rss_slack_mib:
                failed.append(f"server RSS grew by {growth:.0f} MiB (> {rss_slack_mib:.0f})")
        return failed


# ---------------------------------------------------------------------------------------------
# Server state: /metrics and /proc
# ---------------------------------------------------------------------------------------------

def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled-by-name samples of a Prometheus text page (labels dropped, last value wins)."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_and_labels, _, value = line.rpartition(" ")
        name = name_and_labels.split("{", 1)[0]
        try:
            samples[name] = float(value)
        except ValueError:
            continue
    return samples


async def fetch_metrics(client: Any, base_url: str, headers: dict[str, str]) -> dict[str, float]:
    resp = await client.get(base_url + "/metrics", headers=headers, timeout=10)
    resp.raise_for_status()
    return parse_metrics(resp.text)


async def wait_idle(client: Any, base_url: str, headers: dict[str, str],
                    timeout: float) -> tuple[dict[str, float], float]:
    """Poll /metrics until nothing runs, waits or holds KV blocks; the last sample and the wait."""
    start = time.perf_counter()
    while True:
        metrics = await fetch_metrics(client, base_url, headers)
        idle = all(metrics.get(f"kvloom:{name}", 1) == 0
                   for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))
        waited = time.perf_counter() - start
        if idle or waited > timeout:
            return metrics, waited
        await asyncio.sleep(0.1)


def rss_mib(pid: int | None) -> float | None:
    """The current resident memory (VmRSS) of a process, or None when it cannot be read."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


# ---------------------------------------------------------------------------------------------
# The clients
# ---------------------------------------------------------------------------------------------

def random_request(rng: random.Random, model: str, max_tokens: int,
                   disconnect_fraction: float) -> tuple[str, dict[str, Any], int | None]:
    """(path, body, events to read before disconnecting or None)."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    tokens = rng.randint(1, max_tokens)
    body: dict[str, Any] = {"model": model, "max_tokens": tokens, "stream": True,
                            "temperature": rng.choice((0.0, 0.8)), "seed": rng.randint(0, 2**31 - 1)}
    if rng.random() < 0.5:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": text}]
    else:
        path = "/v1/completions"
        body["prompt"] = text
    if rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    disconnect_after = rng.randint(0, tokens) if rng.random() < disconnect_fraction else None
    return path, body, disconnect_after


async def stream_request(client: Any, url: str, body: dict[str, Any], headers: dict[str, str],
                         outcome: Outcome) -> None:
    """Read one stream into ``outcome``; closes the connection early when it is to disconnect."""
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        outcome.status = resp.status_code
        if resp.status_code != 200:
            outcome.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
            return
        if outcome.disconnect_after == 0:
            outcome.dropped = True
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                outcome.done = True
                return
            chunk = json.loads(payload)
            if "error" in chunk:
                outcome.error = f"stream error: {str(chunk['error'])[:300]}"
                continue
            for choice in chunk.get("choices") or []:
                if choice.get("finish_reason"):
                    outcome.finish_reason = choice["finish_reason"]
            outcome.events += 1
            if outcome.disconnect_after is not None and outcome.events >= outcome.disconnect_after:
                outcome.dropped = True
                return


async def one_request(client: Any, config: SoakConfig, model: str, headers: dict[str, str],
                      rng: random.Random, disconnect_fraction: float) -> Outcome:
    path, body, disconnect_after = random_request(rng, model, config.max_tokens, disconnect_fraction)
    outcome = Outcome(path, body["max_tokens"], disconnect_after)
    start = time.perf_counter()
    try:
        await asyncio.wait_for(stream_request(client, config.base_url + path, body, headers, outcome),
                               config.request_timeout)
    except TimeoutError:
        outcome.hung = True
    except Exception as e:  # noqa: BLE001 - a transport failure is a lost request
        outcome.error = f"{type(e).__name__}: {e}"[:300]
    outcome.latency = time.perf_counter() - start
    return outcome


async def fetch_model_name(client: Any, base_url: str, headers: dict[str, str]) -> str:
    resp = await client.get(base_url + "/v1/models", headers=headers, timeout=30)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def run_soak(config: SoakConfig, server_pid: int | None = None) -> SoakResult:
    """Warm up, soak for ``config.duration`` seconds, wait for idle, and gather the figures."""
    import httpx

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.clients + 8, max_keepalive_connections=config.clients + 8)
    # No overall timeout here: each request is bounded by request_timeout through wait_for.
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None)) as client:
        model = config.model or await fetch_model_name(client, config.base_url, headers)
        rng = random.Random(config.seed)
        rss: dict[str, float] = {}

        def sample_rss(name: str) -> None:
            value = rss_mib(server_pid)
            if value is not None:
                rss[name] = value
                rss["max"] = max(rss.get("max", 0.0), value)

        # Warm-up: one round of full-length, undisturbed requests, so allocator pools and caches
        # are filled before the RSS baseline.
        await asyncio.gather(*(one_request(client, config, model, headers, rng, 0.0)
                               for _ in range(config.clients)))
        sample_rss("warm")

        outcomes: list[Outcome] = []
        start = time.perf_counter()
        deadline = start + config.duration

        async def client_loop(index: int) -> None:
            client_rng = random.Random(config.seed * 100_003 + index)
            while time.perf_counter() < deadline:
                outcomes.append(await one_request(client, config, model, headers, client_rng,
                                                  config.disconnect_fraction))

        async def watch_rss() -> None:
            mid_at = start + config.duration / 2
            while time.perf_counter() < deadline:
                sample_rss("max")
                if "mid" not in rss and time.perf_counter() >= mid_at:
                    sample_rss("mid")
                await asyncio.sleep(1.0)

        await asyncio.gather(watch_rss(), *(client_loop(i) for i in range(config.clients)))
        elapsed = time.perf_counter() - start
        idle_metrics, idle_after = await wait_idle(client, config.base_url, headers, config.idle_timeout)
        sample_rss("end")

    result = SoakResult(config=asdict(config), model=model, elapsed=elapsed, idle_metrics=idle_metrics,
                        idle_after_s=idle_after, rss_mib=rss)
    result.config.pop("api_key", None)
    reasons: Counter[str] = Counter()
    for outcome in outcomes:
        result.sent += 1
        if outcome.hung:
            result.hung += 1
            result.hung_examples.append(asdict(outcome))
        elif outcome.dropped:
            result.disconnected += 1
        elif outcome.lost:
            result.lost += 1
            result.lost_examples.append(asdict(outcome))
        else:
            result.completed += 1
            reasons[str(outcome.finish_reason)] += 1
    result.finish_reasons = dict(reasons)
    del result.lost_examples[10:], result.hung_examples[10:]
    return result


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def add_soak_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of soak after warm-up")
    parser.add_argument("--disconnect-fraction", type=float, default=0.3,
                        help="fraction of requests that close the connection at a random point")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens is uniform in [1, this]")
    parser.add_argument("--request-timeout", type=float, default=120.0,
                        help="a request that has not ended after this many seconds is hung")
    parser.add_argument("--idle-timeout", type=float, default=30.0,
                        help="seconds the server gets to go idle after the soak")
    parser.add_argument("--rss-slack-mib", type=float, default=100.0,
                        help="allowed growth of the server's RSS from after the warm-up to the end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="model name in requests (default: /v1/models' first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--json", default=None, help="write the result here (- for stdout)")


def config_from_args(args: argparse.Namespace, base_url: str) -> SoakConfig:
    for name in ("clients", "duration", "max_tokens", "request_timeout"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 <= args.disconnect_fraction <= 1:
        raise SystemExit(f"--disconnect-fraction must be in [0, 1], got {args.disconnect_fraction}")
    return SoakConfig(base_url=base_url.rstrip("/"), clients=args.clients, duration=args.duration,
                      disconnect_fraction=args.disconnect_fraction, max_tokens=args.max_tokens,
                      request_timeout=args.request_timeout, idle_timeout=args.idle_timeout,
                      rss_slack_mib=args.rss_slack_mib, seed=args.seed, model=args.model,
                      api_key=args.api_key)


def report(result: SoakResult, failures: list[str]) -> None:
    config = result.config
    metrics = result.idle_metrics
    rss = result.rss_mib
    rows: list[tuple[str, Any]] = [
        ("model", result.model),
        ("clients", config["clients"]),
        ("seconds, to the last request's end", result.elapsed),
        ("requests sent", result.sent),
        ("completed", result.completed),
        ("disconnected", result.disconnected),
        ("lost", result.lost),
        ("hung", result.hung),
        ("finish reasons", result.finish_reasons),
        ("idle after (s)", result.idle_after_s),
        ("running / waiting after", f"{metrics.get('kvloom:num_requests_running', 'n/a')} / "
                                    f"{metrics.get('kvloom:num_requests_waiting', 'n/a')}"),
        ("KV usage after", metrics.get("kvloom:kv_cache_usage_perc", "n/a")),
        ("server RSS MiB warm/mid/end/max",
         " / ".join(f"{rss[k]:.0f}" if k in rss else "n/a" for k in ("warm", "mid", "end", "max"))
         if rss else "n/a (server pid unknown)"),
        ("result", "PASS" if not failures else "FAIL: " + "; ".join(failures)),
    ]
    common.print_result("soak", rows)
    for example in result.lost_examples + result.hung_examples:
        print(f"  {example}")


def soak_main(argv: list[str], server_pid: int | None = None) -> int:
    """The soak against ``--base-url``; ``server_pid`` (a server this process started) adds the RSS check."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    add_soak_options(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args, args.base_url)
    result = asyncio.run(run_soak(config, server_pid))
    failures = result.failures(config.rss_slack_mib)
    report(result, failures)
    common.write_json(args.json, {"benchmark": "soak", **asdict(result), "failures": failures})
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    launcher = argparse.ArgumentParser(add_help=False)
    add_server_options(launcher, servers=("kvloom",))
    launcher.add_argument("--model", default=None, help="with --server: a checkpoint folder to serve")
    launcher.add_argument("--max-model-len", type=int, default=1024)
    args, rest = launcher.parse_known_args(argv)
    if args.server is None:
        if args.model is not None:
            rest = ["--model", args.model, *rest]  # the requests' model name
        return soak_main(rest)

    with Server(args.server, port=args.port, num_seqs=args.num_seqs, max_model_len=args.max_model_len,
                extra=args.server_arg, model=args.model) as server:
        print(f"{args.server} server ready in {server.startup_s:.1f} s at {server.base_url} "
              f"(pid {server.process.pid}, log {server.log_path})", flush=True)
        return soak_main(["--base-url", server.base_url, *rest], server_pid=server.process.pid)


if __name__ == "__main__":
    sys.exit(main())

"""Serving under Poisson load, kvloom against a peer: where does each server's TPOT p50 double?

For each server in turn (the peer first; each started and stopped here, see kvloom.bench.servers):
1. idle: requests one at a time (``--idle-requests``), their TPOT p50 is the server's idle value;
2. Poisson arrivals at each ``--rates`` value, ``--duration`` seconds of arrivals (at least
   ``--min-requests`` requests), the standard workload's prompts, 128 output tokens, streamed;
3. the rate where TPOT p50 reaches twice the idle value ("doubling rate"), interpolated linearly
   between the two measured rates around it (from the idle point when the lowest rate is already past
   it: give rates that bracket it).
kvloom then also runs at the peer's doubling rate, where the issue compares TTFT p99 and TPOT p99.

    .venv/bin/python benchmarks/serve_sweep.py                       # vLLM, then kvloom
    .venv/bin/python benchmarks/serve_sweep.py --rates 0.5,1,2,3,4 --duration 30 --json sweep.json
    .venv/bin/python benchmarks/serve_sweep.py --servers kvloom      # kvloom alone
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from typing import Any

from kvloom.bench import common, serve, workload
from kvloom.bench.servers import Server


def measure(base_url: str, num_prompts: int, rate: float, concurrency: int | None, seed: int,
            max_tokens: int) -> dict[str, Any]:
    prompts = workload.make_workload(num_prompts, seed=seed)
    results, duration, _ = asyncio.run(serve.run_load(
        base_url, prompts, request_rate=rate, concurrency=concurrency, seed=seed, max_tokens=max_tokens,
        num_warmup=1))
    summary = serve.summarize_results(results, duration)
    return {"rate": rate, "requests": num_prompts, **summary}


def doubling_rate(idle_tpot: float, points: list[dict[str, Any]]) -> float | None:
    """The rate where TPOT p50 first reaches 2x idle, linear between the measured rates around it;
    None if no measured rate reaches it (the server sustains every rate tried)."""
    target = 2 * idle_tpot
    previous_rate, previous_tpot = 0.0, idle_tpot
    for point in sorted(points, key=lambda p: p["rate"]):
        tpot = point["tpot_ms"]["p50"]
        if tpot >= target:
            if tpot == previous_tpot:
                return point["rate"]
            return previous_rate + (point["rate"] - previous_rate) * (target - previous_tpot) / (tpot - previous_tpot)
        previous_rate, previous_tpot = point["rate"], tpot
    return None


def row(label: str, point: dict[str, Any]) -> str:
    return (f"{label:>10} {point['completed']:>5} {point['ttft_ms']['p50']:>9.0f} {point['ttft_ms']['p99']:>9.0f} "
            f"{point['tpot_ms']['p50']:>9.1f} {point['tpot_ms']['p99']:>9.1f} {point['output_tok_s']:>9.1f}")


def sweep(name: str, rates: list[float], args: argparse.Namespace) -> dict[str, Any]:
    with Server(name, port=args.port, num_seqs=args.num_seqs) as server:
        print(f"\n== {name}: ready in {server.startup_s:.1f} s ==", flush=True)
        print(f"{'rate/s':>10} {'done':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
              f"{'out tok/s':>9}   (ms)", flush=True)
        idle = measure(server.base_url, args.idle_requests, math.inf, 1, args.seed, args.max_tokens)
        print(row("idle", idle), flush=True)
        points = []
        for rate in rates:
            n = max(args.min_requests, round(rate * args.duration))
            point = measure(server.base_url, n, rate, None, args.seed, args.max_tokens)
            points.append(point)
            print(row(f"{rate:g}", point), f"load {common.machine_info()['loadavg'][0]}", flush=True)
    idle_tpot = idle["tpot_ms"]["p50"]
    doubling = doubling_rate(idle_tpot, points)
    said = f"{doubling:.2f} req/s" if doubling is not None else f"beyond {max(rates):g} req/s"
    print(f"{name}: idle TPOT p50 {idle_tpot:.1f} ms; TPOT p50 doubles at {said}", flush=True)
    return {"server": name, "startup_s": server.startup_s, "idle": idle, "points": points,
            "doubling_rate": doubling}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="vllm,kvloom", help="comma-separated, peer first (default vllm,kvloom)")
    parser.add_argument("--rates", default="0.25,0.5,1,1.5,2,3", help="Poisson rates in requests/s")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per rate")
    parser.add_argument("--min-requests", type=int, default=12)
    parser.add_argument("--idle-requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write every point as JSON ('-': stdout)")
    args = parser.parse_args(argv)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    try:
        rates = sorted(float(r) for r in args.rates.split(","))
    except ValueError:
        raise SystemExit(f"--rates must be comma-separated numbers, got {args.rates!r}") from None
    if not rates or any(r <= 0 or math.isinf(r) for r in rates):
        raise SystemExit(f"--rates must be positive and finite, got {args.rates!r}")

    results = []
    for name in servers:
        extra = []
        if name == "kvloom" and results and results[0]["doubling_rate"] is not None:
            extra = [round(results[0]["doubling_rate"], 3)]  # where the issue compares the tails
        results.append(sweep(name, sorted(set(rates + extra)), args))

    if len(results) == 2 and results[0]["doubling_rate"] is not None:
        peer, base = results
        rate = round(peer["doubling_rate"], 3)
        at = next((p for p in base["points"] if p["rate"] == rate), None)
        peer_at = min(peer["points"], key=lambda p: abs(p["rate"] - rate))
        print(f"\n== at {peer['server']}'s doubling rate, {rate:g} req/s (the peer: its nearest measured "
              f"rate, {peer_at['rate']:g}) ==")
        if at is not None:
            for key in ("ttft_ms", "tpot_ms"):
                print(f"{key[:4].upper()} p99: {base['server']} {at[key]['p99']:.1f} ms, "
                      f"{peer['server']} {peer_at[key]['p99']:.1f} ms")
        if base["doubling_rate"] is not None:
            print(f"doubling rate: {base['server']} {base['doubling_rate']:.2f} / {peer['server']} "
                  f"{peer['doubling_rate']:.2f} req/s = {base['doubling_rate'] / peer['doubling_rate']:.2f}x")
        else:
            print(f"doubling rate: {base['server']} beyond {max(rates):g} req/s; {peer['server']} "
                  f"{peer['doubling_rate']:.2f} req/s")
    common.write_json(args.json, {"servers": results, "machine": common.machine_info()})
    return 0


if __name__ == "__main__":
    sys.exit(main())

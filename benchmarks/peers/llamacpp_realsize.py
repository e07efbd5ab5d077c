"""kvloom against llama.cpp and ik_llama.cpp on one real-size GGUF file, alternated, side by side.

    .venv/bin/python benchmarks/peers/llamacpp_realsize.py --model llama-3.2-1b:q4_k_m
    .venv/bin/python benchmarks/peers/llamacpp_realsize.py --model llama-3.2-3b:q4_k_m --tests tg128,pp512,b16
    .venv/bin/python benchmarks/peers/llamacpp_realsize.py --model FILE.gguf --rounds 3 --json out.json
    .venv/bin/python benchmarks/peers/llamacpp_realsize.py --model llama-3.2-3b:q4_k_m --tests b16 --batched-peer server
    .venv/bin/python benchmarks/peers/llamacpp_realsize.py --model llama-3.2-1b:q4_k_m --peers llama.cpp
    KVLOOM_CPU_ISA=avx2 .venv/bin/python benchmarks/peers/llamacpp_realsize.py --model llama-3.2-1b:q4_k_m \
        --llamacpp-bin .peers/llamacpp/bin-avx2 --peers llama.cpp  # both engines at AVX2 on a CPU with more

The file is a ``SHAPE:FORMAT`` of kvloom/bench/realsize_shapes.py (made by make_realsize_gguf.py) or a path.
First the read bandwidth is measured (``kvloom.bench.membw``, 1 and 2 threads). Then ``--rounds`` rounds,
each running every engine once (the order rotates between rounds) while holding the lock of
``flock /tmp/kvloom-bench.lock`` (one round at a time), so no other timed benchmark on the box runs beside it.
The peers (``--peers``, default both), 2 threads each:
- llama.cpp (``LLAMACPP_TOOLS_ONLY=1 bash benchmarks/peers/setup_llamacpp.sh``) with its defaults;
- ik_llama.cpp (``bash benchmarks/peers/setup_ikllamacpp.sh``) with its best CPU flags, ``-rtr`` (its
  row-interleaved repack at load, which also turns mmap off) and ``-fa on`` (its flash attention; llama-bench's
  spelling ``-rtr 1 -fa 1``);
each as ``llama-bench -m FILE -t 2 -r 1 -p 0 -n 128`` (tgN), ``-p N -n 0`` (ppN); ``llama-batched-bench -m FILE
-t 2 -npp 64 -ntg 128 -npl N`` (bN, its S_TG), or with ``--batched-peer server`` ``llama-server -m FILE -t 2 -np N``
(N slots, continuous batching) given N concurrent 64-token prompts of 128 tokens each (bN: the tokens generated
over the longest request's generation time, as the server's own timings give them); ``llama-server -m FILE -t 2``
started until /health answers, for time to ready and resident memory (VmRSS) after load (``ready``);
- kvloom: ``kvloom bench realsize --model FILE --tests ... --num-iters 1`` (one warm-up run per test), with
  the bandwidth measured above.
Medians over the rounds with their spread; decode at one sequence is also given as a fraction of the
bandwidth bound (kvloom/bench/realsize.py: weights read per token + KV at the mean context, every engine
against the same bytes, those of the file).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvloom.bench import common  # noqa: E402
from kvloom.bench.realsize import (  # noqa: E402
    PROMPT_LEN,
    bound_tok_s,
    gguf_traffic,
    mean_context,
    parse_tests,
    random_prompts,
    test_name,
)
from kvloom.bench.realsize_shapes import resolve_model  # noqa: E402

LOCK = "/tmp/kvloom-bench.lock"
THREADS = 2


@dataclass(frozen=True)
class Peer:
    """A llama.cpp-family engine: its tools' folder, the setup command that builds them, and the flags it runs
    with: ``flags`` for llama-batched-bench and llama-server, ``bench_flags`` for llama-bench (which spells them
    as lists of values)."""

    name: str
    bin: Path
    setup: str
    flags: tuple[str, ...] = ()
    bench_flags: tuple[str, ...] = ()

    def tool(self, name: str) -> str:
        path = self.bin / name
        if not path.is_file():
            raise SystemExit(f"{self.name}: {path} is missing: {self.setup}")
        return str(path)


PEERS = {
    "llama.cpp": Peer("llama.cpp", ROOT / ".peers" / "llamacpp" / "bin",
                      "LLAMACPP_TOOLS_ONLY=1 bash benchmarks/peers/setup_llamacpp.sh"),
    "ik_llama.cpp": Peer("ik_llama.cpp", ROOT / ".peers" / "ikllamacpp" / "bin",
                         "bash benchmarks/peers/setup_ikllamacpp.sh", ("-rtr", "-fa", "on"), ("-rtr", "1", "-fa", "1")),
}


@contextlib.contextmanager
def bench_lock() -> Iterator[None]:
    """The shared benchmark lock (``flock /tmp/kvloom-bench.lock``), held for one round of both engines."""
    with open(LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def llama_bench(peer: Peer, path: Path, kind: str, n: int) -> float:
    """llama-bench's tok/s for one ppN or tgN run."""
    p, g = (n, 0) if kind == "pp" else (0, n)
    argv = [peer.tool("llama-bench"), "-m", str(path), "-t", str(THREADS), "-r", "1", "-p", str(p), "-n", str(g),
            "-o", "json", *peer.bench_flags]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    return float(rows[0]["avg_ts"])


# A result row of llama-batched-bench's table: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | ...
BATCHED_ROW = re.compile(r"^\|\s*\d+\s*\|\s*\d+\s*\|\s*\d+\s*\|\s*\d+\s*\|(?:\s*[\d.]+\s*\|){3}\s*([\d.]+)\s*\|")


def llama_batched_bench(peer: Peer, path: Path, n: int) -> float:
    """llama-batched-bench's aggregate decode tok/s (S_TG) of N sequences of 64-token prompts, 128 tokens (its
    JSON line where it prints one, llama.cpp; else its table's row, ik_llama.cpp)."""
    ctx = n * (PROMPT_LEN + 128)
    argv = [peer.tool("llama-batched-bench"), "-m", str(path), "-t", str(THREADS), "-c", str(ctx),
            "-npp", str(PROMPT_LEN), "-ntg", "128", "-npl", str(n), *peer.flags]
    if peer.name == "llama.cpp":
        argv += ["--output-format", "jsonl"]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    out = done.stdout + done.stderr
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if rows:
        return float(rows[-1]["speed_tg"])
    table = [m for m in map(BATCHED_ROW.match, out.splitlines()) if m]
    if not table:
        raise RuntimeError(f"{peer.name}'s llama-batched-bench printed no result:\n{out[-2000:]}")
    return float(table[-1].group(1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def llama_server(peer: Peer, path: Path, *extra: str) -> Iterator[tuple[subprocess.Popen, int, float]]:
    """The peer's llama-server on the file, started until /health answers: (process, port, seconds to ready)."""
    port = free_port()
    argv = [peer.tool("llama-server"), "-m", str(path), "-t", str(THREADS), "--port", str(port), *peer.flags,
            *extra]
    with open(os.devnull, "wb") as devnull:
        started = time.time()
        proc = subprocess.Popen(argv, stdout=devnull, stderr=devnull, start_new_session=True)
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{peer.name}'s llama-server exited with {proc.returncode}: {' '.join(argv)}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                        if resp.status == 200:
                            break
                except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                    pass
                if time.time() - started > 600:
                    raise RuntimeError("llama-server not ready after 600 s")
                time.sleep(0.02)
            yield proc, port, time.time() - started
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)


def llama_server_ready(peer: Peer, path: Path) -> dict[str, float]:
    """Seconds from launching llama-server on the file until /health answers, and its VmRSS then (MiB)."""
    with llama_server(peer, path, "-c", "4096") as (proc, _, ready):
        status = Path(f"/proc/{proc.pid}/status").read_text()
        rss_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return {"ready_s": ready, "rss_mib": rss_kib / 1024}


def llama_server_batch(peer: Peer, path: Path, n: int, vocab: int) -> float:
    """Aggregate decode tok/s of llama-server with N slots serving N concurrent requests (64-token prompts
    of random ids, as kvloom's bN, 128 tokens each, EOS ignored): the tokens generated over the longest
    request's generation time (the server's timings.predicted_ms), as llama-batched-bench's S_TG."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = random_prompts(n, PROMPT_LEN, vocab, seed=0)
    with llama_server(peer, path, "-np", str(n), "-c", str(n * (PROMPT_LEN + 128 + 16))) as (_, port, _ready):
        def complete(prompt: list[int], tokens: int = 128) -> dict[str, Any]:
            body = json.dumps({"prompt": prompt, "n_predict": tokens, "temperature": 0, "ignore_eos": True,
                               "cache_prompt": False}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=1800) as resp:
                return json.loads(resp.read())

        complete(prompts[0], 4)  # warm-up
        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(complete, prompts))
    generated = sum(int(r["timings"]["predicted_n"]) for r in results)
    longest_ms = max(float(r["timings"]["predicted_ms"]) for r in results)
    if generated != n * 128:
        raise RuntimeError(f"{peer.name}'s llama-server generated {generated} tokens, expected {n * 128}")
    return generated / (longest_ms / 1e3)


def peer_round(peer: Peer, path: Path, tests: list[tuple[str, int]], ready: bool, batched_peer: str,
               vocab: int) -> dict[str, float]:
    figures: dict[str, float] = {}
    for kind, n in tests:
        if kind != "b":
            figures[test_name(kind, n)] = llama_bench(peer, path, kind, n)
        elif batched_peer == "server":
            figures[test_name(kind, n)] = llama_server_batch(peer, path, n, vocab)
        else:
            figures[test_name(kind, n)] = llama_batched_bench(peer, path, n)
    if ready:
        figures.update(llama_server_ready(peer, path))
    return figures


def kvloom_round(path: Path, tests: list[tuple[str, int]], bandwidth: float, extra: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "kvloom.json"
        argv = [sys.executable, "-m", "kvloom.entrypoints.cli", "bench", "realsize", "--model", str(path),
                "--tests", ",".join(test_name(k, n) for k, n in tests), "--num-iters", "1",
                "--bandwidth-gb-s", str(bandwidth), "--json", str(out), *extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        subprocess.run(argv, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
    figures: dict[str, Any] = {row["test"]: row["tok_s"] for row in result["tests"]}
    figures.update(ready_s=result["ready_s"], rss_mib=result["rss_after_load_mib"],
                   huge_pages_mib=result.get("huge_pages_end_mib") or 0.0)
    return figures


def probe_bandwidth() -> dict[int, float]:
    code = ("import json; from kvloom.bench.membw import read_bandwidth; "
            "print(json.dumps({t: read_bandwidth(t)['best_gb_s'] for t in (1, 2)}))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return {int(k): float(v) for k, v in json.loads(out.strip().splitlines()[-1]).items()}


def fmt(values: list[float], digits: int = 1) -> str:
    if not values:
        return "n/a"
    return f"{common.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a .gguf file or SHAPE:FORMAT")
    ap.add_argument("--tests", default="tg128,pp512,pp2048,b4,b16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of {', '.join(PEERS)}")
    ap.add_argument("--no-ready", dest="ready", action="store_false",
                    help="skip the peers' llama-server time to ready and resident memory")
    ap.add_argument("--batched-peer", choices=("batched-bench", "server"), default="batched-bench",
                    help="bN against llama-batched-bench -npl N (default) or llama-server with N slots")
    ap.add_argument("--llamacpp-bin", metavar="DIR",
                    help="llama.cpp's tools (.peers/llamacpp/bin-avx2: the AVX2 build of LLAMACPP_ISA=avx2 "
                         "setup_llamacpp.sh, beside KVLOOM_CPU_ISA=avx2 for kvloom)")
    ap.add_argument("--ikllamacpp-bin", metavar="DIR", help="ik_llama.cpp's tools (default .peers/ikllamacpp/bin)")
    ap.add_argument("--kvloom-arg", action="append", default=[], metavar="ARG",
                    help="extra flag for kvloom bench realsize, e.g. --kvloom-arg=--engine-arg=...")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if not args.model:
        ap.error("--model is required")
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    names = [name.strip() for name in args.peers.split(",") if name.strip()]
    unknown = [name for name in names if name not in PEERS]
    if unknown or not names:
        raise SystemExit(f"--peers: unknown {unknown or names}; choose from {', '.join(PEERS)}")
    bins = {"llama.cpp": args.llamacpp_bin, "ik_llama.cpp": args.ikllamacpp_bin}
    peers = [PEERS[name] if bins[name] is None else replace(PEERS[name], bin=Path(bins[name])) for name in names]
    for peer in peers:
        peer.tool("llama-bench")  # a missing build is named before anything runs
    tests = parse_tests(args.tests)
    path = resolve_model(args.model)
    traffic = gguf_traffic(path)
    machine = common.machine_info()
    with bench_lock():
        bandwidth = probe_bandwidth()
    print(f"read bandwidth: {bandwidth[1]:.1f} GB/s (1 thread), {bandwidth[2]:.1f} GB/s (2 threads); "
          f"load average {machine['loadavg']}", flush=True)
    engines = ["kvloom", *(peer.name for peer in peers)]
    by_name = {peer.name: peer for peer in peers}
    runs: dict[str, list[dict[str, Any]]] = {engine: [] for engine in engines}
    for r in range(args.rounds):
        order = engines[r % len(engines):] + engines[:r % len(engines)]
        if r % 2 == 0:
            order.reverse()
        with bench_lock():
            for engine in order:
                if engine == "kvloom":
                    figures = kvloom_round(path, tests, bandwidth[THREADS], args.kvloom_arg)
                else:
                    figures = peer_round(by_name[engine], path, tests, args.ready, args.batched_peer,
                                         traffic["vocab"])
                runs[engine].append(figures)
                print(f"round {r + 1} {engine} (load average {os.getloadavg()[0]:.2f}): "
                      + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()), flush=True)

    print(f"\n== {path.name} ({traffic['file_bytes'] / 2**30:.2f} GiB), {THREADS} threads, median (min-max) of "
          f"{args.rounds}, order rotated; load average {machine['loadavg']} -> {common.machine_info()['loadavg']} ==")
    print(f"{'test':>8} " + " ".join(f"{engine + ' tok/s':>22}" for engine in engines)
          + "".join(f" {'vs ' + p.name:>16}" for p in peers) + f" {'bound':>7} "
          + " ".join(f"{engine + '/bound':>18}" for engine in engines))
    table = []
    for kind, n in tests:
        name = test_name(kind, n)
        values = {engine: [f[name] for f in runs[engine]] for engine in engines}
        medians = {engine: common.median(v) for engine, v in values.items()}
        row: dict[str, Any] = {"test": name, **values,
                               "ratio": {p.name: medians["kvloom"] / medians[p.name] for p in peers}}
        line = f"{name:>8} " + " ".join(f"{fmt(values[e]):>22}" for e in engines)
        line += "".join(f" {row['ratio'][p.name]:>15.2f}x" for p in peers)
        if kind == "tg":
            bound = bound_tok_s(traffic, bandwidth[THREADS], mean_context(kind, n))
            row.update(bound_tok_s=bound, fraction={e: medians[e] / bound for e in engines})
            line += f" {bound:>7.1f} " + " ".join(f"{row['fraction'][e]:>18.0%}" for e in engines)
        print(line)
        table.append(row)
    for key, label, digits in (("ready_s", "time to ready, s", 2), ("rss_mib", "resident after load, MiB", 0)):
        print(f"{label:>26}: " + ", ".join(
            f"{e} {fmt([f[key] for f in runs[e] if key in f], digits)}" for e in engines))
    print(f"bytes per decode token (file): {traffic['weight_bytes_per_token'] / 1e9:.3f} GB weights + "
          f"{traffic['kv_bytes_per_position'] / 1e3:.0f} kB KV per position; head {traffic['head_type']} "
          f"{traffic['head_bytes'] / 1e9:.3f} GB ({'tied' if traffic['tied'] else 'untied'})")
    common.write_json(args.json, {"benchmark": "realsize-vs-peers", "model": str(path), "traffic": traffic,
                                  "peers": {p.name: {"bin": str(p.bin), "flags": list(p.flags),
                                                     "bench_flags": list(p.bench_flags)} for p in peers},
                                  "bandwidth_gb_s": bandwidth, "rounds": runs, "table": table,
                                  "machine": machine})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""kvloom against a peer on the offline throughput benchmark: alternated runs, medians, ratios.

Each run is a fresh subprocess (so every start-up is measured), from the main venv on this checkout's
kvloom: ``kvloom bench throughput`` for kvloom and ``kvloom bench throughput --peer vllm|hf|llamacpp`` for a
peer (vLLM runs in its own venv, ``.peers/vllm``). ``--base-arg`` / ``--peer-arg`` go to that command (its
flags: ``--dtype``, ``--engine-arg``, ...; HF: ``--threads``; llama.cpp: ``--gguf``).
Runs alternate A B B A A B ... so slow drift of the machine (other work on the two cores) falls on
both engines alike. Prints the median of each figure and the ratio kvloom / peer.

    .venv/bin/python benchmarks/compare.py --peer vllm            # N=64, 3 repeats each
    .venv/bin/python benchmarks/compare.py --peer llamacpp -n 8 --repeats 5 --json cmp.json
    .venv/bin/python benchmarks/compare.py --base hf --peer vllm   # two peers, no kvloom
    # one engine, two settings: kvloom int8 against kvloom bf16; AMX products against kvloom's GEMM alone
    .venv/bin/python benchmarks/compare.py --peer kvloom --base-arg=--engine-arg=quantization=int8
    .venv/bin/python benchmarks/compare.py --peer kvloom --peer-env=KVLOOM_CPU_AMX=0 \
        '--base-arg=--engine-arg=quantization="none"' '--peer-arg=--engine-arg=quantization="none"'
    # a noisy neighbour: one process spinning on a core for the whole comparison (as a busy HTTP
    # server, tokenizer or build would)
    .venv/bin/python benchmarks/compare.py --peer vllm --background-load 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvloom.bench import common

ROOT = Path(__file__).resolve().parents[1]

ENGINES = ("kvloom", "vllm", "hf", "llamacpp")
# (result key, label, higher is better)
METRICS = (
    ("output_tok_s", "output tok/s", True),
    ("total_tok_s", "total tok/s", True),
    ("gflops", "GFLOP/s (matmul)", True),
    ("elapsed_s", "generate wall s", False),
    ("startup_s", "start-up s (-> ready)", False),
    ("startup_to_first_token_s", "start-up s (-> 1st token)", False),
    ("peak_rss_tree_mib", "peak RSS MiB (tree)", False),
)


def engine_command(engine: str, num_prompts: int, json_path: str, extra: list[str]) -> list[str]:
    """The subprocess that measures ``engine`` once and writes its JSON result."""
    main_python = ROOT / ".venv" / "bin" / "python"
    python = str(main_python) if main_python.exists() else sys.executable
    if engine not in ENGINES:
        raise SystemExit(f"unknown engine {engine!r}; choose from {ENGINES}")
    if engine == "vllm" and not (ROOT / ".peers" / "vllm" / "bin" / "python").exists():
        raise SystemExit(f"{ROOT / '.peers' / 'vllm'} is missing: run bash benchmarks/peers/setup_vllm.sh")
    peer = [] if engine == "kvloom" else ["--peer", engine]
    return [python, "-m", "kvloom.entrypoints.cli", "bench", "throughput", *peer, "-n", str(num_prompts),
            "--json", json_path, *extra]


def engine_env(extra: list[str] | None = None) -> dict[str, str]:
    """The runs import this checkout's kvloom (whatever the venv has installed as kvloom); ``extra``: KEY=VALUE
    settings for this side's environment (--base-env / --peer-env)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    for item in extra or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"an environment setting must be KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def run_once(engine: str, num_prompts: int, extra: list[str], timeout: float,
             log_dir: Path, env: list[str] | None = None) -> dict[str, Any] | None:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        json_path = f.name
    command = engine_command(engine, num_prompts, json_path, extra)
    log_path = log_dir / f"{engine}-{time.strftime('%H%M%S')}.log"
    print(f"  $ {' '.join(command)}", flush=True)
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                  cwd=ROOT, env=engine_env(env))
        if proc.returncode != 0:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            print(f"  {engine} failed (exit {proc.returncode}, log {log_path}):", *tail, sep="\n    ")
            return None
        result = json.loads(Path(json_path).read_text())
        print(f"  {engine}: {result['output_tok_s']:.1f} output tok/s, {result['elapsed_s']:.2f} s, "
              f"start-up {result['startup_s']:.1f} s, load {result['machine']['loadavg']}", flush=True)
        return result
    except subprocess.TimeoutExpired:
        print(f"  {engine} timed out after {timeout:.0f} s (log {log_path})")
        return None
    finally:
        if os.path.exists(json_path):
            os.unlink(json_path)


def medians(results: list[dict[str, Any]]) -> dict[str, float]:
    out = {}
    for key, _, _ in METRICS:
        values = [r[key] for r in results if isinstance(r.get(key), (int, float))]
        out[key] = common.median(values) if values else float("nan")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", choices=ENGINES, default="vllm")
    parser.add_argument("--base", choices=ENGINES, default="kvloom",
                        help="the engine whose ratio to the peer is reported (default kvloom)")
    parser.add_argument("-n", "--num-prompts", type=int, default=64)
    parser.add_argument("-r", "--repeats", type=int, default=3)
    parser.add_argument("--base-arg", action="append", default=[],
                        help="extra argument for the base engine's script, repeatable "
                             "(e.g. --base-arg=--engine-arg=enforce_eager=true, --base-arg=--dtype=auto)")
    parser.add_argument("--peer-arg", action="append", default=[],
                        help="extra argument for the peer's script, repeatable "
                             "(e.g. --peer-arg=--dtype=float32, llama.cpp: --peer-arg=--gguf=f16)")
    parser.add_argument("--base-env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for the base engine's runs, repeatable "
                             "(e.g. --base-env=KVLOOM_CPU_AMX=0)")
    parser.add_argument("--peer-env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for the peer's runs, repeatable")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--json", metavar="PATH", help="write every run and the medians as JSON")
    parser.add_argument("--background-load", type=int, default=0, metavar="N",
                        help="N processes spinning on the CPU through every run (default 0)")
    args = parser.parse_args(argv)
    if args.base == args.peer and args.base_arg == args.peer_arg and args.base_env == args.peer_env:
        raise SystemExit("--base and --peer must differ (in engine, in --base-arg / --peer-arg or in --base-env / "
                         "--peer-env)")

    log_dir = ROOT / ".peers" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    # Two sides, each an engine and its extra arguments; labelled apart when the engine is the same.
    sides = {"base": (args.base, args.base_arg), "peer": (args.peer, args.peer_arg)}
    envs = {"base": args.base_env, "peer": args.peer_env}
    labels = {"base": args.base, "peer": args.peer}
    if args.base == args.peer:
        labels = {side: f"{engine}[{' '.join(envs[side] + extra) or 'default'}]"
                  for side, (engine, extra) in sides.items()}
        labels = {side: label.replace("--engine-arg=", "") for side, label in labels.items()}
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "peer": []}
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.background_load)]
    if spinners:
        print(f"{len(spinners)} busy process(es) spinning beside every run", flush=True)
    try:
        for repeat in range(args.repeats):
            order = ["base", "peer"] if repeat % 2 == 0 else ["peer", "base"]
            print(f"repeat {repeat + 1}/{args.repeats}", flush=True)
            for side in order:
                engine, extra = sides[side]
                result = run_once(engine, args.num_prompts, extra, args.timeout, log_dir, envs[side])
                if result is not None:
                    runs[side].append(result)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()

    base, peer = medians(runs["base"]), medians(runs["peer"])
    beside = f", {args.background_load} busy process(es) beside" if args.background_load else ""
    print(f"\n== {labels['base']} vs {labels['peer']}: N={args.num_prompts}, medians of "
          f"{len(runs['base'])} and {len(runs['peer'])} runs{beside} ==")
    width = max(12, *(len(label) for label in labels.values()))
    print(f"{'':<26} {labels['base']:>{width}} {labels['peer']:>{width}} {'ratio':>8}")
    ratios = {}
    for key, label, _ in METRICS:
        a, b = base[key], peer[key]
        ratio = a / b if b and a == a and b == b else float("nan")
        ratios[key] = ratio
        print(f"{label:<26} {common.format_value(a):>{width}} {common.format_value(b):>{width}} "
              f"{common.format_value(ratio):>8}")
    spread = {side: common.spread([r["output_tok_s"] for r in runs[side]]) for side in runs}
    print(f"output tok/s spread (min-max): {labels['base']} {spread['base']}, {labels['peer']} {spread['peer']}")
    print(f"(ratio = {labels['base']} / {labels['peer']}; higher is better for tok/s and GFLOP/s, "
          f"lower for seconds and MiB)")
    common.write_json(args.json, {"base": labels["base"], "peer": labels["peer"], "num_prompts": args.num_prompts,
                                  "background_load": args.background_load,
                                  "runs": {labels[side]: runs[side] for side in runs},
                                  "medians": {labels["base"]: base, labels["peer"]: peer},
                                  "ratios": ratios, "machine": common.machine_info()})
    return 0 if runs["base"] and runs["peer"] else 1


if __name__ == "__main__":
    sys.exit(main())

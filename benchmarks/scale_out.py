"""What scaling out costs on this machine (issue 14): three measurements, each in fresh processes,
alternated (A, B, A, B, ...), reported as medians with their spread.

    PYTHONPATH=. .venv/bin/python benchmarks/scale_out.py executor   # Ray vs mp executor at TP=2
    PYTHONPATH=. .venv/bin/python benchmarks/scale_out.py router     # the router's added latency
    PYTHONPATH=. .venv/bin/python benchmarks/scale_out.py router --baseline-root ../main  # ... before / after
    PYTHONPATH=. .venv/bin/python benchmarks/scale_out.py replicas   # 2 replicas vs 1, one core each
    PYTHONPATH=. .venv/bin/python benchmarks/scale_out.py all --json bench_results/scale_out.json

executor: offline ``LLM.generate`` of the standard workload (``make_workload(N)``, 128 greedy tokens
    each, bf16, max_model_len 1024, max_num_seqs N) at tensor_parallel_size=2 with
    ``distributed_executor_backend`` "mp" and "ray" (a local one-node Ray cluster started by the run).
    SmolLM2-135M's 9 heads / 3 KV heads do not split in two, so the model is a random one of its size
    with heads that do (hidden 512, 8 heads / 4 KV heads of 64, 30 layers, MLP 1536, vocabulary
    49,152: 119 M parameters) and the tests' tokenizer. Each engine step is timed around
    ``executor.execute``; the overhead is Ray's mean step time over mp's, minus one (target <= 10%).
router: sequential requests (16-token prompt, 8 greedy tokens, streamed as deltas, as the server
    asks) through ``ReplicaRouter`` with 2 replicas against one ``AsyncLLM`` in the process, on the
    tests' tiny random model so that the model's time does not hide the router's; every engine on
    one torch thread. The added latency is the router's p50 / p99 minus AsyncLLM's (target p99 <= 1 ms).
    With ``--baseline-root`` (another checkout, e.g. main before a change) the router of that checkout
    runs too, in the same alternation (direct, router there, router here), against the same direct runs.
replicas: the standard workload (SmolLM2-135M, the default model) sent all at once, N concurrent
    requests, through ``ReplicaRouter`` with 2 replicas each with ``num_threads`` 1, pinned to a core each
    (``cpu_omp_threads_bind`` "0|1"), against one ``AsyncLLM`` with ``num_threads`` 1 pinned to one core
    ("0"): output tokens/s and the ratio (target >= 1.6x).

The machine is shared and noisy (other work runs on its 2 cores): read the spread, not only the median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BENCH_MODEL = dict(hidden_size=512, num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=4,
                   intermediate_size=1536, vocab_size=49152)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- checkpoints -------------------------------------------------------------------------------------
def tiny_models() -> Any:
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_models as module

    return module


def bench_checkpoint(directory: Path) -> Path:
    """The TP-divisible SmolLM2-sized random model (bf16), built once into ``directory``."""
    if (directory / "config.json").exists():
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = tiny_models()
    torch.manual_seed(0)
    config = LlamaConfig(**BENCH_MODEL, max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
                         bos_token_id=tiny.BOS_ID, eos_token_id=tiny.EOS_ID, pad_token_id=tiny.EOS_ID)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(directory)
    tiny.save_tokenizer(str(directory))
    saved = json.loads((directory / "config.json").read_text())
    saved["torch_dtype"] = saved["dtype"] = "bfloat16"
    (directory / "config.json").write_text(json.dumps(saved, indent=2) + "\n")
    log(f"wrote {directory}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters")
    return directory


def tiny_checkpoint(directory: Path) -> Path:
    if not (directory / "config.json").exists():
        tiny_models().build_tiny_checkpoint(str(directory), arch="llama")
    return directory


# ---- the measured runs (each in a child process) ---------------------------------------------------
def child_executor(args: argparse.Namespace) -> dict[str, Any]:
    from kvloom import LLM, SamplingParams
    from kvloom.bench.workload import make_workload

    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=1024, max_num_seqs=args.n, seed=0,
              tensor_parallel_size=2, distributed_executor_backend=args.backend)
    executor = llm.llm_engine.executor
    step_seconds: list[float] = []
    execute = executor.execute

    def timed_execute(scheduler_output: Any) -> Any:
        start = time.perf_counter()
        output = execute(scheduler_output)
        step_seconds.append(time.perf_counter() - start)
        return output

    executor.execute = timed_execute  # type: ignore[method-assign]
    prompts = [{"prompt_token_ids": p} for p in make_workload(args.n)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    step_seconds.clear()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    llm.llm_engine.shutdown()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"wall_s": wall, "steps": len(step_seconds), "mean_step_ms": 1e3 * statistics.mean(step_seconds),
            "median_step_ms": 1e3 * statistics.median(step_seconds), "output_tok_s": generated / wall}


def _engine(args: argparse.Namespace, data_parallel_size: int, max_num_seqs: int,
            cpu_omp_threads_bind: str = "auto") -> Any:
    from kvloom.config import EngineConfig
    from kvloom.engine.async_engine import AsyncLLM

    config = EngineConfig(model=args.model, dtype="bfloat16" if args.bf16 else "float32",
                          max_model_len=1024 if args.bf16 else 256,
                          max_num_seqs=max_num_seqs, seed=0, data_parallel_size=data_parallel_size,
                          override_backend_config={"num_threads": 1}, cpu_omp_threads_bind=cpu_omp_threads_bind)
    if data_parallel_size > 1:
        from kvloom.engine.data_parallel.router import ReplicaRouter

        return ReplicaRouter(config, stats_interval=0, log_requests=False, log_level="warning")
    return AsyncLLM.from_config(config, stats_interval=0, log_requests=False)


async def _one(engine: Any, request_id: str, prompt: list[int], max_tokens: int) -> int:
    from kvloom.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    tokens = 0
    async for output in engine.generate({"prompt_token_ids": prompt}, params, request_id=request_id):
        tokens += len(output.outputs[0].token_ids)
    return tokens


def child_router(args: argparse.Namespace) -> dict[str, Any]:
    engine = _engine(args, args.dp, max_num_seqs=8)
    prompt = list(range(10, 26))

    async def run() -> list[float]:
        latencies = []
        for i in range(args.warmup + args.requests):
            start = time.perf_counter()
            await _one(engine, f"r{i}", prompt, 8)
            if i >= args.warmup:
                latencies.append(time.perf_counter() - start)
        return latencies

    latencies = asyncio.run(run())
    engine.shutdown()
    return {"latencies_ms": [1e3 * x for x in latencies]}


def child_replicas(args: argparse.Namespace) -> dict[str, Any]:
    from kvloom import cpu_affinity
    from kvloom.bench.workload import make_workload

    # One core per replica, and one core for the lone engine too: the first usable ones.
    cores = cpu_affinity.usable_cpus()[:args.dp]
    engine = _engine(args, args.dp, max_num_seqs=args.n, cpu_omp_threads_bind="|".join(map(str, cores)))
    prompts = make_workload(args.n)

    async def run() -> tuple[float, int]:
        await _one(engine, "warm-up", prompts[0][:16], 2)
        start = time.perf_counter()
        counts = await asyncio.gather(*[_one(engine, f"r{i}", p, args.output_len) for i, p in enumerate(prompts)])
        return time.perf_counter() - start, sum(counts)

    wall, generated = asyncio.run(run())
    engine.shutdown()
    return {"wall_s": wall, "output_tok_s": generated / wall}


CHILDREN = {"executor": child_executor, "router": child_router, "replicas": child_replicas}


# ---- the parent: alternated fresh processes ----------------------------------------------------------
def run_child(kind: str, options: list[str], ray_dir: str, root: Path = ROOT) -> dict[str, Any]:
    """One measured run in a fresh process, of the checkout at ``root`` (this one by default)."""
    command = [sys.executable, str(root / "benchmarks" / "scale_out.py"), "--child", kind, *options]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "RAY_TMPDIR": ray_dir, "RAY_ADDRESS": ""}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f}, n={len(values)})"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def measure_executor(args: argparse.Namespace, work: Path, ray_dir: str) -> dict[str, Any]:
    model = bench_checkpoint(work / "tp-model")
    runs: dict[str, list[dict[str, Any]]] = {"mp": [], "ray": []}
    for repeat in range(args.repeats):
        for backend in ("mp", "ray"):
            result = run_child("executor", ["--model", str(model), "--backend", backend, "-n", str(args.n),
                                            "--output-len", str(args.output_len)], ray_dir)
            log(f"executor {backend} #{repeat + 1}: {result}")
            runs[backend].append(result)
    mp_steps = [r["mean_step_ms"] for r in runs["mp"]]
    ray_steps = [r["mean_step_ms"] for r in runs["ray"]]
    pairs = [ray / mp - 1 for ray, mp in zip(ray_steps, mp_steps)]
    summary = {"mp_mean_step_ms": spread(mp_steps), "ray_mean_step_ms": spread(ray_steps),
               "mp_output_tok_s": spread([r["output_tok_s"] for r in runs["mp"]]),
               "ray_output_tok_s": spread([r["output_tok_s"] for r in runs["ray"]]),
               "ray_overhead_percent": spread([100 * p for p in pairs]),
               "overhead_of_medians_percent": round(
                   100 * (statistics.median(ray_steps) / statistics.median(mp_steps) - 1), 2)}
    return {"runs": runs, "summary": summary}


def measure_router(args: argparse.Namespace, work: Path, ray_dir: str) -> dict[str, Any]:
    model = tiny_checkpoint(work / "tiny-model")
    sides = [("direct", 1, ROOT), ("router", 2, ROOT)]
    if args.baseline_root:
        sides.insert(1, ("router_baseline", 2, Path(args.baseline_root).resolve()))
    runs: dict[str, list[list[float]]] = {name: [] for name, _, _ in sides}
    load: list[float] = []
    for repeat in range(args.repeats):
        for name, dp, root in sides:
            load.append(os.getloadavg()[0])
            result = run_child("router", ["--model", str(model), "--dp", str(dp), "--requests", str(args.requests),
                                          "--warmup", "20"], ray_dir, root)
            latencies = result["latencies_ms"]
            log(f"router {name} #{repeat + 1}: p50 {percentile(latencies, 0.5):.3f} ms, "
                f"p99 {percentile(latencies, 0.99):.3f} ms (load average {load[-1]:.2f})")
            runs[name].append(latencies)
    pooled = {name: [x for run in values for x in run] for name, values in runs.items()}
    summary: dict[str, Any] = {f"{name}_{q}_ms": round(percentile(pooled[name], p), 3)
                               for name in pooled for q, p in (("p50", 0.5), ("p99", 0.99))}
    for name in runs:
        if name == "direct":
            continue
        prefix = "added" if name == "router" else f"added_{name.removeprefix('router_')}"
        for q, p in (("p50", 0.5), ("p99", 0.99)):
            summary[f"{prefix}_{q}_ms"] = round(summary[f"{name}_{q}_ms"] - summary[f"direct_{q}_ms"], 3)
            per_repeat = [percentile(r, p) - percentile(d, p) for r, d in zip(runs[name], runs["direct"])]
            summary[f"{prefix}_{q}_per_repeat_ms"] = [round(x, 3) for x in per_repeat]
            summary[f"{prefix}_{q}_median_of_repeats_ms"] = round(statistics.median(per_repeat), 3)
    summary["load_average_1min"] = f"{statistics.median(load):.2f} (min {min(load):.2f}, max {max(load):.2f})"
    return {"runs": runs, "summary": summary}


def measure_replicas(args: argparse.Namespace, work: Path, ray_dir: str) -> dict[str, Any]:
    from kvloom.loader.weights import default_model_gguf_path

    model = default_model_gguf_path()
    runs: dict[str, list[dict[str, Any]]] = {"one": [], "two": []}
    for repeat in range(args.repeats):
        for name, dp in (("one", 1), ("two", 2)):
            result = run_child("replicas", ["--model", model, "--dp", str(dp), "-n", str(args.n), "--output-len",
                                            str(args.output_len), "--bf16"], ray_dir)
            log(f"replicas {name} #{repeat + 1}: {result}")
            runs[name].append(result)
    one = [r["output_tok_s"] for r in runs["one"]]
    two = [r["output_tok_s"] for r in runs["two"]]
    summary = {"one_replica_output_tok_s": spread(one), "two_replicas_output_tok_s": spread(two),
               "speedup_per_repeat": [round(b / a, 3) for a, b in zip(one, two)],
               "speedup_of_medians": round(statistics.median(two) / statistics.median(one), 3)}
    return {"runs": runs, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", choices=["executor", "router", "replicas", "all"], default="all")
    parser.add_argument("-n", type=int, default=64, help="requests of the standard workload (64)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="alternated runs of each side")
    parser.add_argument("--requests", type=int, default=300, help="router: sequential requests per run")
    parser.add_argument("--baseline-root", help="router: also run the router of this other checkout (before / after)")
    parser.add_argument("--work-dir", help="where the generated checkpoints are kept (default: a temp dir)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--dp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=20, help=argparse.SUPPRESS)
    parser.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(CHILDREN[args.child](args)), flush=True)
        return 0
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "note": "shared 2-core box; others were working"}}
    with tempfile.TemporaryDirectory(prefix="kvr-", dir="/tmp") as ray_dir, \
            tempfile.TemporaryDirectory(prefix="kvloom-scale-out-") as temp:
        work = Path(args.work_dir) if args.work_dir else Path(temp)
        work.mkdir(parents=True, exist_ok=True)
        measures = {"executor": measure_executor, "router": measure_router, "replicas": measure_replicas}
        for name in (measures if args.what == "all" else [args.what]):
            results[name] = measures[name](args, work, ray_dir)
            print(f"{name}: {json.dumps(results[name]['summary'], indent=2)}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""vLLM-CPU on kvloom's offline benchmarks: the same flags, workload and result as ``kvloom bench``.

    .venv/bin/python benchmarks/peers/vllm_bench.py throughput [-n 64] [--dtype float32] [--json out.json]
    .venv/bin/python benchmarks/peers/vllm_bench.py latency --batch-sizes 1,8,64

Runs in the main venv: it builds the job (prompts as token ids, ``LLM(...)`` keyword arguments) with
``kvloom.bench``, hands it as JSON to ``vllm_runner.py`` under ``.peers/vllm/bin/python`` (vLLM's venv, which
has no kvloom), and makes kvloom's result (FLOPs, rates, the printed report) from the timings it returns.
Start-up and memory are measured inside the runner's process, so they are vLLM's alone.
The model defaults to ``.peers/smollm2-hf`` (``bash benchmarks/peers/setup_transformers.sh``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvloom.bench import common, latency, throughput
from kvloom.bench.workload import load_prompts, warmup_prompt

HERE = Path(__file__).resolve().parent
VLLM_PYTHON = common.PEERS_DIR / "vllm" / "bin" / "python"


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """The job run by vllm_runner.py in vLLM's venv; its raw result."""
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_PYTHON} is missing: run bash benchmarks/peers/setup_vllm.sh")
    with tempfile.TemporaryDirectory(prefix="kvloom-vllm-job-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        proc = subprocess.run([str(VLLM_PYTHON), str(HERE / "vllm_runner.py"), str(job_path), str(result_path)])
        if proc.returncode != 0 or not result_path.exists():
            raise SystemExit(f"vllm_runner.py failed (exit {proc.returncode})")
        return json.loads(result_path.read_text())


def check_model(model: str) -> None:
    if not Path(model).exists():
        raise SystemExit(f"{model} does not exist: make it with 'bash benchmarks/peers/setup_transformers.sh'")


def cmd_throughput(argv: list[str]) -> int:
    parser = throughput.build_parser(prog="vllm_bench.py throughput")
    parser.set_defaults(model=str(common.PEER_HF_CHECKPOINT))
    args = parser.parse_args(argv)
    throughput.check_args(args)
    check_model(args.model)
    machine = common.machine_info()
    prompts = load_prompts(args, args.num_prompts, seed=args.seed)
    llm_kwargs = throughput.llm_kwargs(args, args.max_num_seqs or args.num_prompts)
    raw = run_job({"benchmark": "throughput", "llm_kwargs": llm_kwargs, "prompts": prompts,
                   "output_len": args.output_len,
                   "first_token_prompt": warmup_prompt(args, prompts, seed=args.seed) if args.first_token else None})
    result = throughput.throughput_result(
        engine="vllm", version=raw["engine_version"], engine_kwargs=llm_kwargs, model=args.model,
        prompt_lens=[len(p) for p in prompts], generated=raw["generated"], output_len=args.output_len,
        elapsed=raw["elapsed_s"], startup_s=raw["startup_s"],
        startup_to_first_token_s=raw["startup_to_first_token_s"], peak_rss_mib=raw["peak_rss_mib"],
        peak_rss_tree_mib=raw["peak_rss_tree_mib"], machine=machine)
    throughput.report(result)
    common.write_json(args.json, result)
    return 0


def cmd_latency(argv: list[str]) -> int:
    parser = latency.build_parser(prog="vllm_bench.py latency")
    parser.set_defaults(model=str(common.PEER_HF_CHECKPOINT))
    args = parser.parse_args(argv)
    latency.check_args(args)
    check_model(args.model)
    machine = common.machine_info()
    sizes = latency.parse_batch_sizes(args.batch_sizes)
    prompts = load_prompts(args, max(sizes), seed=args.seed)
    llm_kwargs = throughput.llm_kwargs(args, args.max_num_seqs or max(sizes))
    if not args.enable_prefix_caching:
        llm_kwargs.setdefault("enable_prefix_caching", False)
    raw = run_job({"benchmark": "latency", "llm_kwargs": llm_kwargs, "prompts": prompts, "batch_sizes": sizes,
                   "output_len": args.output_len, "num_iters": args.num_iters, "num_warmup": args.num_warmup,
                   "method": args.method})
    result = {
        "benchmark": "latency", "engine": "vllm", "engine_version": raw["engine_version"], "model": args.model,
        "engine_kwargs": llm_kwargs, "method": args.method, "output_len": args.output_len,
        "num_iters": args.num_iters, "startup_s": raw["startup_s"],
        "batches": [latency.batch_result(b, prompts[:b], raw["batches"][str(b)]) for b in sizes],
        "peak_rss_mib": raw["peak_rss_mib"], "machine": machine,
        "loadavg_end": common.machine_info()["loadavg"],
    }
    latency.report(result)
    common.write_json(args.json, result)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return common.run_subcommand("vllm_bench.py", __doc__, {"throughput": cmd_throughput, "latency": cmd_latency},
                                 argv)


if __name__ == "__main__":
    sys.exit(main())

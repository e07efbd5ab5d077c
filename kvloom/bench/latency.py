"""Batch latency: B requests submitted together; time to first token and decode step time.

    kvloom bench latency                                  # kvloom, B = 1, 8, 64
    .peers/vllm/bin/python benchmarks/latency.py --engine vllm --batch-sizes 1,8,64

For each batch size B the first B prompts of the standard workload (``make_workload(B)``) are
submitted at once with ``--output-len`` tokens each (temperature 0, ignore_eos), ``--num-iters``
times after ``--num-warmup`` unrecorded runs; medians over the iterations are reported.

Two ways to measure, ``--method``:
- ``step`` (kvloom and vLLM; the default when the engine has it): ``llm.llm_engine.add_request``
  for every prompt, then ``llm.llm_engine.step()`` in a loop, timing each step. TTFT of a request
  is the end of the step whose output first carries one of its tokens; the batch TTFT is the last
  such time. The decode step time is the median duration of the steps once every request has
  its first token (every step then adds one token to each of the B requests).
- ``generate`` (any engine, HF's only): ``generate(max_tokens=1)`` timed is the batch TTFT, and
  ``(t(max_tokens=K) - t(1)) / (K - 1)`` the decode step time.

Prefix caching is turned off (``enable_prefix_caching=False``) so repeated iterations over the
same prompts recompute the prefill; ``--enable-prefix-caching`` leaves the engine default.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvloom.bench import common
from kvloom.bench.throughput import Engine, HfEngine, VllmApiEngine, add_engine_options, default_model
from kvloom.bench.workload import make_workload


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvloom bench latency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_options(parser)
    parser.add_argument("--batch-sizes", default="1,8,64", help="comma-separated B values")
    parser.add_argument("--output-len", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--num-warmup", type=int, default=1)
    parser.add_argument("--method", choices=("auto", "step", "generate"), default="auto",
                        help="auto: step where llm.llm_engine.step exists, else generate")
    parser.add_argument("--enable-prefix-caching", action="store_true",
                        help="keep the engine's prefix caching (off by default here)")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON ('-': stdout)")
    return parser


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or any(b < 1 for b in sizes):
        raise SystemExit(f"--batch-sizes must be positive integers, got {text!r}")
    return sizes


def has_step_loop(engine: Engine) -> bool:
    llm_engine = getattr(getattr(engine, "llm", None), "llm_engine", None)
    return all(callable(getattr(llm_engine, name, None))
               for name in ("add_request", "step", "has_unfinished_requests"))


class StepLoopUnsupported(RuntimeError):
    """The engine's step() did not stream per-step outputs."""


_request_counter = 0


def measure_step(engine: VllmApiEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """One batch through ``llm_engine.add_request`` + ``step()``; times of every step.

    The requests ask for an output at every step (``output_kind`` CUMULATIVE, the default of both
    kvloom's and vLLM's SamplingParams; ``LLM.generate`` asks only for the final one).
    """
    return _step_loop(engine.llm.llm_engine, engine.params(max_tokens), prompts, max_tokens)


def _step_loop(llm_engine: Any, params: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
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
        raise StepLoopUnsupported("step() returned outputs only for finished requests")
    ttfts = [first_token.get(r, total) for r in request_ids]
    return {
        "ttft_s": max(ttfts),
        "ttft_p50_s": common.median(ttfts),
        "decode_step_s": common.median(decode_steps) if decode_steps else float("nan"),
        "decode_steps": len(decode_steps),
        "e2e_s": total,
    }


def measure_generate(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """TTFT from a 1-token generate; decode step from the extra time of max_tokens tokens."""
    t0 = time.perf_counter()
    engine.generate(prompts, 1)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate(prompts, max_tokens)
    total = time.perf_counter() - t0
    step = (total - ttft) / (max_tokens - 1) if max_tokens > 1 else float("nan")
    return {"ttft_s": ttft, "ttft_p50_s": ttft, "decode_step_s": step,
            "decode_steps": max_tokens - 1, "e2e_s": total}


def run(args: argparse.Namespace) -> dict[str, Any]:
    start = common.process_start_time()
    machine = common.machine_info()
    sizes = parse_batch_sizes(args.batch_sizes)
    if args.model is None:
        args.model = default_model(args.engine)
    if args.engine == "hf":
        engine: Engine = HfEngine(args)
    else:
        if not args.enable_prefix_caching:
            args.engine_arg = ["enable_prefix_caching=false", *(args.engine_arg or [])]
        engine = VllmApiEngine(args.engine, args, args.max_num_seqs or max(sizes))
    startup = time.time() - start

    method = args.method
    if method == "auto":
        method = "step" if has_step_loop(engine) else "generate"
    if method == "step" and not has_step_loop(engine):
        raise SystemExit(f"{args.engine}: llm.llm_engine has no add_request/step; use --method generate")

    results = []
    for batch_size in sizes:
        prompts = make_workload(batch_size)
        runs = []
        for i in range(args.num_warmup + args.num_iters):
            if method == "step":
                try:
                    measured = measure_step(engine, prompts, args.output_len)  # type: ignore[arg-type]
                except StepLoopUnsupported as e:
                    print(f"step loop unusable ({e}); falling back to --method generate", file=sys.stderr)
                    method = "generate"
                    measured = measure_generate(engine, prompts, args.output_len)
            else:
                measured = measure_generate(engine, prompts, args.output_len)
            if i >= args.num_warmup:
                runs.append(measured)
        ttft = common.median([r["ttft_s"] for r in runs])
        step = common.median([r["decode_step_s"] for r in runs])
        results.append({
            "batch_size": batch_size,
            "prompt_tokens": sum(len(p) for p in prompts),
            "ttft_s": ttft,
            "ttft_p50_s": common.median([r["ttft_p50_s"] for r in runs]),
            "decode_step_s": step,
            "decode_tok_s": batch_size / step if step == step and step > 0 else float("nan"),
            "prefill_tok_s": sum(len(p) for p in prompts) / ttft,
            "e2e_s": common.median([r["e2e_s"] for r in runs]),
            "runs": runs,
        })
    engine.shutdown()
    return {
        "benchmark": "latency",
        "engine": engine.name,
        "engine_version": engine.version,
        "model": args.model,
        "engine_kwargs": engine.engine_kwargs,
        "method": method,
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "startup_s": startup,
        "batches": results,
        "peak_rss_mib": common.peak_rss_mib(),
        "machine": machine,
        "loadavg_end": common.machine_info()["loadavg"],
    }


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
    args = build_parser().parse_args(argv)
    if args.output_len < 2 or args.num_iters < 1 or args.num_warmup < 0:
        raise SystemExit("--output-len must be >= 2, --num-iters >= 1, --num-warmup >= 0")
    result = run(args)
    report(result)
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

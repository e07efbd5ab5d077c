"""A streamed completion's per-token host cost at its start and at its end.

    .venv/bin/python benchmarks/stream_cost.py                  # a tiny random model, 4,000 tokens
    .venv/bin/python benchmarks/stream_cost.py --model DIR --max-tokens 4000 --kind cumulative

The two measurements (``single`` and ``paired``) are ``kvloom.bench.stream_cost``'s; without ``--model`` a
tiny random model with an 8,192-token context is built in a temp dir (the output path does not depend on
the model).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvloom.bench import common
from kvloom.bench.stream_cost import measure_paired, measure_single

ROOT = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="a model whose context holds the prompt + max tokens (default: a tiny random one)")
    parser.add_argument("--max-tokens", type=int, default=4000)
    parser.add_argument("--window", type=int, default=500, help="decode steps compared at each end")
    parser.add_argument("--kind", choices=("delta", "cumulative", "final_only"), default="delta",
                        help="SamplingParams.output_kind of the requests")
    parser.add_argument("--logprobs", type=int, default=1, help="logprobs per token (-1: none)")
    parser.add_argument("--stop", default="<never-seen stop>",
                        help="a stop string that never matches ('': none)")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON ('-': stdout)")
    return parser


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvloom.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_kwargs(model=args.model, dtype="float32", max_model_len=args.max_tokens + 64,
                                   max_num_seqs=3)
    options = dict(max_tokens=args.max_tokens, window=args.window, kind=args.kind,
                   logprobs=None if args.logprobs < 0 else args.logprobs, stop=args.stop or None)
    try:
        return {**options, "single": measure_single(engine, **options),
                "paired": measure_paired(engine, **options)}
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model is not None:
        return report(run(args), args.json)
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_models

    with tempfile.TemporaryDirectory(prefix="kvloom-stream-cost-") as model_dir:
        tiny_models.build_tiny_checkpoint(model_dir, max_position_embeddings=8192)
        args.model = model_dir
        return report(run(args), args.json)


def report(result: dict[str, Any], json_path: str | None) -> int:
    window = result["window"]
    print(f"one request of {result['max_tokens']} tokens, {result['kind']} outputs; per decode step, "
          f"first {window} steps -> last {window}:")
    for name, what in (("output", "output processor"), ("host", "step outside the model")):
        r = result["single"][name]
        first, last = r["first"], r["last"]
        print(f"  {what:22s} median {first['median_us']:7.1f} -> {last['median_us']:7.1f} us "
              f"(x{r['ratio_median']:.2f}), p10 {first['p10_us']:7.1f} -> {last['p10_us']:7.1f} us "
              f"(x{r['ratio_p10']:.2f})")
    paired = result["paired"]
    print(f"paired, in the same {paired['num_pairs']} steps: output processor per request, tokens 0-{window} "
          f"median {paired['early']['median_us']:.1f} us, tokens {result['max_tokens'] - window}-"
          f"{result['max_tokens']} median {paired['late']['median_us']:.1f} us; median ratio "
          f"x{paired['ratio']:.2f}")
    common.write_json(json_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

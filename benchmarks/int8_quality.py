"""int8 against bf16 on the default model: greedy agreement on real chat prompts, and perplexity.

    .venv/bin/python benchmarks/int8_quality.py [--model SmolLM2-135M-Instruct] [--json out.json]
        [--int8-activations on|off] [--smoothing-alpha 0.65|none] [--gguf-blocks on|off]

What is measured, and how, is ``kvloom.bench.int8_quality``'s (``measure``, ``compare``).
"""

from __future__ import annotations

import argparse
import json
import sys

from kvloom.bench.int8_quality import compare, int8_backend, measure, process_memory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--ppl-tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--quantize-lm-head", action="store_true", help="int8 embedding and LM head too")
    parser.add_argument("--int8-activations", choices=("on", "off"), help="W8A8 (on) or weight-only (off)")
    parser.add_argument("--smoothing-alpha", help="with W8A8: SmoothQuant's alpha, or none")
    parser.add_argument("--gguf-blocks", choices=("on", "off"), help="keep a GGUF's Q8_0 blocks (on: the default)")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--no-rss", action="store_true", help="skip the fresh-process memory measurement")
    args = parser.parse_args(argv)
    bf16 = measure(args.model, None, args.max_tokens, args.ppl_tokens, args.window, False)
    int8 = measure(args.model, "int8", args.max_tokens, args.ppl_tokens, args.window, args.quantize_lm_head,
                   args.int8_activations, args.smoothing_alpha, args.gguf_blocks)
    result = {"model": args.model, "quantize_lm_head": args.quantize_lm_head,
              "int8_activations": int8["int8_activations"], "q8_0_blocks": int8["q8_0_blocks"],
              "smoothing_alpha": int8["smoothing_alpha"],
              **compare(bf16, int8, args.max_tokens)}
    if not args.no_rss:
        for name, quantization in (("bf16", None), ("int8", "int8")):
            backend = int8_backend(args.quantize_lm_head, args.int8_activations, args.smoothing_alpha,
                                   args.gguf_blocks)
            memory = process_memory(args.model, quantization, backend)
            result[f"rss_{name}"], result[f"peak_rss_{name}"] = memory["VmRSS"], memory["VmHWM"]
        result["rss_ratio"] = round(result["rss_int8"] / result["rss_bf16"], 4)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""8-bit KV caches against the model's dtype: perplexity, greedy agreement on chat prompts, KV capacity.

    .venv/bin/python benchmarks/kv_cache_quality.py [--model SmolLM2-135M-Instruct] [--tokens 2048] [--window 512]
        [--dtypes auto int8 fp8] [--max-tokens 32]

Perplexity is kvloom.bench.int8_quality's (its reference text, windows of ``--window`` tokens). Greedy agreement:
its 32 chat prompts, ``--max-tokens`` new tokens each at temperature 0, against the 'auto' cache: the share of
prompts whose tokens are identical and the mean identical prefix. Capacity: the KV blocks the default 2 GiB budget
holds (before the max_num_seqs cap). The CPU has no fp8 kernels, so 'fp8' runs on the plain-torch reference
attention (the numbers the CUDA kernels compute); it is compared with 'auto' on that same backend.
"""

from __future__ import annotations

import argparse
import json

from kvloom import LLM, SamplingParams
from kvloom.bench.int8_quality import greedy_tokens, identical_prefix, perplexity, reference_text

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def measure(args: argparse.Namespace, kv_cache_dtype: str, backend: str | None) -> dict:
    llm = LLM(model=args.model, max_model_len=args.window + 88, kv_cache_dtype=kv_cache_dtype,
              override_backend_config={"attention_backend": backend} if backend else None)
    ids = llm.get_tokenizer().encode(reference_text())[:args.tokens]
    runner = llm.llm_engine.executor.driver
    answer = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    result = {"kv_cache_dtype": kv_cache_dtype, "attention_backend": backend or "auto",
              "perplexity": perplexity(llm, ids, args.window), "answer": answer,
              "greedy": greedy_tokens(llm, args.max_tokens), "bytes_per_block": runner.kv_bytes_per_block(),
              "blocks_in_2GiB": (2 << 30) // runner.kv_bytes_per_block()}
    llm.llm_engine.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--dtypes", nargs="+", default=["auto", "int8", "fp8"],
                        choices=["auto", "int8", "fp8"])
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    runs = [(dtype, "reference" if dtype == "fp8" else None) for dtype in args.dtypes if dtype != "auto"]
    bases = {backend: measure(args, "auto", backend) for backend in {backend for _, backend in runs} | {None}}
    rows = []
    for dtype, backend in runs:
        result, base = measure(args, dtype, backend), bases[backend]
        prefixes = [identical_prefix(a, b) for a, b in zip(result["greedy"], base["greedy"])]
        same = sum(a == b for a, b in zip(result["greedy"], base["greedy"]))
        rows.append({**{k: v for k, v in result.items() if k != "greedy"},
                     "perplexity_auto": base["perplexity"],
                     "perplexity_ratio": result["perplexity"] / base["perplexity"],
                     "answer_auto": base["answer"], "greedy_identical": f"{same}/{len(prefixes)}",
                     "greedy_mean_identical_prefix": sum(prefixes) / len(prefixes),
                     "capacity_ratio": result["blocks_in_2GiB"] / base["blocks_in_2GiB"]})
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

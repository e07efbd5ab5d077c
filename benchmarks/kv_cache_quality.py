"""int8 KV cache against the model's dtype: perplexity, the greedy chat answer and KV capacity, one engine each.

    .venv/bin/python benchmarks/kv_cache_quality.py [--model SmolLM2-135M-Instruct] [--tokens 2048] [--window 512]

Perplexity is kvloom.bench.int8_quality's (its reference text, windows of ``--window`` tokens); capacity is the
number of KV blocks the default 2 GiB budget holds for each dtype (before the max_num_seqs cap).
"""

from __future__ import annotations

import argparse
import json

from kvloom import LLM, SamplingParams
from kvloom.bench.int8_quality import perplexity, reference_text

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--window", type=int, default=512)
    args = parser.parse_args()
    results = {}
    for kv_cache_dtype in ("auto", "int8"):
        llm = LLM(model=args.model, max_model_len=args.window + 88, kv_cache_dtype=kv_cache_dtype)
        ids = llm.get_tokenizer().encode(reference_text())[:args.tokens]
        runner = llm.llm_engine.executor.driver
        answer = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
        results[kv_cache_dtype] = {"perplexity": perplexity(llm, ids, args.window), "answer": answer,
                                   "bytes_per_block": runner.kv_bytes_per_block(),
                                   "blocks_in_2GiB": (2 << 30) // runner.kv_bytes_per_block()}
        llm.llm_engine.shutdown()
    results["perplexity_ratio"] = results["int8"]["perplexity"] / results["auto"]["perplexity"]
    results["capacity_ratio"] = results["int8"]["blocks_in_2GiB"] / results["auto"]["blocks_in_2GiB"]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""N-gram speculative decoding against the plain engine on a copy-the-text workload (greedy): output tok/s,
alternated fresh engines, medians, and a check that both give the same tokens.

    .venv/bin/python benchmarks/speculative.py            # SmolLM2 on the CPU, batch 1 and 8
    .venv/bin/python benchmarks/speculative.py --batch 1 --repeats 5 --num-speculative-tokens 4
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvloom import LLM, SamplingParams

TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
        "All that glitters is not gold. Actions speak louder than words. ")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    args = parser.parse_args()
    speculative = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                   "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for batch in args.batch:
        prompts = [f"Copy this text exactly, twice:\n{TEXT * (1 + i % 2)}\nCopy:\n" for i in range(batch)]
        rates: dict[str, list[float]] = {"plain": [], "ngram": []}
        tokens: dict[str, list] = {}
        acceptance = ""
        for _ in range(args.repeats):
            for name, config in (("plain", None), ("ngram", speculative)):
                llm = LLM(model=args.model, max_model_len=512, speculative_config=config)
                llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                rates[name].append(batch * args.max_tokens / (time.perf_counter() - start))
                tokens[name] = [o.outputs[0].token_ids for o in outputs]
                if config is not None:
                    stats = llm.llm_engine.scheduler.stats()
                    acceptance = f"{stats.num_accepted_tokens} of {stats.num_draft_tokens} drafts accepted"
        plain, ngram = statistics.median(rates["plain"]), statistics.median(rates["ngram"])
        print(f"batch {batch}: plain {plain:.1f} tok/s ({' / '.join(f'{r:.1f}' for r in rates['plain'])}), "
              f"ngram {ngram:.1f} ({' / '.join(f'{r:.1f}' for r in rates['ngram'])}): {ngram / plain:.2f}x; "
              f"{acceptance}; same tokens: {tokens['plain'] == tokens['ngram']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

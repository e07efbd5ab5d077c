"""Speculative decoding against the plain engine on a copy-the-text workload (greedy): output tok/s,
alternated fresh engines, medians, and a check that every method gives the plain engine's tokens.

    .venv/bin/python benchmarks/speculative.py            # n-gram, SmolLM2 on the CPU, batch 1 and 8
    .venv/bin/python benchmarks/speculative.py --batch 1 --repeats 5 --num-speculative-tokens 4
    .venv/bin/python benchmarks/speculative.py --methods ngram draft_model --batch 1
        # draft_model: --draft-model PATH (default: the target itself, which accepts every draft: the upper
        # bound of the acceptance; no smaller SmolLM2 is available offline)
    .venv/bin/python benchmarks/speculative.py --methods eagle --eagle-model HEAD_DIR

Figures, ``--methods ngram draft_model --batch 1`` (SmolLM2-135M-Instruct bf16 on the 2-core CPU, idle,
96 tokens, k = 4, medians of 3): plain 69.4 tok/s, ngram 96.2 (1.39x, 29 of 51 drafts accepted),
draft_model with the target as its own draft 66.1 (0.95x, 78 of 78 accepted: every guess costs a
target-sized decode step, so this bounds the acceptance, not the speed). All three gave the same tokens.
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
    parser.add_argument("--methods", nargs="+", default=["ngram"], choices=["ngram", "draft_model", "eagle", "eagle3"])
    parser.add_argument("--draft-model", default=None, help="the draft model (default: the target itself)")
    parser.add_argument("--eagle-model", default=None, help="the EAGLE head's directory (eagle / eagle3)")
    args = parser.parse_args()
    k = args.num_speculative_tokens
    configs: dict[str, dict | None] = {"plain": None}
    for method in args.methods:
        if method == "ngram":
            configs[method] = {"method": "ngram", "num_speculative_tokens": k,
                               "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
        elif method == "draft_model":
            configs[method] = {"method": method, "model": args.draft_model or args.model, "num_speculative_tokens": k}
        else:
            if args.eagle_model is None:
                parser.error(f"--methods {method} needs --eagle-model")
            configs[method] = {"method": method, "model": args.eagle_model, "num_speculative_tokens": k}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for batch in args.batch:
        prompts = [f"Copy this text exactly, twice:\n{TEXT * (1 + i % 2)}\nCopy:\n" for i in range(batch)]
        rates: dict[str, list[float]] = {name: [] for name in configs}
        tokens: dict[str, list] = {}
        acceptance: dict[str, str] = {}
        for _ in range(args.repeats):
            for name, config in configs.items():
                llm = LLM(model=args.model, max_model_len=512, speculative_config=config)
                llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                rates[name].append(batch * args.max_tokens / (time.perf_counter() - start))
                tokens[name] = [o.outputs[0].token_ids for o in outputs]
                if config is not None:
                    stats = llm.llm_engine.scheduler.stats()
                    acceptance[name] = f"{stats.num_accepted_tokens} of {stats.num_draft_tokens} drafts accepted"
        plain = statistics.median(rates["plain"])
        line = [f"batch {batch}: plain {plain:.1f} tok/s ({' / '.join(f'{r:.1f}' for r in rates['plain'])})"]
        for name in args.methods:
            rate = statistics.median(rates[name])
            line.append(f"{name} {rate:.1f} ({' / '.join(f'{r:.1f}' for r in rates[name])}): {rate / plain:.2f}x, "
                        f"{acceptance[name]}, same tokens: {tokens[name] == tokens['plain']}")
        print("; ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

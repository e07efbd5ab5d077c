"""The standard benchmark workload: N prompts as lists of token ids.

A copy of ``shared/bench/workload.py`` so the repository is self-contained; it must stay
identical in output. Fully determined by its arguments, so every engine (kvloom or a peer) gets the
same prompts: lengths uniform in [min_len, max_len], ids uniform in [id_lo, id_hi] (inside
SmolLM2's 49,152-token vocabulary), drawn from ``random.Random(seed)`` — length first, then that
prompt's ids. ``make_workload(8)`` is the first 8 prompts of ``make_workload(64)``.

    make_workload(64)   # 64 prompts, 9,202 tokens at seed 0
    make_workload(8)    # 8 prompts, 1,230 tokens
    python -m kvloom.bench.workload -n 64 --out prompts.json
"""

from __future__ import annotations

import argparse
import json
import random

DEFAULTS: dict[str, int] = dict(seed=0, min_len=32, max_len=256, id_lo=1000, id_hi=40000)


def make_workload(n: int, seed: int = DEFAULTS["seed"], min_len: int = DEFAULTS["min_len"],
                  max_len: int = DEFAULTS["max_len"], id_lo: int = DEFAULTS["id_lo"],
                  id_hi: int = DEFAULTS["id_hi"]) -> list[list[int]]:
    """``n`` prompts of token ids; the same arguments always give the same prompts."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        prompts.append([rng.randint(id_lo, id_hi) for _ in range(length)])
    return prompts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--num-prompts", type=int, default=64)
    for key, value in DEFAULTS.items():
        parser.add_argument("--" + key.replace("_", "-"), type=int, default=value)
    parser.add_argument("--out", help="write the prompts here as a JSON list of lists")
    args = parser.parse_args(argv)
    prompts = make_workload(args.num_prompts, args.seed, args.min_len, args.max_len, args.id_lo,
                            args.id_hi)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(prompts, f)
    lengths = [len(p) for p in prompts]
    print(f"prompts={len(prompts)} total_tokens={sum(lengths)} min={min(lengths)} max={max(lengths)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode at one sequence on a Q4_K GGUF, its Q4_K layers on the file's super-blocks (the default) or as code blocks
(``--code-blocks``: ``override_backend_config {"gguf_super_blocks": false}``), for a paired comparison.

    .venv/bin/python benchmarks/q4k_decode.py MODEL.gguf [--code-blocks] [--tokens 64] [--repeats 5]

Prints the load's seconds, the packed bytes of the projections (what a decode token streams besides the head and
the embedding row), and the median (min-max) milliseconds per generated token over the repeats (greedy, a 16-token
prompt, ``--tokens`` tokens after the first). With KVLOOM_PACKED_CACHE=0 the load packs from the file every time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvloom import LLM, SamplingParams  # noqa: E402
from kvloom.layers.linear import Linear  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--code-blocks", action="store_true", help="Q4_K layers as code blocks (the old packing)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype="float32", max_model_len=512,
              override_backend_config={"gguf_super_blocks": not args.code_blocks})
    load = time.perf_counter() - start
    model = llm.llm_engine.executor.driver.model
    packed = [m.packed for m in model.modules() if isinstance(m, Linear)]
    nbytes = sum(v.numel() * v.element_size() for p in packed for v in vars(p).values() if isinstance(v, torch.Tensor))
    kinds = sorted({type(p).__name__ for p in packed})
    prompt = {"prompt_token_ids": list(range(3, 19))}

    def generate(tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        begin = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - begin

    generate(args.tokens + 1)  # warm-up
    per_token = []
    for _ in range(args.repeats):
        # the prompt and first token timed apart, so that the difference is decode alone
        per_token.append((generate(args.tokens + 1) - generate(1)) / args.tokens)
    median = statistics.median(per_token)
    print(f"{'code blocks' if args.code_blocks else 'super-blocks'} ({', '.join(kinds)}): load {load:.2f} s, "
          f"projections {nbytes / 1e6:.2f} MB, decode {median * 1e3:.2f} ms/token "
          f"(min {min(per_token) * 1e3:.2f}, max {max(per_token) * 1e3:.2f}), "
          f"{nbytes / median / 1e9:.1f} GB/s of projection bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())

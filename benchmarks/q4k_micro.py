"""The k-quant product on the file's super-blocks (ops/q4k.py PackedKQuantWeight) against the code-block product it
replaces (ops/q4.py PackedQ4Weight on the decoded weight), streamed as decode does.

    .venv/bin/python benchmarks/q4k_micro.py                          # 1 row, both shape sets
    .venv/bin/python benchmarks/q4k_micro.py --shapes 1b --rows 1 4 --pairs 30

One process holds both products of the same random Q4_K weights (``--mix q4_k_m``: Q4_K_M's Q6_K v and down in every
other layer, its q|k|v one product of both types). A pass calls each product of a set once: the
projections of every layer of a model shape (``small``: a SmolLM2-like width 512 (SmolLM2's own 576 holds no whole
super-block), 30 layers; ``1b``: Llama-3.2-1B's, 16 layers), each layer its own weights, far more bytes than the
caches hold. Passes alternate between the sets, so the machine's drift falls on both. Printed: the seconds each
packing took from the file's bytes; per set microseconds a pass (median, min-max), its bytes and their GB/s; then
the ratio new / old of the passes' times (median of the pairs' ratios, min-max).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvloom.ops.cpu import load_cpu_kernel  # noqa: E402
from kvloom.ops.q4 import PackedQ4Weight  # noqa: E402
from kvloom.ops.q4k import (  # noqa: E402
    Q6_K_SUPER_BYTES,
    SUPER_BYTES,
    KQuantRows,
    PackedKQuantWeight,
    Q4KBlocks,
    Q6KBlocks,
)

# (K, N) of a layer's products (q|k|v, o, gate|up, down), v's rows, and its layer count.
SHAPES = {"small": (((512, 768), (512, 512), (512, 3072), (1536, 512)), 128, 30),
          "1b": (((2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)), 512, 16)}


def random_bytes(n: int, k: int, rng: np.random.Generator, six: bool) -> Q4KBlocks | Q6KBlocks:
    """Random super-blocks: random scale, min and code bytes, small positive fp16 d (and dmin); the largest sub-scale
    (and min) of each as llama.cpp's quantizers make it (Q4_K 63, Q6_K -128), so that the code blocks hold their
    scales in two levels, as they do a real file's."""
    count = n * k // 256
    raw = rng.integers(0, 256, size=(count, Q6_K_SUPER_BYTES if six else SUPER_BYTES), dtype=np.uint8)
    for offset in (208,) if six else (0, 2):
        raw[:, offset:offset + 2] = rng.uniform(1e-5, 2e-4, count).astype(np.float16).view(np.uint8).reshape(count, 2)
    if six:
        raw[:, 192] = 0x80
    else:
        raw[:, 4] |= 63
        raw[:, 8] |= 63
    return (Q6KBlocks if six else Q4KBlocks).from_gguf(torch.from_numpy(raw.reshape(-1)), (n, k))


def random_weight(n: int, k: int, v_rows: int, rng: np.random.Generator, mix: str, layer: int, part: int
                  ) -> KQuantRows:
    """A projection of ``mix``: "q4_k" all Q4_K; "q4_k_m" as llama.cpp's Q4_K_M in every other layer (q|k|v's last
    ``v_rows`` rows and down in Q6_K), Q4_K elsewhere."""
    more_bits = mix == "q4_k_m" and layer % 2 == 0
    if more_bits and part == 3:
        return KQuantRows.of(None, random_bytes(n, k, rng, six=True))
    if more_bits and part == 0:
        return KQuantRows.of(random_bytes(n - v_rows, k, rng, six=False), random_bytes(v_rows, k, rng, six=True))
    return KQuantRows.of(random_bytes(n, k, rng, six=False), None)


def nbytes(product: object) -> int:
    return sum(v.numel() * v.element_size() for v in vars(product).values() if isinstance(v, torch.Tensor))


def run(products: list[tuple[int, object]], inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for k, product in products:
        product(inputs[k])
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", choices=sorted(SHAPES), nargs="+", default=sorted(SHAPES, reverse=True))
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--pairs", type=int, default=20, help="alternated passes per set")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the activations'")
    parser.add_argument("--mix", choices=("q4_k", "q4_k_m"), default="q4_k",
                        help="all Q4_K, or Q4_K_M's Q6_K v and down in every other layer")
    args = parser.parse_args()
    error = load_cpu_kernel()
    if error is not None:
        raise SystemExit(f"the CPU kernels are not built here: {error}")
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    for name in args.shapes:
        shapes, v_rows, layers = SHAPES[name]
        old: list[tuple[int, object]] = []
        new: list[tuple[int, object]] = []
        packing = {"old": 0.0, "new": 0.0}  # seconds from the file's bytes to the packed product
        file_bytes = 0
        for layer in range(layers):
            for part, (k, n) in enumerate(shapes):
                weight = random_weight(n, k, v_rows, rng, args.mix, layer, part)
                file_bytes += sum(p.data.numel() for p in (*weight.q4_k, *weight.q6_k))
                start = time.perf_counter()
                # the layer in one form, as before; bf16 activations on the int8 products as the engine's op table
                # gives them by default (no batch-dependent AMX-BF16 tiles)
                old.append((k, PackedQ4Weight(weight.to_blocks(), None, bf16_tiles=False)))
                packing["old"] += time.perf_counter() - start
                start = time.perf_counter()
                new.append((k, PackedKQuantWeight(weight, None)))
                packing["new"] += time.perf_counter() - start
        sizes = {label: sum(nbytes(p) for _, p in products) for label, products in (("old", old), ("new", new))}
        print(f"{name}: packed from the file's bytes in {packing['old']:.2f} s (decoded, then code blocks) and "
              f"{packing['new']:.2f} s (super-blocks)")
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k, dtype=getattr(torch, args.dtype)) for k in {k for k, _ in shapes}}
            for products in (old, new):  # warm-up
                run(products, inputs)
            times: dict[str, list[float]] = {"old": [], "new": []}
            for _ in range(args.pairs):
                times["old"].append(run(old, inputs))
                times["new"].append(run(new, inputs))
            print(f"{name} {args.mix}, {rows} row(s), {args.threads} thread(s); the file's bytes "
                  f"{file_bytes / 1e6:.1f} MB")
            for label in ("old", "new"):
                t = times[label]
                median = statistics.median(t)
                print(f"  {label}: {median * 1e6:9.0f} us (min {min(t) * 1e6:.0f}, max {max(t) * 1e6:.0f}), "
                      f"{sizes[label] / 1e6:.1f} MB ({sizes[label] / file_bytes:.3f}x the file's), "
                      f"{sizes[label] / median / 1e9:.1f} GB/s")
            ratios = [b / a for a, b in zip(times["old"], times["new"])]
            print(f"  new / old time: {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Packed weights on 4 KiB pages against the same weights on transparent huge pages, streamed as decode does.

    .venv/bin/python benchmarks/huge_pages_micro.py                      # Q4_K at 1 row, Llama-3.1-8B's shapes
    .venv/bin/python benchmarks/huge_pages_micro.py --product q6_k --rows 1 8 --pairs 30

One process holds two sets of the same packed products (kvloom/ops/huge_pages.py): every tensor of one copied
into ordinary anonymous pages, of the other onto a 2 MiB-aligned mapping advised MADV_HUGEPAGE. A pass calls each
product of a set once (q/k/v, o, gate/up, down of Llama-3.1-8B, two distinct copies each, ~0.3-0.9 GB: far more
than the caches hold); passes alternate between the sets, so the machine's drift falls on both. Printed: GB/s of
packed bytes per pass for each set, and the ratio (median of the pairs' ratios, with their spread).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import int8_micro  # noqa: E402

from kvloom.ops import huge_pages  # noqa: E402
from kvloom.ops.cpu import load_cpu_kernel  # noqa: E402

SHAPES_8B = ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096))  # (K, N): q/k/v, o, gate/up, down


def moved(product: object, huge: bool) -> object:
    """A copy of a packed product whose tensors of 1 MiB or more live on huge pages (``huge``) or 4 KiB ones."""
    twin = copy.copy(product)
    for name, value in vars(product).items():
        if isinstance(value, torch.Tensor) and value.numel() * value.element_size() >= 1 << 20:
            nbytes = value.numel() * value.element_size()
            out = huge_pages.mapped_zeros(nbytes, huge).view(value.dtype).view(value.shape)
            out.copy_(value)
            setattr(twin, name, out)
    return twin


def run(products: list[tuple[int, object]], inputs: dict[int, torch.Tensor]) -> float:
    """Seconds of one pass: each product once."""
    start = time.perf_counter()
    for k, product in products:
        product(inputs[k])
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--product", choices=int8_micro.DECODE_NAMES, default="q4_k")
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--pairs", type=int, default=20, help="alternated passes per set")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if load_cpu_kernel() is not None:
        raise SystemExit("the CPU kernels are not built here")
    which = int8_micro.DECODE_NAMES.index(args.product)
    sets: dict[bool, list[tuple[int, object]]] = {False: [], True: []}
    for k, n in SHAPES_8B:
        torch.manual_seed(0)
        product = int8_micro.decode_products(torch.randn(n, k, dtype=torch.bfloat16), max(args.rows))[which]
        for huge in (False, True):
            sets[huge] += [(k, moved(product, huge)) for _ in range(2)]
    nbytes = sum(int8_micro.packed_bytes(p) for _, p in sets[False])
    print(f"{args.product}, {args.threads} threads, {nbytes / 1e9:.2f} GB a pass, {args.pairs} alternated pairs")
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k, _ in SHAPES_8B}

        for huge in (False, True):
            run(sets[huge], inputs)
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(args.pairs):
            for huge in ((False, True) if i % 2 == 0 else (True, False)):
                times[huge].append(run(sets[huge], inputs))
        ratios = sorted(a / b for a, b in zip(times[False], times[True]))
        small, large = (nbytes / statistics.median(times[h]) / 1e9 for h in (False, True))
        print(f"rows {rows:3d}: 4 KiB pages {small:5.1f} GB/s, huge pages {large:5.1f} GB/s, huge / 4 KiB "
              f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

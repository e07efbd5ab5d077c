"""The bf16 linears of the default model's shapes: kvloom's GEMM (csrc/gemm.cpp) against oneDNN.

    .venv/bin/python benchmarks/gemm_micro.py                 # batches 1, 8, 64, 256, 2048
    .venv/bin/python benchmarks/gemm_micro.py --rows 8 64

Per shape: median microseconds and GFLOP/s with the weight hot in cache, and the ratio. Then a
model-like pass: 30 layers' worth of distinct weights (more than the L3 holds), as a decode step
streams them. Both sides get the same inputs and thread count; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kvloom.ops.cpu import PackedWeight, linear_format

# SmolLM2-135M: qkv, o, gate_up, down (per layer) and the LM head, as (K, N).
LAYER_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))
HEAD_SHAPE = (576, 49152)


def median_seconds(fn: Callable[..., object], arg: object, repeats: int) -> float:
    for _ in range(2):
        fn(arg)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def run_all(work: tuple[list[PackedWeight], dict[int, torch.Tensor]]) -> None:
    packed, inputs = work
    for p in packed:
        p(inputs[p.in_features])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256, 2048])
    parser.add_argument("--layers", type=int, default=30, help="distinct weights per shape in the model-like pass")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if linear_format(torch.bfloat16) != "kvloom":
        print("kvloom's GEMM is not available here (it needs AVX512-BF16 and the built CPU kernels)")
        return 1
    print(f"threads {args.threads}; median of repeats; GF/s = 2*M*K*N / time")
    for rows in args.rows:
        for k, n in (*LAYER_SHAPES, HEAD_SHAPE):
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            weight = torch.randn(n, k, dtype=torch.bfloat16)
            ours, onednn = PackedWeight(weight, None, "kvloom", rows), PackedWeight(weight, None, "onednn", rows)
            repeats = 5 if rows * n > 10_000_000 else 30
            t_ours, t_onednn = median_seconds(ours, x, repeats), median_seconds(onednn, x, repeats)
            flops = 2 * rows * k * n
            print(f"M={rows:5d} K={k:5d} N={n:6d}: onednn {t_onednn * 1e6:9.0f} us {flops / t_onednn / 1e9:4.0f} GF/s"
                  f" | kvloom {t_ours * 1e6:9.0f} us {flops / t_ours / 1e9:4.0f} GF/s | x{t_onednn / t_ours:.2f}")
        weights = [torch.randn(n, k, dtype=torch.bfloat16) for _ in range(args.layers) for k, n in LAYER_SHAPES]
        inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k, _ in LAYER_SHAPES}
        for fmt in ("onednn", "kvloom"):
            packed = [PackedWeight(w, None, fmt, rows) for w in weights]
            seconds = median_seconds(run_all, (packed, inputs), 7)
            print(f"M={rows:5d} {args.layers} layers of distinct weights, {fmt:6s}: {seconds * 1e3:8.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

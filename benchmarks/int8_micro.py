"""The int8 and 4/5/6-bit linears of the default model's shapes (csrc/gemm_int8.cpp, gemm_q4.cpp) against kvloom's
bf16 GEMM.

    .venv/bin/python benchmarks/int8_micro.py                 # batches 1, 8, 64, 256, 2048
    .venv/bin/python benchmarks/int8_micro.py --rows 1 64 --repeats 41

Per shape and batch: the bf16 packed GEMM (csrc/gemm.cpp), the int8 W8A8 product, the int8 weight-only
product, the W8A8 product on Q8_0 blocks (scales per 32 k, activations quantized per block) and the code-block
product on Q4_1 blocks, on Q5_1-like 5-bit ones and on Q6_K-like 6-bit ones (scales per 16 k), timed in turn
within each repeat (so a burst of load from elsewhere hits them all alike), with the weight hot in cache: median
microseconds, the spread (25th-75th percentile, in % of the median) and each quantized product's speed-up over
bf16. Then gemm_micro's model-like pass: 30 layers' worth of distinct weights (more than the L3 holds), as a
decode step streams them.
Activations are bf16 (the model's dtype on the CPU); run it on a quiet machine.

    .venv/bin/python benchmarks/int8_micro.py --decode-shapes 1b 8b --rows 1 4 16 64 --threads 1

With --decode-shapes, the products of a GGUF model at 1B-8B shapes instead (Llama-3.2-1B, Llama-3.1-8B: q/k/v
fused, o, gate/up fused, down, the LM head of 128,256 rows), each with the weight streaming from memory (distinct
copies cycled, 256 MiB or more of each product's bytes, as a decode step reads them): bf16 panels, Q8_0 blocks,
Q4_K (4-bit, fp32 scales per 32) and Q6_K (6-bit, per 16), timed in turn. Per product: median microseconds, spread,
and GB/s of packed bytes (codes, scales) streamed per call: at one row, its fraction of the read-bandwidth probe
(kvloom.bench.membw, on the same thread count) is how near the product is to the memory bound.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable

import torch
from gemm_micro import HEAD_SHAPE, LAYER_SHAPES, run_all

from kvloom.ops.cpu import PackedInt8BlocksWeight, PackedInt8Weight, PackedWeight, int8_kernels_available, linear_format
from kvloom.ops.int8 import quantize_per_block, quantize_per_channel
from kvloom.ops.q4 import PackedQ4Weight, Q4Blocks

NEVER = 1 << 62  # w8a8_min_rows that keeps a PackedInt8Weight on the weight-only product


def alternated_seconds(fns: list[Callable[[object], object]], args: list[object], repeats: int) -> list[list[float]]:
    """Seconds per call of each fns[i](args[i]), the functions taking turns within every repeat."""
    for fn, arg in zip(fns, args):
        fn(arg)
        fn(arg)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, arg, samples in zip(fns, args, times):
            start = time.perf_counter()
            fn(arg)
            samples.append(time.perf_counter() - start)
    return times


def summary(samples: list[float]) -> tuple[float, float]:
    """(median, interquartile spread as a fraction of the median)."""
    s = sorted(samples)
    median = s[len(s) // 2]
    return median, (s[(3 * len(s)) // 4] - s[len(s) // 4]) / median


def products(weight: torch.Tensor, rows: int) -> list[object]:
    """bf16 packed GEMM, int8 W8A8, int8 weight-only, W8A8 on Q8_0 blocks and the code-block products (4-bit Q4_1,
    5-bit, 6-bit in groups of 16), for one bf16 [N, K] weight."""
    qweight, scale = quantize_per_channel(weight)
    return [PackedWeight(weight, None, "kvloom", rows), PackedInt8Weight(qweight, scale, None, w8a8_min_rows=0),
            PackedInt8Weight(qweight, scale, None, w8a8_min_rows=NEVER),
            PackedInt8BlocksWeight(*quantize_per_block(weight), None),
            PackedQ4Weight(Q4Blocks.quantize(weight), None), PackedQ4Weight(Q4Blocks.quantize(weight, 5), None),
            PackedQ4Weight(Q4Blocks.quantize(weight, 6, 16), None)]


NAMES = ("bf16", "w8a8", "w-only", "blocks", "q4", "q5", "q6")


def report(label: str, times: list[list[float]]) -> str:
    """One line: each product's median and spread, and the int8 ones' speed-up over bf16."""
    medians = [summary(t) for t in times]
    cells = " | ".join(f"{name} {m * 1e6:8.0f} us [{spread * 100:3.0f}%]" for name, (m, spread) in zip(NAMES, medians))
    ratios = " ".join(f"{name} x{medians[0][0] / m:.2f}" for name, (m, _) in zip(NAMES[1:], medians[1:]))
    return f"{label}: {cells} | {ratios}"


# (K, N) of a layer's linears (q/k/v fused, o, gate/up fused, down) and the LM head.
DECODE_SHAPES = {
    "1b": ((2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048), (2048, 128256)),
    "8b": ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 128256)),
}
DECODE_NAMES = ("bf16", "q8_0", "q4_k", "q6_k")
STREAM_BYTES = 256 << 20


def packed_bytes(product: object) -> int:
    """Bytes of a packed weight a call streams (its tensors: panels, scales, bit planes)."""
    return sum(t.numel() * t.element_size() for t in vars(product).values() if isinstance(t, torch.Tensor))


def decode_products(weight: torch.Tensor, rows: int) -> list[object]:
    """bf16 panels, Q8_0 blocks, Q4_K-like 4-bit blocks and Q6_K-like 6-bit ones (per 16), both with fp32 scales and
    offsets as a K-quant's products of two scales are packed, for one bf16 [N, K] weight."""
    def as_k_quant(blocks: Q4Blocks) -> Q4Blocks:  # scales that are not fp16 values, packed as fp32 as K-quants' are
        return Q4Blocks(blocks.codes, blocks.d * (1 + 2**-12), blocks.m * (1 + 2**-12))

    return [PackedWeight(weight, None, "kvloom", rows), PackedInt8BlocksWeight(*quantize_per_block(weight), None),
            PackedQ4Weight(as_k_quant(Q4Blocks.quantize(weight)), None),
            PackedQ4Weight(as_k_quant(Q4Blocks.quantize(weight, 6, 16)), None)]


def copies(product: object, count: int) -> list[object]:
    """``count`` packed weights of the same values in distinct memory (a step's layers, read once each)."""
    out = [product]
    for _ in range(count - 1):
        twin = copy.copy(product)
        for name, value in vars(product).items():
            if isinstance(value, torch.Tensor):
                setattr(twin, name, value.clone())
        out.append(twin)
    return out


def cycled(weights: list[object]) -> Callable[[torch.Tensor], object]:
    """A call that runs the next of ``weights`` each time, so none is in cache when its turn comes again."""
    turn = [0]

    def call(x: torch.Tensor) -> object:
        turn[0] = (turn[0] + 1) % len(weights)
        return weights[turn[0]](x)
    return call


def decode_pass(shape_sets: list[str], rows_list: list[int], repeats: int) -> None:
    from kvloom.bench.membw import read_bandwidth  # noqa: PLC0415 (only this pass needs the C probe)

    bandwidth = read_bandwidth(torch.get_num_threads(), 512, 5)["median_gb_s"]
    print(f"read-bandwidth probe (kvloom.bench.membw, {torch.get_num_threads()} threads): {bandwidth:.1f} GB/s")
    for shape_set in shape_sets:
        for k, n in DECODE_SHAPES[shape_set]:
            torch.manual_seed(0)
            weight = torch.randn(n, k, dtype=torch.bfloat16)
            base = decode_products(weight, max(rows_list))
            del weight
            sizes = [packed_bytes(p) for p in base]
            fns = [cycled(copies(p, max(2, -(-STREAM_BYTES // size)))) for p, size in zip(base, sizes)]
            for rows in rows_list:
                x = torch.randn(rows, k, dtype=torch.bfloat16)
                times = alternated_seconds(fns, [x] * len(fns), repeats or (15 if n > 100_000 else 41))
                cells = []
                for name, samples, size in zip(DECODE_NAMES, times, sizes):
                    median, spread = summary(samples)
                    rate = size / median / 1e9
                    cells.append(f"{name} {median * 1e6:7.0f} us [{spread * 100:3.0f}%] {rate:5.1f} GB/s "
                                 f"{rate / bandwidth:4.2f}")
                print(f"{shape_set} M={rows:3d} K={k:5d} N={n:6d}: " + " | ".join(cells), flush=True)
            del fns, base


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256, 2048])
    parser.add_argument("--repeats", type=int, default=0, help="per shape (default: 31, or 7 for the big ones)")
    parser.add_argument("--layers", type=int, default=30, help="distinct weights per shape in the model-like pass")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--decode-shapes", nargs="+", choices=sorted(DECODE_SHAPES), default=[],
                        help="time bf16 / Q8_0 / Q4_K / Q6_K at these models' shapes, streaming (GB/s) instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if linear_format(torch.bfloat16) not in ("kvloom", "hybrid") or not int8_kernels_available():
        print("kvloom's GEMMs are not available here (they need AVX2 or AVX-512 and the built CPU kernels)")
        return 1
    if args.decode_shapes:
        decode_pass(args.decode_shapes, args.rows, args.repeats)
        return 0
    print(f"threads {args.threads}; median us [interquartile spread %]; x = bf16 time / int8 time")
    for rows in args.rows:
        for k, n in (*LAYER_SHAPES, HEAD_SHAPE):
            torch.manual_seed(0)
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            fns = products(torch.randn(n, k, dtype=torch.bfloat16), rows)
            repeats = args.repeats or (7 if rows * n > 10_000_000 else 31)
            print(report(f"M={rows:5d} K={k:5d} N={n:6d}", alternated_seconds(fns, [x] * len(fns), repeats)))
        weights = [torch.randn(n, k, dtype=torch.bfloat16) for _ in range(args.layers) for k, n in LAYER_SHAPES]
        inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k, _ in LAYER_SHAPES}
        model: list[list[object]] = [[] for _ in NAMES]
        for weight in weights:
            for i, p in enumerate(products(weight, rows)):
                model[i].append(p)
        times = alternated_seconds([run_all] * len(NAMES), [(packed, inputs) for packed in model], 7)
        print(report(f"M={rows:5d} {args.layers} layers of distinct weights", times))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

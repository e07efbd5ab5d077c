"""The LM head's product at a GGUF's real table, by rows (the sequences of a decode step), against bf16.

    PYTHONPATH=. .venv/bin/python benchmarks/head_micro.py --model llama-3.2-1b --rows 1 4 16 64

Reads the tied table of the cached real-size files (``kvloom bench realsize`` makes them: the Q8_0 file's Q8_0 table,
the Q4_K_M file's Q6_K one) and times, in turn within every repeat: the table in bf16 (kvloom's bf16 GEMM, what
a dequantized table runs), the Q8_0 blocks with the file's fp16 scales (the default) and with fp32 ones (9 bits a
weight), and the Q6_K code blocks (kvloom/ops/q4.py's product). The table (0.2-0.5 GB) is far past the caches, so each
call streams it from memory, as a decode step does. Per product: median milliseconds, interquartile spread, the
packed bytes and their rate, and the ratio to bf16 (> 1: faster).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvloom.bench.realsize_shapes import gguf_path
from kvloom.loader import gguf
from kvloom.ops.cpu import PackedInt8BlocksWeight, PackedWeight, int8_kernels_available, pack_block_columns
from kvloom.ops.q4 import PackedQ4Weight


def table(path: str) -> tuple[int, torch.Tensor, tuple[int, ...]]:
    """The file's token_embd as (ggml type, raw bytes) and its [vocab, hidden] shape."""
    info = gguf.read_gguf(path).tensors["token_embd.weight"]
    return info.ggml_type, gguf.read_tensor_bytes(path, info), tuple(info.shape)


def packed_bytes(product: object) -> int:
    return sum(t.numel() * t.element_size() for t in vars(product).values() if isinstance(t, torch.Tensor))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-1b", help="a real-size shape whose q8_0 and q4_k_m files exist")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    if not int8_kernels_available():
        raise SystemExit("kvloom's C++ kernels are not built here (they need AVX2 or AVX-512)")
    _, raw, shape = table(str(gguf_path(args.model, "q8_0")))
    q8 = gguf.q8_0_blocks(raw, shape)
    q6_type, raw6, shape6 = table(str(gguf_path(args.model, "q4_k_m")))
    if q6_type != gguf.GGML_Q6_K:
        raise SystemExit(f"{args.model}'s Q4_K_M table is ggml type {q6_type}, not Q6_K")
    q6 = gguf.q4_blocks(raw6, q6_type, shape6)
    bf16 = q8.dequantize().to(torch.bfloat16)
    fp32_scales = PackedInt8BlocksWeight(*q8, None)
    fp32_scales.scale = pack_block_columns(q8.scale.float())  # as packed before fp16 scales
    products = {"bf16": PackedWeight(bf16, None, "kvloom", max(args.rows)), "q8_0": PackedInt8BlocksWeight(*q8, None),
                "q8_0 fp32 scales": fp32_scales, "q6_k": PackedQ4Weight(q6, None)}
    del bf16, q8, q6, raw, raw6
    sizes = {name: packed_bytes(p) for name, p in products.items()}
    print(f"{args.model} head {shape[0]} x {shape[1]}, {torch.get_num_threads()} threads; packed MiB: "
          + ", ".join(f"{name} {size / 2**20:.0f}" for name, size in sizes.items()))
    for rows in args.rows:
        x = torch.randn(rows, shape[1], dtype=torch.bfloat16)
        times: dict[str, list[float]] = {name: [] for name in products}
        for product in products.values():
            product(x)
        for _ in range(args.repeats):
            for name, product in products.items():
                start = time.perf_counter()
                product(x)
                times[name].append(time.perf_counter() - start)
        cells = []
        for name, samples in times.items():
            s = sorted(samples)
            median, spread = s[len(s) // 2], (s[3 * len(s) // 4] - s[len(s) // 4]) / s[len(s) // 2]
            bf16 = sorted(times["bf16"])[len(s) // 2]
            cells.append(f"{name} {median * 1e3:7.2f} ms [{spread * 100:3.0f}%] {sizes[name] / median / 1e9:5.1f} GB/s "
                         f"x{bf16 / median:.2f}")
        print(f"rows {rows:3d}: " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

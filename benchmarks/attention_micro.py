"""One attention layer call, backend against backend: ms per call, median of interleaved repeats.

Wall time is what a step waits; with --threads 1 the CPU time is printed too, which is steadier
on a shared host.

    .venv/bin/python benchmarks/attention_micro.py [--threads 2] [--repeats 30] [--backends native,cpu]
    .venv/bin/python benchmarks/attention_micro.py --backends cpu-rows,cpu   # the key cache's two layouts

Two batches with SmolLM2-135M's shapes (9 query heads, 3 KV heads, head size 64, bf16, blocks of 16):
a decode batch (64 requests, ~384 cached tokens each) and a prefill batch (16 fresh prompts of ~150
tokens). 'cpu' reads the caches in the layout the op table allocates (pairs where the build has
AVX512-BF16), 'cpu-rows' the same kernel on caches in rows. Each call reads a different layer's cache
in turn, as a model would, so the K/V come from memory rather than from a cache the previous call
warmed. The metadata is built as the model runner builds it (decodes padded to a 64-token bucket for 'native').

    .venv/bin/python benchmarks/attention_micro.py --dense [--shape 17,12,1024,64] [--dtype bfloat16] [--repeats 7]

--dense times the vision tower's attention instead (models/vision_encoder.py: no mask, no cache), kvloom's
csrc/dense_attention.cpp (ops/cpu.py dense_attention, the kernel called directly) against torch's SDPA at
[tiles, heads, patches, head_dim] (default SmolVLM-256M's tower on a 2048-pixel image: 17 tiles), q/k/v as views of
one fused projection as the tower passes them: GFLOP/s (4 * tiles * heads * patches^2 * head_dim per call), medians
of alternated calls, and the largest difference from an fp32 SDPA.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvloom.ops.metadata import AttentionMetadata  # noqa: E402
from kvloom.ops.table import select_ops  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def build_step(batch: list[tuple[int, int]], layers: int, dtype: torch.dtype, seed: int = 0):
    """(metadata, q, k, v, per-layer caches) for requests of (new tokens, cached context)."""
    rng = random.Random(seed)
    blocks_per_request = [-(-(q + c) // BLOCK_SIZE) for q, c in batch]
    num_blocks = 1 + sum(blocks_per_request)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables, slots, seq_lens, starts = [], [], [], [0]
    for (new, context), count in zip(batch, blocks_per_request):
        blocks = [free.pop() for _ in range(count)]
        tables.append(blocks)
        slots.extend(blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(context, context + new))
        seq_lens.append(new + context)
        starts.append(starts[-1] + new)
    num_decodes = sum(1 for q, _ in batch if q == 1)
    width = max(blocks_per_request)
    decode_blocks = 0
    if num_decodes:  # the model runner's 64-token bucket
        step = max(1, 64 // BLOCK_SIZE)
        decode_blocks = -(-max(blocks_per_request[:num_decodes]) // step) * step
        width = max(width, decode_blocks)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens=torch.tensor(seq_lens), query_start_loc=starts, seq_lens_host=seq_lens, num_decodes=num_decodes,
        block_size=BLOCK_SIZE, decode_num_blocks=decode_blocks)
    if num_decodes:
        key_pos = torch.arange(decode_blocks * BLOCK_SIZE)[None, :]
        metadata.decode_mask = (key_pos < metadata.seq_lens[:num_decodes, None])[:, None, None, :]
    tokens = starts[-1]
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)) for _ in range(layers)]
    q = torch.randn(tokens, HEADS, HEAD_DIM, dtype=dtype)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, dtype=dtype)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, dtype=dtype)
    return metadata, q, k, v, caches


def in_layout(ops, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The caches (in rows) copied into the layout ``ops`` allocates."""
    out = []
    for key_cache, value_cache in caches:
        blocks = key_cache.shape[0]
        key_like, _ = ops.allocate_kv_cache(1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, key_cache.dtype, "cpu")
        if key_like.dim() == 5:  # the pairs layout (ops/reference.py allocate_kv_cache)
            key_cache = key_cache.view(blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM // 2, 2).permute(0, 2, 3, 1, 4)
            value_cache = value_cache.view(blocks, BLOCK_SIZE // 2, 2, KV_HEADS, HEAD_DIM).permute(0, 3, 1, 4, 2)
        out.append((key_cache.contiguous(), value_cache.contiguous()))
    return out


def time_backends(name: str, backends: list[str], step, repeats: int) -> None:
    metadata, q, k, v, rows_caches = step
    scale = HEAD_DIM ** -0.5
    ops = {b: select_ops(torch.device("cpu"), torch.bfloat16, b.removesuffix("-rows")) for b in backends}
    attention = {b: ops[b].attention for b in backends}
    layer_caches = {b: rows_caches if b.endswith("-rows") else in_layout(ops[b], rows_caches) for b in backends}
    times: dict[str, list[float]] = {b: [] for b in backends}
    cpu_times: dict[str, list[float]] = {b: [] for b in backends}
    outputs = {}
    for b in backends:  # warm-up, and the outputs to compare
        outputs[b] = attention[b](q, k, v, *layer_caches[b][0], metadata, scale)
    for i in range(repeats):
        for b in backends:
            layer = layer_caches[b][i % len(rows_caches)]
            start, cpu_start = time.perf_counter(), time.process_time()
            attention[b](q, k, v, *layer, metadata, scale)
            times[b].append(time.perf_counter() - start)
            cpu_times[b].append(time.process_time() - cpu_start)
    tokens, contexts = q.shape[0], metadata.seq_lens_host
    print(f"{name}: {metadata.num_requests} requests, {tokens} new tokens, "
          f"context {min(contexts)}..{max(contexts)}")
    base = statistics.median(times[backends[0]])
    for b in backends:
        ms = statistics.median(times[b]) * 1e3
        error = (outputs[b].float() - outputs[backends[0]].float()).abs().max().item()
        # The process's CPU time counts other threads' only at scheduler ticks: exact on one thread.
        cpu = f"cpu {statistics.median(cpu_times[b]) * 1e3:7.3f} ms   " if torch.get_num_threads() == 1 else ""
        print(f"  {b:>9}: {ms:8.3f} ms/call  x{base * 1e3 / ms:5.1f} vs {backends[0]}   {cpu}"
              f"max |diff| {error:.1e}")


def time_dense(shape: list[int], dtype: torch.dtype, repeats: int) -> None:
    import torch.nn.functional as F

    from kvloom.ops import cpu

    tiles, heads, patches, head_dim = shape
    kernel = cpu.dense_attention_kernel(dtype, head_dim) if cpu.cpu_kernel_available() else None
    print(f"dense attention [{tiles}, {heads}, {patches}, {head_dim}] {dtype}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, build {cpu.compiled_isa()}, kernel {kernel or 'none (SDPA runs)'}")
    if not cpu.cpu_kernel_available():
        return
    torch.manual_seed(0)
    qkv = torch.randn(tiles, patches, 3, heads, head_dim, dtype=dtype).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    out = torch.empty(tiles, patches, heads, head_dim, dtype=dtype).transpose(1, 2)

    def kvloom_kernel() -> torch.Tensor:  # the op itself, also where the op table would route to SDPA
        torch.ops.kvloom.dense_attention(out, q, k, v, head_dim ** -0.5)
        return out

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)

    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    flop = 4 * tiles * heads * patches * patches * head_dim
    calls = {"kvloom": kvloom_kernel, "sdpa": sdpa}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for name, call in calls.items():  # warm-up
        error = (call().float() - reference).abs().max().item()
        print(f"  {name:>6}: max |diff| from fp32 SDPA {error:.1e}")
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["sdpa"])
    for name in calls:
        median = statistics.median(times[name])
        print(f"  {name:>6}: {median * 1e3:8.1f} ms/call ({min(times[name]) * 1e3:.1f}-{max(times[name]) * 1e3:.1f})  "
              f"{flop / median / 1e9:6.1f} GFLOP/s  x{base / median:4.2f} vs sdpa")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--layers", type=int, default=8, help="caches the calls cycle through")
    parser.add_argument("--backends", default="reference,native,cpu")
    parser.add_argument("--dense", action="store_true", help="the vision tower's dense attention instead")
    parser.add_argument("--shape", default="17,12,1024,64", help="--dense: tiles,heads,patches,head_dim")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"], help="--dense")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dense:
        with torch.inference_mode():
            time_dense([int(x) for x in args.shape.split(",")], getattr(torch, args.dtype), args.repeats)
        return
    backends = args.backends.split(",")
    if select_ops(torch.device("cpu"), torch.bfloat16, "cpu").name != "cpu":  # the warning said why
        backends = [b for b in backends if not b.startswith("cpu")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"Hq={HEADS} Hkv={KV_HEADS} D={HEAD_DIM} bf16, block size {BLOCK_SIZE}")
    rng = random.Random(0)
    with torch.inference_mode():
        decode = [(1, rng.randint(352, 416)) for _ in range(64)]
        time_backends("decode", backends, build_step(decode, args.layers, torch.bfloat16), args.repeats)
        prefill = [(rng.randint(120, 180), 0) for _ in range(16)]
        time_backends("prefill", backends, build_step(prefill, args.layers, torch.bfloat16), args.repeats)


if __name__ == "__main__":
    main()

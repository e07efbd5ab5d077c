"""The fused mixture-of-experts path against a per-expert Python loop over tokens, on the CPU.

    .venv/bin/python benchmarks/moe.py                        # both shapes, N=64 decode rows and a 512-token chunk
    .venv/bin/python benchmarks/moe.py --shapes mixtral --tokens 64 --repeats 9

fused: kvloom's experts as a model runs them (layers/moe.py FusedMoE, prepared by the op table's
``pack_experts``): the step's (token, expert) pairs grouped by expert and each expert's gate/up and down GEMM
run once over its tokens. loop: the naive reference, for each token, for each of its chosen experts, the
two matmuls on that token alone (F.linear on the same weights, same dtype). Both get the same hidden states,
routing weights and expert ids (random router logits, routed as the model routes them); the Qwen-MoE-like
shape's shared expert (a dense SwiGLU MLP behind a sigmoid gate) runs batched, the same way, on both sides.
The two sides alternate within one process; per side the median, and the ratio of the medians.

Shapes, scaled to fit a small CPU (the real models' ratios of hidden to expert width kept):
  mixtral:  hidden 1024, expert intermediate 3584, 8 experts, top-2 (Mixtral-8x7B: 4096, 14336, 8, 2)
  qwen_moe: hidden 1024, expert intermediate 704, 60 experts, top-4, shared expert 2816
            (Qwen1.5-MoE-A2.7B: 2048, 1408, 60, 4, shared 5632)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvloom.layers.moe import FusedMoE, route
from kvloom.ops.reference import silu_and_mul
from kvloom.ops.table import Ops, select_ops


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    shared_intermediate: int = 0  # 0: no shared expert
    renormalize: bool = True


SHAPES = {"mixtral": Shape(1024, 3584, 8, 2),
          "qwen_moe": Shape(1024, 704, 60, 4, shared_intermediate=2816, renormalize=False)}


def naive_loop(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
               ids: torch.Tensor) -> torch.Tensor:
    """The per-token reference: hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], weights/ids [T, k] -> [T, H]."""
    out = torch.zeros_like(hidden)
    ids_host, weights_host = ids.tolist(), weights.tolist()
    for t in range(hidden.shape[0]):
        x = hidden[t:t + 1]  # [1, H]
        for expert, weight in zip(ids_host[t], weights_host[t]):
            out[t:t + 1] += weight * F.linear(silu_and_mul(F.linear(x, w13[expert])), w2[expert])
    return out


class SharedExpert:
    """Qwen-MoE's shared expert: sigmoid(gate(x)) * down(silu(gate_proj x) * up_proj x), batched ([T, H] -> [T, H])."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, ops: Ops) -> None:
        gate_up = torch.randn(2 * intermediate, hidden, dtype=dtype) * hidden ** -0.5
        down = torch.randn(hidden, intermediate, dtype=dtype) * intermediate ** -0.5
        self.gate = torch.randn(1, hidden, dtype=dtype) * hidden ** -0.5

        def linear(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
            return ops.pack_linear(w, None) if ops.pack_linear is not None else (lambda x: F.linear(x, w))

        self.gate_up, self.down = linear(gate_up), linear(down)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.gate)) * self.down(silu_and_mul(self.gate_up(x)))


def timed(fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def bench_shape(name: str, shape: Shape, tokens: int, dtype: torch.dtype, repeats: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    ops = select_ops(torch.device("cpu"), dtype, batch_hint=tokens)
    w13 = torch.randn(shape.experts, 2 * shape.intermediate, shape.hidden, dtype=dtype) * shape.hidden ** -0.5
    w2 = torch.randn(shape.experts, shape.hidden, shape.intermediate, dtype=dtype) * shape.intermediate ** -0.5
    layer = FusedMoE(shape.experts, shape.top_k, shape.hidden, shape.intermediate, shape.renormalize, ops).to(dtype)
    layer.load_stacked("gate_up_proj", w13)
    layer.load_stacked("down_proj", w2)
    layer.process_weights_after_loading(ops)  # the op table's prepared experts, as a loaded model holds them
    shared = SharedExpert(shape.hidden, shape.shared_intermediate, dtype, ops) if shape.shared_intermediate else None
    hidden = torch.randn(tokens, shape.hidden, dtype=dtype)
    router_logits = torch.randn(tokens, shape.experts)
    weights, ids = route(router_logits, shape.top_k, shape.renormalize)  # what the layer routes them to, too

    def fused() -> torch.Tensor:
        out = layer(hidden, router_logits)
        return out + shared(hidden) if shared is not None else out

    def loop() -> torch.Tensor:
        out = naive_loop(hidden, w13, w2, weights, ids)
        return out + shared(hidden) if shared is not None else out

    fused_out, loop_out = fused(), loop()  # warm-up, and the two must agree
    error = ((fused_out.float() - loop_out.float()).abs().max() / loop_out.float().abs().max()).item()
    fused_times, loop_times = [], []
    for i in range(repeats):  # alternated, the order flipped every round
        for side in ((fused, loop) if i % 2 == 0 else (loop, fused)):
            seconds, _ = timed(side)
            (fused_times if side is fused else loop_times).append(seconds)
    fused_ms, loop_ms = statistics.median(fused_times) * 1e3, statistics.median(loop_times) * 1e3
    return {"shape": name, "tokens": tokens, "fused_ms": fused_ms, "loop_ms": loop_ms, "ratio": loop_ms / fused_ms,
            "relative_error": error, "fused_kind": type(layer.packed).__name__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[64, 512],
                        help="rows per step: 64 = a decode step of 64 requests, 512 = a prefill chunk")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    for value in args.tokens:
        if value < 1:
            raise ValueError(f"--tokens must be positive, got {value}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be positive, got {args.repeats}")
    dtype = getattr(torch, args.dtype)
    print(f"torch threads {torch.get_num_threads()}, dtype {args.dtype}, {args.repeats} alternated rounds")
    print(f"{'shape':9} {'tokens':>6} {'fused ms':>9} {'loop ms':>9} {'loop/fused':>10} {'rel err':>8}  fused path")
    for name in args.shapes:
        for tokens in args.tokens:
            r = bench_shape(name, SHAPES[name], tokens, dtype, args.repeats)
            print(f"{r['shape']:9} {r['tokens']:>6} {r['fused_ms']:>9.2f} {r['loop_ms']:>9.2f} {r['ratio']:>9.2f}x "
                  f"{r['relative_error']:>8.1e}  {r['fused_kind']}")


if __name__ == "__main__":
    main()

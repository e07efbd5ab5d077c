"""Where a CUDA decode step's time goes: host phases (cProfile) against the GPU time of the graph replay.

Builds ``LLM`` on a checkpoint (e.g. the one ``gpu_throughput.py --checkpoint-dir`` saved), fills the batch
with N prompts, steps until every request decodes, then:
  - times ``--steps`` engine steps (wall, host-synchronous as the engine runs them);
  - profiles the same number of steps with cProfile (host functions by own time);
  - replays the batch's CUDA graph alone ``--steps`` times between CUDA events (the GPU's share);
and prints the HBM bound of the step (weights + KV read once) for comparison.

    PYTHONPATH=. python benchmarks/gpu_step_profile.py --model /tmp/ckpt -n 256
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from kvloom import LLM, SamplingParams
from kvloom.bench.workload import make_workload
from kvloom.sampling_params import RequestOutputKind


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("-n", "--num-prompts", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--bandwidth", type=float, default=3.35e12, help="HBM bytes/s (H100 SXM)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--no-detokenize", action="store_true", help="as HF generate and gpu_throughput.py run")
    parser.add_argument("--sync-scheduling", action="store_true",
                        help="async_scheduling off (on, the CUDA default, a step's wall time is the pipeline's)")
    args = parser.parse_args()

    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=args.max_model_len, max_num_seqs=args.num_prompts,
              gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
              async_scheduling=not args.sync_scheduling)
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    # FINAL_ONLY, as LLM.generate asks: no per-step output objects.
    params = SamplingParams(temperature=0, max_tokens=4 * args.steps + 8, ignore_eos=True,
                            detokenize=not args.no_detokenize, output_kind=RequestOutputKind.FINAL_ONLY)
    for i, prompt in enumerate(make_workload(args.num_prompts, min_len=128, max_len=512, id_lo=0, id_hi=vocab - 1)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()

    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    step_ms = statistics.median(times) * 1e3

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        engine.step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)

    runner = engine.executor.driver
    gpu_ms = float("nan")
    if runner.graphs is not None:
        batch = min(b for b in runner.graphs.buckets if b >= len(engine.scheduler.running))
        graph = runner.graphs.graphs[batch]
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        begin.record()
        for _ in range(args.steps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        gpu_ms = begin.elapsed_time(end) / args.steps

    mc = engine.model_config
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    contexts = [r.num_tokens for r in engine.scheduler.running]
    kv = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 2 * sum(contexts)
    bound_ms = (weights + kv) / args.bandwidth * 1e3
    print(text.getvalue())
    print(f"{len(contexts)} sequences decoding, mean context {statistics.mean(contexts):.0f}")
    print(f"engine step (wall, median of {args.steps}): {step_ms:.2f} ms")
    print(f"graph replay alone (GPU): {gpu_ms:.2f} ms")
    print(f"HBM bound: {(weights + kv) / 1e9:.2f} GB ({weights / 1e9:.2f} weights + {kv / 1e9:.2f} KV) = "
          f"{bound_ms:.2f} ms; step / bound = {step_ms / bound_ms:.1f}x, replay / bound = {gpu_ms / bound_ms:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

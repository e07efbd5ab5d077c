"""Where kvloom's time goes on the standard workload: prefill vs decode steps, and the top ops.

    .venv/bin/python benchmarks/profile_step.py            # N=64, bf16, the default model
    .venv/bin/python benchmarks/profile_step.py -n 8 --profile-steps 5
    .venv/bin/python benchmarks/profile_step.py --quantization none   # the GGUF dequantized to bf16
"""

from __future__ import annotations

import argparse
import time

from kvloom import LLM, SamplingParams
from kvloom.bench.workload import make_workload


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--profile-steps", type=int, default=3, help="decode steps under torch.profiler")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--quantization", default=None,
                        help="as LLM(quantization=...): by default a GGUF keeps its blocks; \"none\": bf16")
    args = parser.parse_args()

    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=1024, max_num_seqs=args.num_prompts,
              quantization=args.quantization)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # A first prefill and decode pay one-time costs (threads started, oneDNN's kernels generated, AMX requested):
    # out of the figures below (prompts of another seed: nothing for the prefix cache to reuse).
    llm.generate(make_workload(2, seed=1), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    for i, prompt in enumerate(make_workload(args.num_prompts)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)

    prefill = decode = 0.0
    num_prefill = num_decode = 0
    profiled = False
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        decoding = not engine.scheduler.waiting and all(
            r.num_computed_tokens >= r.num_tokens - 1 for r in engine.scheduler.running)
        if decoding and not profiled and num_decode >= 5:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.profile_steps):
                    engine.step()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
            profiled = True
            continue
        t = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t
        if decoding:
            decode, num_decode = decode + elapsed, num_decode + 1
        else:
            prefill, num_prefill = prefill + elapsed, num_prefill + 1
    total = time.perf_counter() - start
    print(f"total {total:.2f} s; prefill {prefill:.2f} s in {num_prefill} steps; decode {decode:.2f} s in "
          f"{num_decode} steps ({1000 * decode / max(num_decode, 1):.1f} ms a step)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a LoRA decode step's time goes: decode steps of the standard workload on the base model, under one
adapter for all, under 8 adapters round-robin on the C++ layer stack, and the same 8 adapters with the layers
run module by module (the per-op path, where the hooks add the deltas); rounds alternated, step medians, and
the top ops of one profiled step of each (torch.profiler; the layer stack's kernels show under their names).

    KVLOOM_CPU_THREAD_POOL=1 PYTHONPATH=. .venv/bin/python benchmarks/lora_profile.py -n 64 --steps 8 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from lora import write_adapter
from torch.profiler import ProfilerActivity, profile

from kvloom import LLM, LoRARequest, SamplingParams
from kvloom.bench import common
from kvloom.bench.workload import make_workload


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--num-prompts", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--top", type=int, default=8, help="ops listed per profiled step")
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="kvloom-lora-profile-")
    arch = common.model_arch(common.DEFAULT_MODEL)
    adapters = [LoRARequest(f"a{k}", k + 1, write_adapter(os.path.join(root, f"a{k}"), arch, args.rank, k))
                for k in range(args.adapters)]
    llm = LLM(common.DEFAULT_MODEL, max_model_len=1024, max_num_seqs=args.num_prompts, enable_lora=True,
              max_loras=args.adapters, max_lora_rank=args.rank, max_cpu_loras=args.adapters)
    engine = llm.llm_engine
    manager = engine.executor.driver.lora
    stack = manager.layer_stack
    prompts = make_workload(args.num_prompts)
    modes: dict[str, Callable[[int], LoRARequest | None]] = {
        "base": lambda k: None, "one adapter": lambda k: adapters[0],
        f"{args.adapters} adapters": lambda k: adapters[k % len(adapters)],
        f"{args.adapters} adapters, per-op path": lambda k: adapters[k % len(adapters)]}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    profiles = {}
    count = 0
    for round_index in range(args.rounds):
        for mode, pick in modes.items():
            manager.layer_stack = None if mode.endswith("per-op path") else stack
            params = SamplingParams(temperature=0, max_tokens=args.steps + 4, ignore_eos=True)
            for k, prompt in enumerate(prompts):
                count += 1
                request = engine.input_processor.process(f"r{count}", {"prompt_token_ids": prompt}, params,
                                                         lora_request=pick(k))
                engine.add_request(request.request_id, request)
            # Prefill (and the adapters' loads) first: only steps of one token per request are timed.
            while engine.scheduler.waiting or engine.waiting_room or any(
                    r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running):
                engine.step()
            engine.step()
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                times[mode].append(time.perf_counter() - start)
            if round_index == 0:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    engine.step()
                profiles[mode] = prof.key_averages()
            while engine.has_unfinished_requests():
                engine.step()
    manager.layer_stack = stack
    base = statistics.median(times["base"])
    print(f"decode steps, N={args.num_prompts}, rank {args.rank}: median (min-max), vs the base")
    for mode, values in times.items():
        median = statistics.median(values)
        print(f"  {mode:32s} {median * 1000:7.1f} ms ({min(values) * 1000:.1f}-{max(values) * 1000:.1f})"
              f"  {base / median:.2f}x")
    for mode, events in profiles.items():
        total = sum(e.self_cpu_time_total for e in events)
        print(f"== {mode}: one step, {total / 1000:.1f} ms of op time")
        for event in sorted(events, key=lambda e: -e.self_cpu_time_total)[:args.top]:
            print(f"  {event.key:36s} {event.self_cpu_time_total / 1000:8.2f} ms  {event.count:4d} calls"
                  f"  {100 * event.self_cpu_time_total / total:5.1f}%")
    engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

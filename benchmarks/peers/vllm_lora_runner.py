"""benchmarks/lora.py's workload on vLLM, inside vLLM's own venv (needs only ``vllm`` and the standard library).

    .peers/vllm/bin/python benchmarks/peers/vllm_lora_runner.py JOB.json RESULT.json

A job: ``{"llm_kwargs": {...}, "prompts": [[ids], ...], "output_len": N, "rounds": R,
"adapters": [[name, int_id, path], ...]}``. Each round generates the prompts on the base model, under the
first adapter for all, and under the adapters round-robin (one ``generate`` each, in that order), as
benchmarks/lora.py does on kvloom; the result holds each run's output tok/s, or the error vLLM raised.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def run(job: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # both cores, as kvloom/bench/runner.py
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(**job["llm_kwargs"])
    adapters = [LoRARequest(name, int_id, path) for name, int_id, path in job["adapters"]]
    inputs = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=job["output_len"], ignore_eos=True)
    workloads = {"base": None, "one adapter": adapters[0],
                 f"{len(adapters)} adapters": [adapters[k % len(adapters)] for k in range(len(inputs))]}
    # Each adapter's first request loads it, outside the timed runs (as benchmarks/lora.py does on kvloom).
    llm.generate(inputs[:len(adapters)], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False,
                 lora_request=adapters[:len(inputs)])
    rates: dict[str, list[float]] = {name: [] for name in workloads}
    for _ in range(job["rounds"]):
        for name, lora in workloads.items():
            t0 = time.perf_counter()
            outputs = llm.generate(inputs, params, use_tqdm=False, lora_request=lora)
            elapsed = time.perf_counter() - t0
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    return {"engine_version": vllm.__version__, "rates": rates}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    try:
        result = run(job)
    except Exception as error:  # noqa: BLE001 - the caller reports what vLLM said
        result = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
    Path(argv[1]).write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""Runs one benchmark job on vLLM, inside vLLM's own venv: needs only ``vllm`` and the standard library.

vLLM's venv has no kvloom (and must not: kvloom's imports would change vLLM's start-up), so this file
knows nothing of kvloom. ``benchmarks/peers/vllm_bench.py`` (main venv) builds the job — the prompts as
token ids, the ``LLM(...)`` keyword arguments, what to time — writes it as JSON, starts this file with
``.peers/vllm/bin/python`` and turns the raw timings it gets back into kvloom's result format.

    .peers/vllm/bin/python benchmarks/peers/vllm_runner.py JOB.json [RESULT.json]   # RESULT: stdout if omitted

A job: ``{"benchmark": "throughput" | "latency", "llm_kwargs": {...}, "prompts": [[ids], ...],
"output_len": N}``; throughput adds ``"first_token_prompt": [ids] | null``; latency adds ``"batch_sizes"``
(batch B runs the first B prompts), ``"num_iters"``, ``"num_warmup"`` and ``"method"`` (``step`` or
``generate``). The measurements are the same as ``kvloom bench throughput`` / ``latency``'s.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any


def process_start_time() -> float:
    """When this process started (Linux /proc), so start-up includes the interpreter and vLLM's imports."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            boot_time = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot_time + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def process_tree_peak_rss_mib(pid: int) -> float | None:
    """Sum of VmHWM over a process and its live descendants: vLLM's engine core is a child process."""
    pids, seen, total_kib = [pid], set(), 0
    try:
        while pids:
            current = pids.pop()
            if current in seen:
                continue
            seen.add(current)
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total_kib += int(line.split()[1])
            for task in Path(f"/proc/{current}/task").iterdir():
                children = task / "children"
                if children.exists():
                    pids.extend(int(c) for c in children.read_text().split())
    except (OSError, ValueError):
        if not total_kib:
            return None
    return total_kib / 1024


def median(values: list[float]) -> float:
    data = sorted(values)
    if not data:
        return float("nan")
    middle = len(data) // 2
    return data[middle] if len(data) % 2 else (data[middle - 1] + data[middle]) / 2


class Vllm:
    """``vllm.LLM`` with the benchmark's sampling: greedy, ``ignore_eos``, token-id prompts."""

    def __init__(self, llm_kwargs: dict[str, Any]) -> None:
        # Both cores for vLLM's OpenMP threads (by default it keeps one for its scheduler) and a 4 GiB KV
        # cache, unless the caller's environment says otherwise.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        import vllm
        from vllm import LLM, SamplingParams

        self.version = vllm.__version__
        self._sampling_params = SamplingParams
        self.llm = LLM(**llm_kwargs)

    def params(self, max_tokens: int) -> Any:
        return self._sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        inputs = [{"prompt_token_ids": ids} for ids in prompts]
        outputs = self.llm.generate(inputs, self.params(max_tokens), use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outputs]

    def shutdown(self) -> None:
        engine = getattr(self.llm, "llm_engine", None)
        for target in (self.llm, engine, getattr(engine, "engine_core", None)):
            stop = getattr(target, "shutdown", None)
            if callable(stop):
                try:
                    stop()
                except Exception:  # noqa: BLE001 - best effort at exit
                    pass
                return


def run_throughput(job: dict[str, Any], start: float) -> dict[str, Any]:
    engine = Vllm(job["llm_kwargs"])
    ready = time.time()
    first_token = None
    if job.get("first_token_prompt"):
        engine.generate([job["first_token_prompt"]], 1)
        first_token = time.time()
    t0 = time.perf_counter()
    generated = engine.generate(job["prompts"], job["output_len"])
    elapsed = time.perf_counter() - t0
    tree_rss = process_tree_peak_rss_mib(os.getpid())  # before shutdown: the engine core is gone after it
    engine.shutdown()
    return {"engine_version": engine.version, "generated": generated, "elapsed_s": elapsed,
            "startup_s": ready - start, "startup_to_first_token_s": (first_token - start) if first_token else None,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_rss_tree_mib": tree_rss}


def measure_step(llm: Any, params: Any, prompts: list[list[int]], max_tokens: int, tag: str) -> dict[str, Any]:
    """kvloom.bench.latency.measure_step on vLLM's ``llm_engine``: TTFT per request and pure decode steps."""
    llm_engine = llm.llm_engine
    request_ids = [f"{tag}-{i}" for i in range(len(prompts))]
    t0 = time.perf_counter()
    for request_id, ids in zip(request_ids, prompts, strict=True):
        llm_engine.add_request(request_id, {"prompt_token_ids": ids}, params)
    first_token: dict[str, float] = {}
    finished: set[str] = set()
    decode_steps: list[float] = []
    while llm_engine.has_unfinished_requests():
        step_start = time.perf_counter()
        all_started = len(first_token) == len(prompts)
        outputs = llm_engine.step()
        step_end = time.perf_counter()
        new_tokens = 0
        for output in outputs:
            if not output.outputs or not output.outputs[0].token_ids:
                continue
            new_tokens += 1
            first_token.setdefault(output.request_id, step_end - t0)
            if output.finished:
                finished.add(output.request_id)
        if all_started and new_tokens == len(prompts) and not finished:
            decode_steps.append(step_end - step_start)
    total = time.perf_counter() - t0
    ttfts = [first_token.get(r, total) for r in request_ids]
    return {"ttft_s": max(ttfts), "ttft_p50_s": median(ttfts),
            "decode_step_s": median(decode_steps) if decode_steps else float("nan"),
            "decode_steps": len(decode_steps), "e2e_s": total}


def measure_generate(engine: Vllm, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """kvloom.bench.latency.measure_generate: TTFT from a 1-token generate, steps from the rest."""
    t0 = time.perf_counter()
    engine.generate(prompts, 1)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate(prompts, max_tokens)
    total = time.perf_counter() - t0
    return {"ttft_s": ttft, "ttft_p50_s": ttft, "decode_step_s": (total - ttft) / (max_tokens - 1),
            "decode_steps": max_tokens - 1, "e2e_s": total}


def run_latency(job: dict[str, Any], start: float) -> dict[str, Any]:
    engine = Vllm(job["llm_kwargs"])
    startup = time.time() - start
    batches = {}
    for batch_size in job["batch_sizes"]:
        prompts = job["prompts"][:batch_size]
        runs = []
        for i in range(job["num_warmup"] + job["num_iters"]):
            if job["method"] == "step":
                measured = measure_step(engine.llm, engine.params(job["output_len"]), prompts,
                                        job["output_len"], tag=f"latency-{batch_size}-{i}")
            else:
                measured = measure_generate(engine, prompts, job["output_len"])
            if i >= job["num_warmup"]:
                runs.append(measured)
        batches[str(batch_size)] = runs
    engine.shutdown()
    return {"engine_version": engine.version, "startup_s": startup, "batches": batches,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or argv[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return 2
    start = process_start_time()
    job = json.loads(Path(argv[0]).read_text())
    runners = {"throughput": run_throughput, "latency": run_latency}
    if job.get("benchmark") not in runners:
        print(f"vllm_runner: job benchmark must be one of {sorted(runners)}, got {job.get('benchmark')!r}",
              file=sys.stderr)
        return 2
    text = json.dumps(runners[job["benchmark"]](job, start))
    if len(argv) == 2:
        Path(argv[1]).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

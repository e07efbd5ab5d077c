"""Benchmarks of kvloom and its peers on the standard workloads (``docs/benchmarks.md``).

- ``workload``: the standard prompts, ``make_workload(n)`` (64 prompts = 9,202 tokens).
- ``throughput``: offline ``LLM.generate`` over the workload; kvloom, vLLM or HF transformers.
- ``latency``: one batch of B requests; time to first token and decode step time.
- ``serve``: a load generator for any OpenAI-compatible ``/v1/completions`` endpoint.
- ``stream_cost``: a streamed completion's output-path cost per token, at its start and at its end.
- ``common``: FLOPs per token, peak memory, process start time, result printing.

Each of ``throughput``, ``latency`` and ``serve`` has ``build_parser()`` and ``main(argv) -> int``
(``kvloom bench NAME`` calls it). The modules import no engine at import time, so the same files run
inside a peer's environment (``benchmarks/*.py``).
"""

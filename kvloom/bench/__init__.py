"""``kvloom bench throughput|latency|serve`` (vLLM's ``vllm bench``) and what they share.

- ``throughput``: offline ``LLM.generate`` over a workload; tok/s, GFLOP/s, start-up, memory.
- ``latency``: one batch of B requests; time to first token and decode step time.
- ``serve``: a load generator for any OpenAI-compatible ``/v1/completions`` endpoint.
- ``workload``: the standard prompts, ``make_workload(n)`` (64 prompts = 9,202 tokens), and the dataset flags.
- ``common``: FLOPs per token, peak memory, process start time, percentiles, result printing.
- ``stream_cost``, ``int8_quality``: the measurements of two studies whose commands are in ``benchmarks/``;
  they stay here because tests pin the output path and int8 quality with them.

Each of ``throughput``, ``latency`` and ``serve`` has ``build_parser()``, ``execute(args)`` and
``main(argv) -> int``. No module imports torch or the engine at import time. The peers (vLLM, llama.cpp,
HF transformers) are run by ``benchmarks/peers/``, which report through ``throughput_result`` and
``latency.batch_result`` so that every engine gives the same fields.
"""

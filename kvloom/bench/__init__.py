"""``kvloom bench throughput|latency|serve|agent|realsize`` (vLLM's ``vllm bench``) and what they share.

- ``throughput``: offline ``generate`` over a workload; tok/s, GFLOP/s, start-up, memory.
- ``latency``: one batch of B requests; time to first token and decode step time.
- ``serve``: a load generator for any OpenAI-compatible ``/v1/completions`` endpoint.
- ``agent``: tool-calling conversations against ``/v1/chat/completions``; TTFT per turn, sessions/min.
- ``realsize``: one 1B-8B GGUF against the memory-bandwidth bound (``membw``'s read probe).
- ``engines``: the engines throughput and latency time: kvloom's ``LLM``, and with ``--peer`` vLLM-CPU,
  HF transformers or llama.cpp's server, measured alike; ``runner``: their timed loops, self-contained
  (vLLM's venv runs that file); ``servers``: start and stop kvloom's and the peers' servers (``--server``
  of serve and agent).
- ``workload``: the standard prompts, ``make_workload(n)`` (64 prompts = 9,202 tokens), and the dataset flags.
- ``common``: FLOPs per token, peak memory, process start time, percentiles, result printing, the
  modules' ``execute`` / ``main`` (``entry_points``).
- ``stream_cost``, ``int8_quality``: the measurements of two studies whose commands are in ``benchmarks/``;
  they stay here because tests pin the output path and int8 quality with them.

Each benchmark module has ``build_parser()``, ``execute(args)`` and ``main(argv) -> int``. No module imports
torch or the engine at import time. ``benchmarks/`` of the repository holds the peer harnesses (``compare.py``
alternates kvloom and a peer in fresh processes) and the micro-benchmarks and studies; they import this package.
"""

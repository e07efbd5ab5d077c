"""Batch latency (time to first token, decode step time); see kvloom/bench/latency.py.

    .venv/bin/python benchmarks/latency.py [--engine kvloom] [--batch-sizes 1,8,64]
    .peers/vllm/bin/python benchmarks/latency.py --engine vllm
"""

import sys

from _bootstrap import bench_module, wants_kvloom_engine

if __name__ == "__main__":
    sys.exit(bench_module("latency", wants_kvloom_engine(sys.argv[1:])).main())

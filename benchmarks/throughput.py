"""Offline throughput on the standard workload; see kvloom/bench/throughput.py and docs/benchmarks.md.

    .venv/bin/python benchmarks/throughput.py [--engine kvloom] [-n 64] [--json out.json]
    .peers/vllm/bin/python benchmarks/throughput.py --engine vllm
    .venv/bin/python benchmarks/throughput.py --engine hf
"""

import sys

from _bootstrap import bench_module, wants_kvloom_engine

if __name__ == "__main__":
    sys.exit(bench_module("throughput", wants_kvloom_engine(sys.argv[1:])).main())

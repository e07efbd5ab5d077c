"""int8 against bf16 on the default model: greedy agreement, perplexity, weight bytes; see
kvloom/bench/int8_quality.py.

    .venv/bin/python benchmarks/int8_quality.py [--quantize-lm-head] [--json out.json]
"""

import sys

from _bootstrap import bench_module

if __name__ == "__main__":
    sys.exit(bench_module("int8_quality", need_engine=True).main())

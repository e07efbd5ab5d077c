"""A streamed completion's per-token host cost at its start and at its end; see kvloom/bench/stream_cost.py.

    .venv/bin/python benchmarks/stream_cost.py                  # a tiny random model built in a temp dir
    .venv/bin/python benchmarks/stream_cost.py --model DIR --kind cumulative
"""

import sys
import tempfile

from _bootstrap import ROOT, bench_module

if __name__ == "__main__":
    argv = sys.argv[1:]
    module = bench_module("stream_cost", need_engine=True)
    if any(arg == "--model" or arg.startswith("--model=") for arg in argv):
        sys.exit(module.main(argv))
    # The output path does not depend on the model: a tiny random one with a long context will do.
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_models

    with tempfile.TemporaryDirectory(prefix="kvloom-stream-cost-") as model_dir:
        tiny_models.build_tiny_checkpoint(model_dir, max_position_embeddings=8192)
        code = module.main(["--model", model_dir, *argv])
    sys.exit(code)

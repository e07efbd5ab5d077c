"""Cold and warm start with compiled artifacts (issue 9): start-to-first-token, and what the warm start compiled.

Each start is a fresh process that builds ``LLM(model)`` on CUDA and generates one token (then 8 requests x 32
tokens, timed apart: the decode graphs a lazy capture left for them), with
``KVLOOM_COMPILED_ARTIFACTS`` pointing at one folder: the first start (cold) finds it empty and compiles
every Triton kernel into it; the later ones (warm) should find a store they can reuse and compile
nothing. "new kernel files" counts what each start added to the store's Triton cache.

    PYTHONPATH=. python benchmarks/gpu_start.py --model /tmp/ckpt --starts 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys, time
start = time.perf_counter()
if sys.argv[3]:  # this start under cProfile: where its seconds go, written as text to argv[3]
    import cProfile
    profile = cProfile.Profile()
    profile.enable()
from kvloom import LLM, SamplingParams
imported = time.perf_counter()
llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.5,
          override_backend_config={"graph_capture": sys.argv[2]})
ready = time.perf_counter()
llm.generate([{"prompt_token_ids": list(range(100, 228))}], SamplingParams(temperature=0, max_tokens=1),
             use_tqdm=False)
done = time.perf_counter()
if sys.argv[3]:
    import io, pstats
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(60)
    stats.sort_stats("tottime").print_stats(30)
    open(sys.argv[3], "w").write(text.getvalue())
# Then 8 requests decoding 32 tokens: what a lazy graph capture (the default) left for the first decodes.
llm.generate([{"prompt_token_ids": list(range(100 + i, 164 + i))} for i in range(8)],
             SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
print(json.dumps({"import_s": imported - start, "start_s": ready - start, "first_token_s": done - start,
                  "then_decode_s": time.perf_counter() - done,
                  "artifacts": llm.llm_engine.executor.driver.artifacts.status}))
"""


def count_files(directory: Path) -> int:
    return sum(1 for path in directory.rglob("*") if path.is_file()) if directory.exists() else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a HF checkpoint folder (e.g. gpu_throughput.py's)")
    parser.add_argument("--starts", type=int, default=3, help="the first is cold, the rest warm")
    parser.add_argument("--graph-capture", choices=["lazy", "start"], default="lazy",
                        help="when the decode graphs are captured (override_backend_config graph_capture)")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--no-bytecode-warmup", action="store_true",
                        help="leave Python's bytecode cache as the environment has it (see PYTHONPYCACHEPREFIX below)")
    parser.add_argument("--profile", metavar="PATH",
                        help="also run one more warm start under cProfile, to first token, and write its top functions "
                             "(by cumulative and own time) to PATH")
    args = parser.parse_args()
    store = Path(tempfile.mkdtemp(prefix="kvloom-artifacts-"))
    env = dict(os.environ, KVLOOM_COMPILED_ARTIFACTS=str(store), KVLOOM_LOGGING_LEVEL="WARNING")
    # Python's bytecode cache: a pip install writes it, but an image whose site-packages cannot take one (or with
    # PYTHONDONTWRITEBYTECODE) compiles every module's source at every start (~3 s of a 5.6 s warm start on a lent
    # H200). The starts measure kvloom's compiled kernels, not that: the bytecode goes to a cache of its own,
    # filled by one import before the cold start.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("PYTHONPYCACHEPREFIX", os.path.join(tempfile.gettempdir(), "kvloom-gpu-start-pycache"))
    if not args.no_bytecode_warmup:
        modules = ("kvloom.llm", "kvloom.engine.llm_engine", "kvloom.worker.model_runner", "kvloom.ops.cuda",
                   "kvloom.models.registry", "safetensors.torch", "triton.compiler")
        subprocess.run([sys.executable, "-c", f"import {', '.join(modules)}"], env=env, check=True)
    rows = []
    for index in range(args.starts + (args.profile is not None)):
        profiled = index == args.starts
        before = count_files(store)
        wall = time.perf_counter()
        result = subprocess.run([sys.executable, "-c", CHILD, args.model, args.graph_capture,
                                 args.profile if profiled else ""], env=env, capture_output=True, text=True)
        if result.returncode:
            print(result.stderr[-3000:], file=sys.stderr)
            return 1
        row = json.loads(result.stdout.strip().splitlines()[-1])
        row.update(kind="cold" if index == 0 else "warm, profiled" if profiled else "warm",
                   process_s=time.perf_counter() - wall, new_kernel_files=count_files(store) - before)
        if not profiled:
            rows.append(row)
        print(f"{row['kind']}: imports {row['import_s']:.1f} s, engine ready {row['start_s']:.1f} s, first token "
              f"{row['first_token_s']:.1f} s "
              f"(process {row['process_s']:.1f} s), then 8 x 32 tokens {row['then_decode_s']:.2f} s, "
              f"store {row['artifacts']}, "
              f"{row['new_kernel_files']} new kernel files", flush=True)
    warm = [r["first_token_s"] for r in rows[1:]]
    if warm:
        print(f"warm / cold start-to-first-token: {min(warm) / rows[0]['first_token_s']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

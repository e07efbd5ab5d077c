"""Offline throughput of llama.cpp's llama-server on the standard workload.

llama.cpp has no offline batch API in Python that batches (llama-cpp-python serves one request at a
time), so the peer figure is llama-server with N parallel slots and continuous batching
(``-np N -cb -t 2``): the server is started, then all N prompts are sent at once as token-id
prompts (non-streaming, max_tokens 128, temperature 0, ignore_eos, cache_prompt false); the wall time
is from the first send to the last response. Start-up is launch -> /health ready; the first token
adds one 1-token request. The result has the same fields as ``kvloom bench throughput``'s.

    .venv/bin/python benchmarks/peers/llamacpp_throughput.py [-n 64] [--gguf bf16|f16|q8_0|q4_1|PATH] [--json out]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

from servers import MODEL_NAME, ROOT, Server, llamacpp_gguf

from kvloom.bench import common, serve, throughput
from kvloom.bench.workload import add_dataset_args, load_prompts, warmup_prompt


def llamacpp_version() -> str:
    server = ROOT / ".peers" / "llamacpp" / "bin" / "llama-server"
    try:
        out = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=30)
        text = (out.stdout + out.stderr).strip().splitlines()
        return next((line for line in text if "version" in line), "")
    except (OSError, subprocess.TimeoutExpired):
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed")
    add_dataset_args(parser)
    parser.add_argument("--gguf", default="bf16",
                        help="bf16 (default), f16, q8_0 (.peers/smollm2-*.gguf), q4_1 or a GGUF path")
    parser.add_argument("--port", type=int, default=8081)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--server-arg", action="append", default=[])
    parser.add_argument("--no-first-token", dest="first_token", action="store_false")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    machine = common.machine_info()
    try:
        prompts = load_prompts(args, args.num_prompts, seed=args.seed)
    except ValueError as e:
        raise SystemExit(f"llamacpp_throughput.py: error: {e}") from None
    gguf = llamacpp_gguf(args.gguf)
    extra = {"cache_prompt": False}
    with Server("llamacpp", port=args.port, num_seqs=args.num_prompts, gguf=str(gguf),
                max_model_len=args.max_model_len, extra=args.server_arg) as server:
        launched = time.time() - server.startup_s
        first_token = None
        if args.first_token:
            asyncio.run(serve.run_load(server.base_url, [warmup_prompt(args, prompts, seed=args.seed)],
                                       model=MODEL_NAME, max_tokens=1, stream=False,
                                       extra_body=extra))
            first_token = time.time() - launched
        t0 = time.perf_counter()
        results, _, _ = asyncio.run(serve.run_load(
            server.base_url, prompts, model=MODEL_NAME, max_tokens=args.output_len, stream=False,
            extra_body=extra))
        elapsed = time.perf_counter() - t0
        rss = server.peak_rss_mib()
        startup = server.startup_s

    failed = [r.error for r in results if not r.ok]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed, e.g. {failed[0]}")
    result = throughput.throughput_result(
        engine="llamacpp", version=llamacpp_version(), engine_kwargs={"argv": server.argv}, model=str(gguf),
        prompt_lens=[len(p) for p in prompts], generated=[r.output_tokens for r in results],
        output_len=args.output_len, elapsed=elapsed, startup_s=startup, startup_to_first_token_s=first_token,
        peak_rss_mib=rss, peak_rss_tree_mib=rss, machine=machine)
    throughput.report(result)
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

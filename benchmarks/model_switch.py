"""The time to switch models on one server: ``kvloom serve a=MODEL b=MODEL --max-loaded-models 1`` (the same file
under two names), then requests alternate between a and b, so each one unloads the other and loads its own.
Prints the time to first token of a switching request against that of a request to the loaded model (before the
switches, and the request right after each), and the server's own load time (``kvloom:model_load_seconds``).

    python benchmarks/model_switch.py                      # SmolLM2-135M (the default model's GGUF)
    python benchmarks/model_switch.py --model /path/to/model.gguf --switches 5 --packed-cache off
    python benchmarks/model_switch.py --kv-cache-memory 256MiB    # other flags go to kvloom serve

``--packed-cache on`` (kvloom's default) maps the model as packed at its first load; ``off`` decodes and packs
the GGUF at every load.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

PROMPT = "Say something about switching models."


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def time_to_first_token(url: str, model: str) -> float:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError(f"no token came from {model}")
    return first


def load_seconds(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return {sample.labels["model_name"]: sample.value for family in text_string_to_metric_families(text)
            if family.name == "kvloom:model_load_seconds" for sample in family.samples}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf file or HF directory (default: SmolLM2-135M's GGUF)")
    parser.add_argument("--switches", type=int, default=5, help="switching requests (alternating a and b)")
    parser.add_argument("--packed-cache", choices=("on", "off"), default="on",
                        help="KVLOOM_PACKED_CACHE for the server (default on, as kvloom's)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    args, server_flags = parser.parse_known_args()
    if args.model is None:
        from kvloom.loader.weights import default_model_gguf_path

        args.model = default_model_gguf_path()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w", prefix="kvloom-switch-", suffix=".log", delete=False)
    env = {**os.environ, "KVLOOM_PACKED_CACHE": "1" if args.packed_cache == "on" else "0"}
    command = [sys.executable, "-m", "kvloom.entrypoints.openai.api_server", "--model", f"a={args.model}",
               f"b={args.model}", "--max-loaded-models", "1", "--max-model-len", str(args.max_model_len),
               "--port", str(port), "--disable-log-requests", "--stats-interval", "0", *server_flags]
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited; its log: {log.name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start; its log: {log.name}")
            time.sleep(0.2)
        time_to_first_token(url, "a")  # warm-up
        loaded = [time_to_first_token(url, "a") for _ in range(3)]
        switches, loads, after = [], [], []
        for i in range(args.switches):
            model = "b" if i % 2 == 0 else "a"
            switches.append(time_to_first_token(url, model))
            loads.append(load_seconds(url)[model])
            after.append(time_to_first_token(url, model))
        print(f"model {args.model} (packed cache {args.packed_cache}, {' '.join(server_flags) or 'default flags'}), "
              f"{args.switches} switches")
        print(f"  TTFT, model loaded:      median {statistics.median(loaded) * 1000:8.1f} ms")
        print(f"  TTFT, switching model:   median {statistics.median(switches) * 1000:8.1f} ms "
              f"(each: {', '.join(f'{s:.2f}' for s in switches)} s)")
        print(f"  TTFT, the next request:  median {statistics.median(after) * 1000:8.1f} ms")
        print(f"  the server's load time:  median {statistics.median(loads) * 1000:8.1f} ms "
              f"(kvloom:model_load_seconds)")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

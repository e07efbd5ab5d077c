"""``kvloom bench throughput|latency|serve`` end to end on the tests' tiny random Llama, briefly.

The tiny model's vocabulary is a few hundred tokens, below the standard workload's ids, so the prompts come
from ``--dataset-path`` (a JSON list of token-id lists), which the commands take like vLLM's.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvloom.entrypoints.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def prompts_file(tmp_path: Path) -> str:
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([[10 + i, 20 + i, 30 + i, 40 + i, 50 + i][: 2 + i % 4] for i in range(4)]))
    return str(path)


def test_bench_throughput_on_a_tiny_model(tiny_llama_dir: str, prompts_file: str, tmp_path: Path,
                                          capsys: Any) -> None:
    out = tmp_path / "throughput.json"
    code = main(["bench", "throughput", "--model", tiny_llama_dir, "--dtype", "float32", "--max-model-len", "128",
                 "--num-prompts", "4", "--dataset-path", prompts_file, "--output-len", "6", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["engine"] == "kvloom" and result["requests"] == 4
    assert result["output_tokens"] == result["expected_output_tokens"] == 24
    assert result["output_tok_s"] > 0 and result["startup_to_first_token_s"] >= result["startup_s"]
    assert "output tok/s" in capsys.readouterr().out


def test_bench_latency_on_a_tiny_model(tiny_llama_dir: str, prompts_file: str, tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    code = main(["bench", "latency", "--model", tiny_llama_dir, "--dtype", "float32", "--max-model-len", "128",
                 "--batch-size", "1,4", "--dataset-path", prompts_file, "--output-len", "4", "--num-iters", "1",
                 "--num-iters-warmup", "0", "--output-json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert [b["batch_size"] for b in result["batches"]] == [1, 4]
    for batch in result["batches"]:
        assert 0 < batch["ttft_s"] <= batch["e2e_s"] and batch["decode_step_s"] > 0
    assert result["engine_kwargs"]["enable_prefix_caching"] is False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bench_serve_against_a_tiny_server(tiny_llama_dir: str, prompts_file: str, tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "KVLOOM_API_KEY": "",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - closed below
    server = subprocess.Popen([sys.executable, "-m", "kvloom.entrypoints.cli", "serve", tiny_llama_dir,
                               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                               "--max-model-len", "128"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while True:
            if server.poll() is not None or time.time() > deadline:
                pytest.fail("server did not start:\n" + (tmp_path / "server.log").read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        out = tmp_path / "serve.json"
        code = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "4",
                     "--dataset-path", prompts_file, "--output-len", "5", "--max-concurrency", "2",
                     "--json", str(out)])
        assert code == 0
        result = json.loads(out.read_text())
        assert result["completed"] == 4 and result["failed"] == 0 and result["output_tokens"] == 20
        assert result["ttft_ms"]["p50"] > 0 and result["concurrency"] == 2
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def test_bench_rejects_bad_flags_with_a_clear_error(capsys: Any) -> None:
    assert main(["bench", "latency", "--batch-sizes", "1,x"]) == 2
    assert "--batch-sizes must be comma-separated integers" in capsys.readouterr().err
    assert main(["bench", "throughput", "--dataset-name", "random"]) == 2
    assert "--input-len" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "nonsense"])

"""``kvloom bench throughput|latency|serve`` end to end on the tests' tiny random Llama, briefly: kvloom,
HF transformers (``--peer hf``) on the same model and prompts, and a server ``--server kvloom`` starts.

The tiny model's vocabulary is a few hundred tokens, below the standard workload's ids, so the prompts come
from ``--dataset-path`` (a JSON list of token-id lists), which the commands take like vLLM's.
"""

from __future__ import annotations

import json
import socket
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


def test_bench_peer_hf_runs_the_same_workload_through_transformers(tiny_llama_dir: str, prompts_file: str,
                                                                   tmp_path: Path) -> None:
    """The same flags, prompts and result fields as kvloom's run; transformers generates every token asked."""
    flags = ["--model", tiny_llama_dir, "--dtype", "float32", "--max-model-len", "128", "--num-prompts", "4",
             "--dataset-path", prompts_file, "--output-len", "6"]
    results = {}
    for name, peer in (("kvloom", []), ("hf", ["--peer", "hf", "--threads", "1"])):
        out = tmp_path / f"{name}.json"
        assert main(["bench", "throughput", *peer, *flags, "--json", str(out)]) == 0
        results[name] = json.loads(out.read_text())
    kvloom, hf = results["kvloom"], results["hf"]
    assert hf["engine"] == "hf" and hf["engine_kwargs"]["torch_threads"] == 1
    assert hf["output_tokens"] == hf["expected_output_tokens"] == 24
    for key in ("requests", "prompt_tokens", "flops_per_token", "expected_output_tokens"):
        assert hf[key] == kvloom[key], key
    assert set(hf) == set(kvloom)
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--peer", "hf", "--model", tiny_llama_dir, "--dtype", "float32",
                 "--batch-size", "1,4", "--dataset-path", prompts_file, "--output-len", "4", "--num-iters", "1",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["engine"] == "hf" and result["method"] == "generate"
    assert [b["batch_size"] for b in result["batches"]] == [1, 4]
    assert all(0 < b["ttft_s"] <= b["e2e_s"] for b in result["batches"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bench_serve_starts_a_tiny_server(tiny_llama_dir: str, prompts_file: str, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.setenv("KVLOOM_API_KEY", "")
    out = tmp_path / "serve.json"
    code = main(["bench", "serve", "--server", "kvloom", "--server-model", tiny_llama_dir,
                 "--server-arg=--dtype=float32", "--server-arg=--max-model-len=128", "--port", str(_free_port()),
                 "--num-seqs", "4", "--num-prompts", "4", "--dataset-path", prompts_file, "--output-len", "5",
                 "--max-concurrency", "2", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 4 and result["failed"] == 0 and result["output_tokens"] == 20
    assert result["ttft_ms"]["p50"] > 0 and result["concurrency"] == 2
    assert result["model"] == "SmolLM2-135M-Instruct"  # the name every started server answers to
    server = result["server"]
    assert server["name"] == "kvloom" and server["startup_s"] > 0 and server["peak_rss_mib"] > 0
    assert tiny_llama_dir in server["argv"] and server["argv"][-2:] == ["--dtype=float32", "--max-model-len=128"]
    assert "server started" in capsys.readouterr().out


def test_bench_help_lists_the_workloads_and_the_peers(capsys: Any) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    listed = capsys.readouterr().out
    assert all(f"    {name}" in listed for name in ("throughput", "latency", "serve", "agent", "realsize"))
    for name, peers in (("throughput", "{vllm,hf,llamacpp}"), ("latency", "{vllm,hf}")):
        with pytest.raises(SystemExit):
            main(["bench", name, "--help"])
        assert f"--peer {peers}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--help"])
    assert "--server {kvloom,vllm,llamacpp}" in capsys.readouterr().out


def test_bench_rejects_bad_flags_with_a_clear_error(capsys: Any) -> None:
    assert main(["bench", "latency", "--batch-sizes", "1,x"]) == 2
    assert "--batch-sizes must be comma-separated integers" in capsys.readouterr().err
    assert main(["bench", "throughput", "--dataset-name", "random"]) == 2
    assert "--input-len" in capsys.readouterr().err
    assert main(["bench", "serve", "--server-model", "x"]) == 2
    assert "go with --server" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "nonsense"])

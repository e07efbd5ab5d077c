"""``kvloom bench realsize`` on a tiny GGUF: the same code path the 1B-8B files take (their files are too large
for CI), the bytes it counts per token against the tensors written, and the bandwidth probe."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import tiny_models

from kvloom.bench import membw, realsize, realsize_shapes
from kvloom.entrypoints import cli

Q4_1, Q6_K, Q8_0, F32 = 3, 14, 8, 0


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A tied tiny Llama laid out as llama.cpp's Q4_K_M (4-bit q/k/o/gate/up, Q6_K v and down; Q4_1 for Q4_K,
    which the gguf package cannot write) with a Q8_0 table; (gguf path, HF checkpoint dir)."""
    root = tmp_path_factory.mktemp("realsize")
    checkpoint = tiny_models.build_tiny_checkpoint(str(root / "hf"), arch="llama", hidden_size=256,
                                                   intermediate_size=256, tie_word_embeddings=True)
    path = tiny_models.write_tiny_gguf(str(root / "tiny-q4_k_m.gguf"), checkpoint,
                                       types={"attn": Q4_1, "attn_o": Q4_1, "ffn": Q4_1, "attn_v": Q6_K,
                                              "ffn_down": Q6_K, "embed": Q8_0, "norm": F32})
    return path, checkpoint


def _expected_bytes(checkpoint: str) -> tuple[int, int]:
    """(bytes of every weight, K and V bytes per position) from the checkpoint's shapes and ggml's block sizes."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads(Path(checkpoint, "config.json").read_text())
    weights = {}
    for name in os.listdir(checkpoint):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(checkpoint, name)))
    kinds = {"v_proj": Q6_K, "down_proj": Q6_K, "embed_tokens": Q8_0}
    total = 0
    for name, w in weights.items():
        ggml_type = F32 if w.ndim == 1 else next((t for k, t in kinds.items() if k in name), Q4_1)
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        total += w.size // block * size
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    kv = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2
    return total, kv


def test_gguf_traffic_counts_the_written_tensors(tiny_q4_k_m: tuple[str, str]) -> None:
    path, checkpoint = tiny_q4_k_m
    total, kv = _expected_bytes(checkpoint)
    traffic = realsize.gguf_traffic(path)
    assert traffic["tied"] and traffic["head_type"] == "Q8_0"
    assert traffic["weight_bytes"] == total
    assert traffic["weight_bytes_per_token"] == total  # tied: the whole table is the head, read every token
    assert traffic["kv_bytes_per_position"] == kv
    bound = realsize.bound_tok_s(traffic, 10.0, 100)
    assert bound == pytest.approx(10e9 / (total + 100 * kv))


def test_bench_realsize_runs_every_test_on_a_tiny_gguf(tiny_q4_k_m: tuple[str, str], tmp_path: Path) -> None:
    path, _ = tiny_q4_k_m
    out = tmp_path / "realsize.json"
    assert cli.main(["bench", "realsize", "--model", path, "--tests", "tg8,pp16,b2", "--num-iters", "2",
                     "--num-warmup", "0", "--bandwidth-gb-s", "10", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {row["test"]: row for row in result["tests"]}
    assert list(rows) == ["tg8", "pp16", "b2"]
    for run in rows["tg8"]["runs"]:  # decode with the prompt's prefill taken out
        assert run["tok_s"] == pytest.approx(7 / (run["e2e_s"] - run["ttft_s"]))
    for run in rows["pp16"]["runs"]:
        assert run["tok_s"] == pytest.approx(16 / run["ttft_s"])
    for run in rows["b2"]["runs"]:  # two sequences of 128 tokens: 127 decode steps each
        assert run["tok_s"] == pytest.approx(2 * 127 / (run["e2e_s"] - run["ttft_s"]))
    traffic = result["traffic"]
    context = realsize.PROMPT_LEN + 4
    expected_bound = 10e9 / (traffic["weight_bytes_per_token"] + traffic["kv_bytes_per_position"] * context)
    assert rows["tg8"]["bound_tok_s"] == pytest.approx(expected_bound)
    assert rows["tg8"]["bound_fraction"] == pytest.approx(rows["tg8"]["tok_s"] / expected_bound)
    assert "bound_tok_s" not in rows["pp16"]
    assert result["engine_kwargs"]["max_model_len"] == 256  # 64 + 128 tokens of b2, rounded up to 256
    assert result["ready_s"] > 0 and result["rss_after_load_mib"] > result["rss_before_load_mib"] * 0.5


@pytest.mark.parametrize("text, message", [("tg1", "tgN"), ("pp", "ppN"), ("x4", "bN"), ("", "no test")])
def test_parse_tests_names_what_is_allowed(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        realsize.parse_tests(text)


def test_resolve_model_names_shapes_and_formats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="llama-3.2-1b"):
        realsize_shapes.resolve_model("llama-9b:q4_k_m")
    with pytest.raises(ValueError, match="q4_k_m"):
        realsize_shapes.resolve_model("llama-3.2-1b:q2_k")
    with pytest.raises(FileNotFoundError, match="make_realsize_gguf.py llama-3.2-1b"):
        realsize_shapes.resolve_model("llama-3.2-1b:q4_k_m")
    with pytest.raises(ValueError, match=r"\.gguf file or SHAPE:FORMAT"):
        realsize_shapes.resolve_model(str(tmp_path / "model.bin"))


def test_parameter_counts_match_the_released_models() -> None:
    """The shapes' sizes against the parameter counts their model cards give (1.24B, 3.21B, 8.03B, 7.62B)."""
    counts = {name: realsize_shapes.parameter_count(config) / 1e9
              for name, config in realsize_shapes.SHAPES.items()}
    assert counts["llama-3.2-1b"] == pytest.approx(1.24, abs=0.01)
    assert counts["llama-3.2-3b"] == pytest.approx(3.21, abs=0.01)
    assert counts["llama-3.1-8b"] == pytest.approx(8.03, abs=0.01)
    assert counts["qwen2.5-7b"] == pytest.approx(7.62, abs=0.01)


def test_membw_reads_a_buffer_on_each_thread_count() -> None:
    for threads in (1, 2):
        result = membw.read_bandwidth(threads, size_mib=64, repeats=3)
        assert len(result["passes_gb_s"]) == 3
        assert 0 < result["median_gb_s"] <= result["best_gb_s"] < 10_000
    with pytest.raises(ValueError, match="size_mib"):
        membw.read_bandwidth(1, size_mib=8)
    with pytest.raises(ValueError, match="threads"):
        membw.read_bandwidth(0)

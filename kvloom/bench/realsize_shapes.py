"""The real-size shapes of ``kvloom bench realsize`` and where their GGUF files are cached.

The shapes are the released configurations (random weights are written by
``benchmarks/peers/make_realsize_gguf.py``); the files live outside the repository, in
``KVLOOM_CACHE_DIR/realsize/<shape>-<format>.gguf`` (default ``~/.cache/kvloom/realsize``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_LLAMA3_ROPE_3_2 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}
_LLAMA3_ROPE_3_1 = {**_LLAMA3_ROPE_3_2, "factor": 8.0}

# HF config.json fields of each shape (architectures, sizes, rope as released).
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, head_dim=64,
                         rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE_3_2, max_position_embeddings=131072,
                         rms_norm_eps=1e-5),
    "llama-3.2-3b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=3072,
                         num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                         intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, head_dim=128,
                         rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE_3_2, max_position_embeddings=131072,
                         rms_norm_eps=1e-5),
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, head_dim=128,
                         rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE_3_1, max_position_embeddings=131072,
                         rms_norm_eps=1e-5),
    "qwen2.5-7b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False,
                       rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
                       use_sliding_window=False),
}

# GGUF formats: llama-quantize's type names; bf16 is the converter's own output.
FORMATS = ("q4_k_m", "q8_0", "bf16")


def parameter_count(config: dict[str, Any]) -> int:
    """Weights of a shape (the embedding counted once when tied)."""
    hidden, layers, inter = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden
    if config["model_type"] == "qwen2":
        per_layer += q + 2 * kv
    embed = config["vocab_size"] * hidden
    return layers * per_layer + hidden + embed * (1 if config["tie_word_embeddings"] else 2)


def cache_root() -> Path:
    from kvloom import envs

    return envs.cache_dir() / "realsize"


def gguf_path(shape: str, fmt: str) -> Path:
    """The cached file of ``shape`` in ``fmt``; ValueError names the shapes and formats there are."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    return cache_root() / f"{shape}-{fmt}.gguf"


def resolve_model(model: str) -> Path:
    """``SHAPE:FORMAT`` (e.g. ``llama-3.2-1b:q4_k_m``) to its cached file, else ``model`` as a path."""
    if ":" in model and not Path(model).exists():
        shape, fmt = model.split(":", 1)
        path = gguf_path(shape, fmt.lower())
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: make it with "
                                    f"`python benchmarks/peers/make_realsize_gguf.py {shape} --formats {fmt}`")
        return path
    path = Path(model)
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"--model must be a .gguf file or SHAPE:FORMAT (shapes {', '.join(SHAPES)}; "
                         f"formats {', '.join(FORMATS)}), got {model!r}")
    return path

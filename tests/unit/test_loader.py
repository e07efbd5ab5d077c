"""Model resolution, configs and weights, checked against what transformers loads from the same files."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import tiny_models
import torch

from kvloom.loader import gguf as gguf_format
from kvloom.loader.weights import (
    DEFAULT_MODEL,
    ModelSource,
    iter_weights,
    load_model_config,
    resolve_model,
)

# ---------------------------------------------------------------------------------------------
# resolve_model


def test_resolve_hf_dir(tiny_llama_dir: str) -> None:
    source = resolve_model(tiny_llama_dir)
    assert source == ModelSource("hf_dir", tiny_llama_dir, os.path.basename(tiny_llama_dir))


def test_resolve_gguf_file(tiny_gguf_path: str) -> None:
    assert resolve_model(tiny_gguf_path) == ModelSource("gguf", tiny_gguf_path, "tiny-llama")


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2"])
def test_resolve_default_model_names(name: str, smollm2_gguf_path: str) -> None:
    source = resolve_model(name)
    assert source == ModelSource("gguf", smollm2_gguf_path, DEFAULT_MODEL)
    assert source.path.endswith(".gguf") and os.path.isfile(source.path)


def test_resolve_rejects_unknown_names_and_paths(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'no-such-model'.*config.json.*gguf.*SmolLM2-135M-Instruct"):
        resolve_model("no-such-model")
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"x")
    with pytest.raises(ValueError, match="neither a directory"):
        resolve_model(str(not_gguf))


def test_resolve_dir_without_config_names_the_gguf_inside(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json$"):
        resolve_model(str(tmp_path))
    (tmp_path / "model.Q4_0.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="pass the file itself.*model.Q4_0.gguf"):
        resolve_model(str(tmp_path))


def test_not_a_gguf_file_is_a_clear_error(tmp_path: Path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        load_model_config(resolve_model(str(fake)))


# ---------------------------------------------------------------------------------------------
# configs


def _assert_config_matches_transformers(config: object, hf: object) -> None:
    """Every ModelConfig field against the transformers config attribute it comes from."""
    assert config.architecture == hf.architectures[0]
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                  "tie_word_embeddings", "bos_token_id", "rms_norm_eps"):
        assert getattr(config, field) == getattr(hf, field), field
    assert config.eos_token_ids == [hf.eos_token_id]
    rope = dict(hf.rope_parameters)
    assert config.rope_theta == rope.pop("rope_theta")
    if rope.get("rope_type", "default") == "default":
        assert config.rope_scaling is None
    else:
        assert {k: v for k, v in config.rope_scaling.items() if k != "rope_theta"} == rope
    assert config.sliding_window == getattr(hf, "sliding_window", None)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama3_dir", "tiny_mistral_dir"])
def test_hf_dir_config_matches_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoConfig

    path = request.getfixturevalue(fixture)
    config = load_model_config(resolve_model(path))
    _assert_config_matches_transformers(config, AutoConfig.from_pretrained(path))
    assert config.torch_dtype == "float32"


def test_tiny_gguf_config_matches_transformers(tiny_gguf_path: str) -> None:
    from transformers import AutoConfig

    folder, filename = os.path.split(tiny_gguf_path)
    hf = AutoConfig.from_pretrained(folder, gguf_file=filename)
    hf.architectures = ["LlamaForCausalLM"]  # transformers' GGUF configs name no architecture
    config = load_model_config(resolve_model(tiny_gguf_path))
    _assert_config_matches_transformers(config, hf)
    assert config.tie_word_embeddings is False
    assert config.torch_dtype is None  # quantized


def test_gguf_llama3_rope_scaling_comes_back_from_rope_freqs(tmp_path: Path) -> None:
    # Llama 3.1's real parameters; llama.cpp stores only the per-frequency divisors they imply.
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    hf_dir = tiny_models.build_tiny_checkpoint(str(tmp_path / "hf"), arch="llama3", rope_scaling=scaling,
                                                  max_position_embeddings=16384)
    path = tiny_models.write_tiny_gguf(str(tmp_path / "llama3.gguf"), hf_dir)
    config = load_model_config(resolve_model(path))
    assert config.rope_scaling == scaling
    assert config.rope_theta == 500000.0
    assert "rope_freqs.weight" not in dict(iter_weights(resolve_model(path)))


def test_gguf_nonstandard_llama3_rope_freqs_are_refused(tiny_llama3_dir: str, tmp_path: Path) -> None:
    # tiny_llama3 uses original_max_position_embeddings=64, which no released model does.
    path = tiny_models.write_tiny_gguf(str(tmp_path / "odd.gguf"), tiny_llama3_dir)
    with pytest.raises(ValueError, match="rope_freqs"):
        load_model_config(resolve_model(path))


# ---------------------------------------------------------------------------------------------
# safetensors weights


def _transformers_state_dict(path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype="auto").state_dict()


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama_sharded_dir", "tiny_llama3_dir",
                                     "tiny_mistral_dir"])
def test_safetensors_weights_equal_transformers_state_dict(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(fixture)
    source = resolve_model(path)
    weights = dict(iter_weights(source))
    reference = _transformers_state_dict(path)
    tied = load_model_config(source).tie_word_embeddings
    assert set(weights) == set(reference) - ({"lm_head.weight"} if tied else set())
    for name, tensor in weights.items():
        assert tensor.dtype == reference[name].dtype == torch.float32, name
        assert torch.equal(tensor, reference[name]), name


def test_sharded_checkpoint_equals_single_file(tiny_llama_dir: str, tiny_llama_sharded_dir: str) -> None:
    shards = [name for name in os.listdir(tiny_llama_sharded_dir) if name.endswith(".safetensors")]
    assert len(shards) > 1
    assert os.path.isfile(os.path.join(tiny_llama_sharded_dir, "model.safetensors.index.json"))
    single = dict(iter_weights(resolve_model(tiny_llama_dir)))
    sharded = dict(iter_weights(resolve_model(tiny_llama_sharded_dir)))
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[name], sharded[name]) for name in single)


def test_missing_shard_is_a_clear_error(tiny_llama_sharded_dir: str, tmp_path: Path) -> None:
    broken = shutil.copytree(tiny_llama_sharded_dir, tmp_path / "broken")
    first_shard = sorted(name for name in os.listdir(broken) if name.endswith(".safetensors"))[0]
    os.remove(broken / first_shard)
    with pytest.raises(ValueError, match=f"missing.*{first_shard}"):
        list(iter_weights(resolve_model(str(broken))))


# ---------------------------------------------------------------------------------------------
# GGUF weights


@pytest.mark.parametrize("ggml_type", [2, 3, 6, 7, 8])  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
def test_torch_dequantization_equals_gguf_reference(ggml_type: int) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType(ggml_type)
    values = np.random.default_rng(ggml_type).standard_normal((8, 256)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    got = gguf_format.dequantize(torch.from_numpy(raw.reshape(-1).copy()), ggml_type, (8, 256))
    assert torch.equal(got, expected)


def test_gguf_block_layouts_match_the_gguf_package() -> None:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from kvloom.loader.gguf import _KNOWN_LAYOUTS

    for ggml_type, layout in _KNOWN_LAYOUTS.items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)] == layout, ggml_type


def test_tiny_gguf_weights_equal_transformers(tiny_gguf_path: str) -> None:
    from transformers import AutoModelForCausalLM

    folder, filename = os.path.split(tiny_gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    reference = model.state_dict()
    weights = dict(iter_weights(resolve_model(tiny_gguf_path)))
    assert set(weights) == set(reference)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32 and tensor.shape == reference[name].shape, name
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)


def test_tiny_gguf_weights_are_the_checkpoint_in_hf_layout(tiny_gguf_path: str) -> None:
    """Independent of transformers: dequantized weights sit within quantization error of the originals,
    which holds only if llama.cpp's q/k row permutation was undone."""
    original = dict(iter_weights(resolve_model(os.path.join(os.path.dirname(tiny_gguf_path), "hf"))))
    weights = dict(iter_weights(resolve_model(tiny_gguf_path)))
    assert weights.keys() == original.keys()
    for name, tensor in weights.items():
        # 4-bit blocks leave ~10% error; rows in llama.cpp's order would leave ~140%.
        error = torch.linalg.norm(tensor - original[name]) / torch.linalg.norm(original[name])
        assert error < 0.2, (name, float(error))


def test_gguf_weights_dequantized_despite_kept_blocks_are_named_in_one_line(
        tiny_gguf_path: str, caplog: pytest.LogCaptureFixture) -> None:
    """4-bit blocks kept but not int8 ones (a backend with int8_gguf_blocks off): the tiny file's Q8_0 embedding, Q5_0
    attention and Q5_1 head are dequantized, and one log line says so (types and counts) with the types that are
    kept and how to keep Q5_1; with nothing asked to be kept, no line."""
    import logging
    import re

    with caplog.at_level(logging.INFO, logger="kvloom"):
        weights = dict(iter_weights(resolve_model(tiny_gguf_path), keep_q4=True))
    assert weights["model.embed_tokens.weight"].dtype == torch.float32
    lines = [r.getMessage() for r in caplog.records if "dequantized to float at load" in r.getMessage()]
    assert len(lines) == 1
    assert re.fullmatch(re.escape(os.path.basename(tiny_gguf_path)) + r": \d+ weights dequantized to float at load "
                        r"\(\d+ Q5_0, 1 Q5_1, 1 Q8_0\); the types kept in their blocks are Q4_0, Q4_1, Q4_K; "
                        r"Q5_1 / Q5_K stay in blocks with override_backend_config \{\"gguf_5bit_blocks\": true\}",
                        lines[0]), lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvloom"):
        dict(iter_weights(resolve_model(tiny_gguf_path)))
    assert not [r for r in caplog.records if "dequantized to float at load" in r.getMessage()]


SmolLM2Reference = tuple[object, dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def smollm2_transformers_reference(smollm2_gguf_path: str) -> SmolLM2Reference:
    """(config, {name: tensor}) for a few SmolLM2 tensors, from transformers' own GGUF loading code.

    AutoModelForCausalLM.from_pretrained(gguf_file=...) takes ~30 s here; this runs the same pieces
    (load_gguf_checkpoint for the config; gguf's dequantize and transformers' LlamaTensorProcessor and
    name map for the tensors) on one layer's worth of tensors of every kind.
    """
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        LlamaTensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    reader = gguf.GGUFReader(smollm2_gguf_path)
    with pytest.MonkeyPatch.context() as patch:  # one ~3 s parse of the file instead of two
        patch.setattr(gguf, "GGUFReader", lambda path: reader)
        config_dict = load_gguf_checkpoint(smollm2_gguf_path, return_tensors=False)["config"]
    config = LlamaConfig.from_dict(config_dict)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    processor = LlamaTensorProcessor(config=config_dict)
    names = get_gguf_hf_weights_map(model, processor)
    wanted = ("token_embd.", "output_norm.", "blk.0.", "blk.29.")
    tensors = {}
    for tensor in reader.tensors:
        if tensor.name.startswith(wanted):
            weights = processor.process(gguf.dequantize(tensor.data, tensor.tensor_type), tensor.name).weights
            tensors[names[tensor.name]] = torch.from_numpy(np.copy(weights))
    return config, tensors


@pytest.mark.slow
def test_smollm2_gguf_weights_equal_transformers(
        smollm2_gguf_path: str, smollm2_transformers_reference: SmolLM2Reference) -> None:
    _, reference = smollm2_transformers_reference
    assert len(reference) == 2 + 2 * 9
    weights = dict(iter_weights(resolve_model(smollm2_gguf_path)))
    assert len(weights) == 2 + 30 * 9  # tied: no lm_head.weight
    for name, expected in reference.items():
        torch.testing.assert_close(weights[name], expected, rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_smollm2_gguf_config_equals_transformers(
        smollm2_gguf_path: str, smollm2_transformers_reference: SmolLM2Reference) -> None:
    hf, _ = smollm2_transformers_reference
    hf.architectures = ["LlamaForCausalLM"]
    config = load_model_config(resolve_model(smollm2_gguf_path))
    _assert_config_matches_transformers(config, hf)
    assert (config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers) == (9, 3, 30)
    assert config.tie_word_embeddings and config.torch_dtype is None


# ---------------------------------------------------------------------------------------------
# broken files: a ValueError naming the file and what is wrong, never the library's own error


def _broken_copy(model_dir: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model_dir, tmp_path / "broken"))


@pytest.mark.parametrize("corrupt, match", [
    (lambda data: data[:len(data) // 2], "file not fully covered"),
    (lambda data: data[:4], "header too small"),
    (lambda data: b"", "header too small"),
    (lambda data: data[:8] + b"not json" + data[16:], "invalid JSON in header"),
    (lambda data: bytes(100), "invalid JSON in header"),
])
def test_corrupt_safetensors_is_a_value_error_naming_the_file(tiny_llama_dir: str, tmp_path: Path,
                                                                corrupt, match: str) -> None:
    broken = _broken_copy(tiny_llama_dir, tmp_path)
    path = broken / "model.safetensors"
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(ValueError, match=f"{path} is not a valid safetensors file.*{match}.*truncated or corrupt"):
        list(iter_weights(resolve_model(str(broken))))


@pytest.mark.parametrize("text, match", [
    ("{not json", "is not valid JSON"),
    ('{"metadata": {}}', 'must hold a "weight_map" object'),
    ("[1, 2]", 'must hold a "weight_map" object'),
])
def test_broken_shard_index_is_a_clear_error(tiny_llama_sharded_dir: str, tmp_path: Path, text: str,
                                             match: str) -> None:
    broken = _broken_copy(tiny_llama_sharded_dir, tmp_path)
    (broken / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError, match=f"model.safetensors.index.json {match}"):
        list(iter_weights(resolve_model(str(broken))))


@pytest.mark.parametrize("edit, match", [
    (lambda config: "{not json", "config.json is not valid JSON"),
    (lambda config: "[1, 2]", "config.json must hold a JSON object, got a list"),
    (lambda config: {k: v for k, v in config.items() if k != "hidden_size"},
     r"config.json lacks the required key\(s\) \['hidden_size'\]"),
    (lambda config: dict(config, num_hidden_layers="two"), "config.json: num_hidden_layers must be a positive integer"),
    (lambda config: dict(config, rms_norm_eps="small"), "config.json has a value of the wrong type"),
    (lambda config: dict(config, architectures=["GPT2LMHeadModel"]), "config.json: model architecture"),
])
def test_broken_config_json_is_a_clear_error(tiny_llama_dir: str, tmp_path: Path, edit, match: str) -> None:
    import json

    broken = _broken_copy(tiny_llama_dir, tmp_path)
    config = edit(json.loads((broken / "config.json").read_text()))
    (broken / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(ValueError, match=match):
        load_model_config(resolve_model(str(broken)))


@pytest.mark.parametrize("text", ["{not json", '{"model": {"type": "BPE"}}', ""])
def test_corrupt_tokenizer_json_is_a_clear_error(tiny_llama_dir: str, tmp_path: Path, text: str) -> None:
    from kvloom.loader.tokenizer import load_tokenizer

    broken = _broken_copy(tiny_llama_dir, tmp_path)
    (broken / "tokenizer.json").write_text(text)
    with pytest.raises(ValueError, match=f"{broken / 'tokenizer.json'} is not a valid tokenizers-library tokenizer"):
        load_tokenizer(resolve_model(str(broken)))


def _load_everything(path: str) -> None:
    from kvloom.loader.tokenizer import load_tokenizer

    source = resolve_model(path)
    load_model_config(source)
    load_tokenizer(source)
    for _ in iter_weights(source):
        pass


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.3, 0.99])
def test_truncated_gguf_is_a_value_error_naming_the_file(tiny_gguf_path: str, tmp_path: Path,
                                                         fraction: float) -> None:
    data = Path(tiny_gguf_path).read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[:int(len(data) * fraction)])
    with pytest.raises(ValueError, match=str(path)):
        _load_everything(str(path))


def test_corrupt_gguf_bytes_are_value_errors_naming_the_file(tiny_gguf_path: str, tmp_path: Path) -> None:
    """Random bytes of the header, metadata and tensor directory overwritten: the file loads (a byte of a
    value that does not matter) or fails with a ValueError naming it, never another exception."""
    import random

    data = Path(tiny_gguf_path).read_bytes()
    rng = random.Random(0)
    failures = 0
    for case in range(60):
        corrupt = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            corrupt[rng.randint(4, 6000)] = rng.randrange(256)
        path = tmp_path / f"corrupt{case}.gguf"
        path.write_bytes(corrupt)
        try:
            _load_everything(str(path))
        except ValueError as e:
            assert str(path) in str(e)
            failures += 1
    assert failures > 30

"""int8 weight storage end to end: quantized at load, the quantized checkpoint, tensor parallelism, Q8_0.

The oracle is transformers run on a "fake-quantized" copy of the checkpoint (every projection weight
replaced by dequantize(quantize(W))): in fp32 with the reference ops (weight-only int8 products),
kvloom's int8 model computes the same function, so greedy tokens must be identical.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from kvloom import LLM, SamplingParams
from kvloom.layers.linear import Linear
from kvloom.ops import int8
from tests.e2e.test_correctness import hf_greedy, kvloom_greedy, mixed_prompts

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fake_quantized_copy(model_dir: str, target: str, lm_head: bool = False) -> str:
    """The checkpoint with each projection weight (and with lm_head the embedding) rounded through int8."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, target)
    path = os.path.join(target, "model.safetensors")
    tensors = load_file(path)
    for name, tensor in tensors.items():
        heads = ("embed_tokens.weight", "lm_head.weight") if lm_head else ()
        if any(f"{p}.weight" in name for p in PROJECTIONS) or name.endswith(heads):
            tensors[name] = int8.dequantize(*int8.quantize_per_channel(tensor), dtype=tensor.dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    return target


def int8_llm(model_dir: str, **kwargs) -> LLM:
    kwargs.setdefault("override_backend_config", {"attention_backend": "reference"})
    return LLM(model=model_dir, dtype="float32", max_model_len=256, quantization="int8", **kwargs)


@pytest.mark.parametrize("lm_head", [False, True])
def test_int8_greedy_equals_transformers_on_the_fake_quantized_weights(tiny_llama_dir, tmp_path, lm_head) -> None:
    prompts = mixed_prompts(400, count=8)
    expected = hf_greedy(fake_quantized_copy(tiny_llama_dir, str(tmp_path / "fq"), lm_head), prompts, 16)
    backend = {"attention_backend": "reference", "quantize_lm_head": lm_head}
    llm = int8_llm(tiny_llama_dir, override_backend_config=backend)
    assert kvloom_greedy(llm, prompts, 16) == expected
    model = llm.llm_engine.executor.driver.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and m.weight.numel() == 0 for m in linears)
    assert (model.embed_tokens.qweight is not None) == lm_head


def test_int8_differs_from_float_and_is_close(tiny_llama_dir) -> None:
    """The int8 model is not secretly the float one: its logprobs move, but only a little."""
    prompt = [{"prompt_token_ids": mixed_prompts(400, count=1)[0]}]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def prompt_logprobs(llm: LLM) -> torch.Tensor:
        rows = llm.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs[1:]
        return torch.tensor([next(iter(row.values())).logprob for row in rows])

    reference = {"attention_backend": "reference"}
    plain = prompt_logprobs(LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256,
                                override_backend_config=reference))
    quantized = prompt_logprobs(int8_llm(tiny_llama_dir))
    difference = (plain - quantized).abs()
    assert 0 < difference.mean() < 0.05 and difference.max() < 0.25


def test_fast_path_int8_greedy_matches_the_reference_int8_path(tiny_llama_dir) -> None:
    """The platform's int8 product (auto backend, bf16) against the reference ops on the same int8 model:
    the same tokens on most prompts (bf16 and activation rounding may flip a near tie)."""
    prompts = mixed_prompts(400, count=8)
    fast = kvloom_greedy(LLM(model=tiny_llama_dir, dtype="bfloat16", max_model_len=256, quantization="int8"),
                         prompts, 8)
    slow = kvloom_greedy(LLM(model=tiny_llama_dir, dtype="bfloat16", max_model_len=256, quantization="int8",
                             override_backend_config={"attention_backend": "reference"}), prompts, 8)
    same_first = sum(a[:4] == b[:4] for a, b in zip(fast, slow))
    assert same_first >= 6, (fast, slow)


def test_quantized_checkpoint_is_written_once_then_loaded_without_quantizing(tiny_llama_dir, tmp_path, caplog,
                                                                             monkeypatch) -> None:
    path = str(tmp_path / "q" / "model-int8.safetensors")
    prompts = mixed_prompts(400, count=4)
    with caplog.at_level(logging.INFO, logger="kvloom"):
        first = kvloom_greedy(int8_llm(tiny_llama_dir, quantized_checkpoint_path=path), prompts, 8)
    assert "does not exist yet" in caplog.text and os.path.exists(path)
    caplog.clear()

    def no_quantizing(*args, **kwargs):
        raise AssertionError("quantized again although the checkpoint matches")

    monkeypatch.setattr(int8, "quantize_per_channel", no_quantizing)
    with caplog.at_level(logging.INFO, logger="kvloom"):
        second = kvloom_greedy(int8_llm(tiny_llama_dir, quantized_checkpoint_path=path), prompts, 8)
    assert "Loaded the quantized checkpoint" in caplog.text
    assert second == first


def test_quantized_checkpoint_of_other_settings_or_corrupt_is_replaced(tiny_llama_dir, tmp_path, caplog) -> None:
    path = str(tmp_path / "model-int8.safetensors")
    int8_llm(tiny_llama_dir, quantized_checkpoint_path=path)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvloom"):
        int8_llm(tiny_llama_dir, quantized_checkpoint_path=path,
                 override_backend_config={"attention_backend": "reference", "quantize_lm_head": True})
    assert "another model or settings" in caplog.text
    with open(path, "r+b") as f:
        f.write(b"garbage!")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvloom"):
        llm = int8_llm(tiny_llama_dir, quantized_checkpoint_path=path)
    assert "unreadable" in caplog.text
    assert len(kvloom_greedy(llm, mixed_prompts(400, count=1), 4)[0]) == 4
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvloom"):
        int8_llm(tiny_llama_dir, quantized_checkpoint_path=path)
    assert "Loaded the quantized checkpoint" in caplog.text  # the replacement is good


def test_tensor_parallel_int8_equals_one_rank(tiny_llama_dir) -> None:
    prompts = mixed_prompts(400, count=4)
    one = kvloom_greedy(int8_llm(tiny_llama_dir), prompts, 8)
    two = int8_llm(tiny_llama_dir, tensor_parallel_size=2)
    try:
        assert kvloom_greedy(two, prompts, 8) == one
    finally:
        two.llm_engine.shutdown()


@pytest.mark.parametrize("kwargs, message", [
    ({"quantization": "fp4"}, "quantization must be one of"),
    ({"quantized_checkpoint_path": "x.safetensors"}, "needs quantization"),
    ({"override_backend_config": {"quantized": True, "quantization_dtype": "f8"}}, "quantization_dtype"),
])
def test_bad_quantization_settings_are_named(tiny_llama_dir, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny_llama_dir, **kwargs)


def test_seeds_spelling_turns_int8_on(tiny_llama_dir, monkeypatch) -> None:
    monkeypatch.setenv("KVLOOM_QUANT_DTYPE", "s8")
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256)
    assert llm.llm_engine.config.quantization == "int8"
    model = llm.llm_engine.executor.driver.model
    assert all(m.packed is not None for m in model.modules() if isinstance(m, Linear))

"""int8 weight storage end to end: quantized at load, the quantized checkpoint, tensor parallelism, Q8_0.

The oracle is transformers run on a "fake-quantized" copy of the checkpoint (every projection weight
replaced by dequantize(quantize(W))): in fp32 with the reference ops (weight-only int8 products),
kvloom's int8 model computes the same function, so greedy tokens must be identical.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil

import pytest
import torch

from kvloom import LLM, SamplingParams
from kvloom.layers import smoothing
from kvloom.layers.linear import Linear
from kvloom.ops import int8

from .test_correctness import hf_greedy, kvloom_greedy, mixed_prompts

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


def float_model(model_dir: str) -> torch.nn.Module:
    """kvloom's own Llama in fp32 on the reference ops, loaded and not packed (what calibration runs)."""
    from kvloom.loader.weights import iter_weights, load_model_config, resolve_model
    from kvloom.models.registry import build_model
    from kvloom.ops.table import REFERENCE_OPS

    source = resolve_model(model_dir)
    model = build_model(load_model_config(source), REFERENCE_OPS)
    model.load_weights(iter_weights(source))
    return model.eval()


def calibrated_factors(model_dir: str, alpha: float) -> list[smoothing.LayerSmoothing]:
    from kvloom.loader.tokenizer import load_tokenizer
    from kvloom.loader.weights import resolve_model

    token_ids = load_tokenizer(resolve_model(model_dir)).encode(smoothing.calibration_text())
    return smoothing.calibrate(float_model(model_dir), token_ids, alpha)


def smoothed_copy(model_dir: str, target: str, layers: list[smoothing.LayerSmoothing], num_heads: int,
                  fake_quantize: bool) -> str:
    """The checkpoint with the factors folded in, written here independently of smooth_as_read (HF
    names, row / column scalings spelled out), each projection rounded through int8 if ``fake_quantize``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, target)
    path = os.path.join(target, "model.safetensors")
    tensors = {name: t.float() for name, t in load_file(path).items()}
    for i, f in enumerate(layers):
        prefix = f"model.layers.{i}."
        head_dim = tensors[prefix + "self_attn.o_proj.weight"].shape[1] // num_heads
        kv_heads = f.o.numel() // head_dim
        # q head h reads kv head h // group: o's column factors repeat each kv head's block group times.
        o_full = f.o.view(kv_heads, head_dim).repeat_interleave(num_heads // kv_heads, dim=0).reshape(-1)
        tensors[prefix + "input_layernorm.weight"] /= f.qkv
        tensors[prefix + "post_attention_layernorm.weight"] /= f.gate_up
        for name in ("q_proj", "k_proj", "v_proj"):
            tensors[prefix + f"self_attn.{name}.weight"] *= f.qkv[None, :]
        tensors[prefix + "self_attn.v_proj.weight"] /= f.o[:, None]
        tensors[prefix + "self_attn.o_proj.weight"] *= o_full[None, :]
        tensors[prefix + "mlp.gate_proj.weight"] *= f.gate_up[None, :]
        tensors[prefix + "mlp.up_proj.weight"] *= f.gate_up[None, :]
        tensors[prefix + "mlp.up_proj.weight"] /= f.down[:, None]
        tensors[prefix + "mlp.down_proj.weight"] *= f.down[None, :]
    if fake_quantize:
        for name, tensor in tensors.items():
            if any(f"{p}.weight" in name for p in PROJECTIONS):
                tensors[name] = int8.dequantize(*int8.quantize_per_channel(tensor))
    save_file(tensors, path, metadata={"format": "pt"})
    return target


def int8_llm(model_dir: str, **kwargs) -> LLM:
    kwargs.setdefault("override_backend_config", {"attention_backend": "reference"})
    return LLM(model=model_dir, dtype="float32", max_model_len=256, quantization="int8", **kwargs)


@pytest.mark.parametrize("lm_head", [False, True])
def test_int8_greedy_equals_transformers_on_the_fake_quantized_weights(tiny_llama_dir, tmp_path, lm_head) -> None:
    prompts = mixed_prompts(400, count=8)
    expected = hf_greedy(fake_quantized_copy(tiny_llama_dir, str(tmp_path / "fq"), lm_head), prompts, 16)
    backend = {"attention_backend": "reference", "quantize_lm_head": lm_head, "int8_activations": False}
    llm = int8_llm(tiny_llama_dir, override_backend_config=backend)
    assert kvloom_greedy(llm, prompts, 16) == expected
    model = llm.llm_engine.executor.driver.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and m.weight.numel() == 0 for m in linears)
    assert (model.embed_tokens.qweight is not None) == lm_head


def test_an_int8_head_tied_to_the_embedding_holds_the_table_once(tiny_llama_dir) -> None:
    """quantize_lm_head on a tied model: the C++ product's packing is the one copy of the int8 table; the embedding
    looks its rows up there, and the tokens equal the torch reference's, whose embedding keeps its own table."""
    from kvloom.ops import cpu

    if not cpu.int8_kernels_available():
        pytest.skip("the C++ int8 kernels are not built here")
    backend = {"quantize_lm_head": True, "int8_activations": False}
    llm = int8_llm(tiny_llama_dir, override_backend_config=backend)
    model = llm.llm_engine.executor.driver.model
    assert isinstance(model.lm_head.packed, cpu.PackedInt8Weight) and model.lm_head.qweight is None
    assert model.embed_tokens.qweight is None and model.embed_tokens.table is not None
    reference = int8_llm(tiny_llama_dir, override_backend_config={**backend, "attention_backend": "reference"})
    table = reference.llm_engine.executor.driver.model.embed_tokens
    ids = torch.tensor([0, 7, model.config.vocab_size - 1, 7])
    assert torch.equal(model.embed_tokens(ids), table(ids))
    prompts = mixed_prompts(400, count=4)
    assert kvloom_greedy(llm, prompts, 8) == kvloom_greedy(reference, prompts, 8)


def test_smoothing_keeps_the_float_model_exact(tiny_llama_dir, tmp_path) -> None:
    """Folding the factors into the norms and the v / up rows is exact algebra: the smoothed float
    checkpoint (smooth_as_read's tensors) gives transformers the same logits as the original, while
    every kind of factor is far from 1 (so a misplaced one would show)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from kvloom.loader.weights import iter_weights, resolve_model

    layers = calibrated_factors(tiny_llama_dir, 0.5)
    for f in layers:
        for factor in (f.qkv, f.gate_up, f.o, f.down):
            assert factor.log().abs().max() > 0.3 and torch.isfinite(factor).all() and (factor > 0).all()
    num_heads = float_model(tiny_llama_dir).config.num_attention_heads
    smoothed = dict(smoothing.smooth_as_read(iter_weights(resolve_model(tiny_llama_dir)), layers, num_heads))
    target = str(tmp_path / "smoothed")
    shutil.copytree(tiny_llama_dir, target)
    save_file({name: t.contiguous() for name, t in smoothed.items()}, os.path.join(target, "model.safetensors"),
              metadata={"format": "pt"})
    # The independent spelling of the same folding gives the same tensors.
    independent = smoothed_copy(tiny_llama_dir, str(tmp_path / "independent"), layers, num_heads, False)
    for name, tensor in load_file(os.path.join(independent, "model.safetensors")).items():
        torch.testing.assert_close(smoothed[name], tensor, rtol=1e-6, atol=0)
    ids = torch.tensor([mixed_prompts(400, count=1, seed=3)[0]])
    logits = []
    for path in (tiny_llama_dir, target):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(ids).logits)
    changed = max((smoothed[n] - t).abs().max().item() for n, t in iter_weights(resolve_model(tiny_llama_dir)))
    assert changed > 1e-2  # the weights did move
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_smoothed_w8a8_greedy_equals_transformers_on_smoothed_fake_quantized_weights(tiny_llama_dir, tmp_path
                                                                                      ) -> None:
    """int8 with smoothing (reference ops: weight-only products, so the function is exact) is transformers
    on the smoothed, then fake-quantized checkpoint; its int8 weights are not the unsmoothed ones."""
    prompts = mixed_prompts(400, count=8)
    layers = calibrated_factors(tiny_llama_dir, 0.5)
    num_heads = float_model(tiny_llama_dir).config.num_attention_heads
    expected = hf_greedy(smoothed_copy(tiny_llama_dir, str(tmp_path / "sfq"), layers, num_heads, True), prompts, 16)
    backend = {"attention_backend": "reference", "int8_activations": True, "int8_smoothing_alpha": 0.5}
    llm = int8_llm(tiny_llama_dir, override_backend_config=backend)
    assert kvloom_greedy(llm, prompts, 16) == expected
    # Greedy tokens of a tiny random model barely move; its stored weights must.
    down = llm.llm_engine.executor.driver.model.layers[0].mlp.down_proj.packed
    plain, _ = int8.quantize_per_channel(float_model(tiny_llama_dir).layers[0].mlp.down_proj.weight)
    assert (down.qweight != plain).float().mean() > 0.5


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


def test_quantized_checkpoint_keeps_the_smoothing_and_its_alpha(tiny_llama_dir, tmp_path, caplog,
                                                                 monkeypatch) -> None:
    """The smoothed weights are stored: a reload does not calibrate; another alpha makes a new file."""
    from kvloom.models import registry

    path = str(tmp_path / "model-int8-smooth.safetensors")
    prompts = mixed_prompts(400, count=4)

    def smoothed(alpha: float) -> LLM:
        return int8_llm(tiny_llama_dir, quantized_checkpoint_path=path, override_backend_config={
            "attention_backend": "reference", "int8_activations": True, "int8_smoothing_alpha": alpha})

    first = kvloom_greedy(smoothed(0.5), prompts, 8)

    def no_calibrating(*args, **kwargs):
        raise AssertionError("calibrated again although the checkpoint matches")

    with monkeypatch.context() as patch:
        patch.setattr(registry, "calibrate", no_calibrating)
        with caplog.at_level(logging.INFO, logger="kvloom"):
            assert kvloom_greedy(smoothed(0.5), prompts, 8) == first
        assert "Loaded the quantized checkpoint" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvloom"):
        smoothed(0.8)
    assert "another model or settings" in caplog.text


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
    ({"quantization": "int8", "override_backend_config": {"int8_activations": True, "int8_smoothing_alpha": 1.5}},
     r"int8_smoothing_alpha must be a number in \[0, 1\]"),
    ({"quantization": "int8", "override_backend_config": {"int8_activations": True, "int8_smoothing_alpha": "a"}},
     "int8_smoothing_alpha must be a number"),
    ({"quantization": "int8", "override_backend_config": {"int8_gguf_blocks": "yes"}},
     "int8_gguf_blocks must be true or false"),
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


def test_gguf_q8_0_weights_are_rescaled_from_their_exact_values_not_from_bf16(tmp_path) -> None:
    """A Q8_0 weight's codes times its block scales are exact in fp32; int8 storage is quantized from
    those, before the model's bf16 could round them."""
    import tiny_models

    from kvloom.loader.gguf import iter_gguf_weights

    checkpoint = tiny_models.build_tiny_checkpoint(str(tmp_path / "hf"), arch="llama", tie_word_embeddings=False)
    q8_0 = 8
    path = tiny_models.write_tiny_gguf(str(tmp_path / "q8.gguf"), checkpoint,
                                       types={"attn": q8_0, "attn_o": q8_0, "ffn": q8_0, "ffn_down": q8_0})
    llm = LLM(model=path, dtype="bfloat16", max_model_len=128, quantization="int8",
              override_backend_config={"attention_backend": "reference", "int8_activations": False})
    down = llm.llm_engine.executor.driver.model.layers[0].mlp.down_proj.packed
    exact = dict(iter_gguf_weights(path, 4, 2))["model.layers.0.mlp.down_proj.weight"]
    assert exact.dtype == torch.float32
    expected_q, expected_scale = int8.quantize_per_channel(exact)
    assert torch.equal(down.qweight, expected_q) and torch.equal(down.scale, expected_scale)
    via_bf16, _ = int8.quantize_per_channel(exact.to(torch.bfloat16))
    assert not torch.equal(via_bf16, expected_q)  # the rounding this path avoids would have shown


# ---- GGUF Q8_0 kept as its int8 codes and block scales ------------------------------------------------
SMOLLM2_SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3}
GGML_F32, GGML_Q8_0 = 0, 8


@pytest.fixture(scope="module")
def q8_0_tiny(tmp_path_factory) -> tuple[str, str]:
    """(HF dir, its Q8_0 GGUF): a 2-layer model of SmolLM2-135M's widths (K = 576 and 1536), written as an
    F32 GGUF and re-quantized to Q8_0 with the gguf package (requantize_gguf, as the real model is)."""
    import tiny_models

    root = tmp_path_factory.mktemp("q8_0_tiny")
    checkpoint = tiny_models.build_tiny_checkpoint(str(root / "hf"), arch="llama", tie_word_embeddings=False,
                                                   **SMOLLM2_SHAPE)
    kinds = ("embed", "attn", "attn_o", "ffn", "ffn_down", "output")
    f32 = tiny_models.write_tiny_gguf(str(root / "f32.gguf"), checkpoint, types=dict.fromkeys(kinds, GGML_F32))
    return checkpoint, tiny_models.requantize_gguf(f32, str(root / "q8_0.gguf"))


def file_q8_0_blocks(path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each Q8_0 tensor's codes and scales decoded from the file with the gguf package (not kvloom's reader):
    gguf name -> (int8 [N, K], fp16 scales as fp32 [N, K / 32]), in the file's row order."""
    import gguf
    import numpy as np

    blocks = {}
    for tensor in gguf.GGUFReader(path).tensors:
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            n, k = int(tensor.shape[1]), int(tensor.shape[0])
            raw = np.asarray(tensor.data).reshape(n, k // 32, 34)
            codes = np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(n, k)
            scales = np.ascontiguousarray(raw[..., :2]).view(np.float16).reshape(n, k // 32)
            blocks[tensor.name] = (torch.from_numpy(codes.copy()), torch.from_numpy(scales.astype(np.float32)))
    return blocks


def hf_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order back to HF's (the inverse of tiny_models.write_tiny_gguf's permute)."""
    return weight.reshape(heads, weight.shape[0] // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(
        weight.shape)


def test_q8_0_gguf_loads_its_own_codes_and_block_scales_bit_exactly(q8_0_tiny, monkeypatch) -> None:
    """int8 with a Q8_0 GGUF keeps each projection's, the embedding's and the head's codes and scales as the file
    stores them: nothing is dequantized or re-quantized."""
    from kvloom.loader import gguf as kvloom_gguf

    dequantized = []
    real = int8.Int8Blocks.dequantize
    monkeypatch.setattr(int8.Int8Blocks, "dequantize", lambda blocks: dequantized.append(blocks.shape) or real(blocks))

    def never(*args, **kwargs):
        raise AssertionError("a Q8_0 weight was dequantized as it was read, or re-quantized")

    monkeypatch.setitem(kvloom_gguf._TORCH_DEQUANTIZERS, GGML_Q8_0, never)
    monkeypatch.setattr(int8, "quantize_per_channel", never)
    _, path = q8_0_tiny
    llm = LLM(model=path, dtype="bfloat16", max_model_len=128, quantization="int8",
              override_backend_config={"attention_backend": "reference"})
    assert dequantized == []
    model = llm.llm_engine.executor.driver.model
    stored = file_q8_0_blocks(path)
    codes, scales = stored["token_embd.weight"]
    assert torch.equal(model.embed_tokens.qweight, codes) and torch.equal(model.embed_tokens.weight_scale, scales)
    codes, scales = stored["output.weight"]
    assert torch.equal(model.lm_head.packed.qweight, codes) and torch.equal(model.lm_head.packed.scale, scales)
    heads, kv_heads = SMOLLM2_SHAPE["num_attention_heads"], SMOLLM2_SHAPE["num_key_value_heads"]
    for i, layer in enumerate(model.layers):
        expected = {
            layer.self_attn.qkv_proj: [hf_rows(t, heads) for t in stored[f"blk.{i}.attn_q.weight"]],
            layer.self_attn.o_proj: stored[f"blk.{i}.attn_output.weight"],
            layer.mlp.gate_up_proj: stored[f"blk.{i}.ffn_gate.weight"],
            layer.mlp.down_proj: stored[f"blk.{i}.ffn_down.weight"],
        }
        q_rows = expected[layer.self_attn.qkv_proj]
        k_rows = [hf_rows(t, kv_heads) for t in stored[f"blk.{i}.attn_k.weight"]]
        v_rows = stored[f"blk.{i}.attn_v.weight"]
        expected[layer.self_attn.qkv_proj] = [torch.cat(parts) for parts in zip(q_rows, k_rows, v_rows)]
        up = stored[f"blk.{i}.ffn_up.weight"]
        expected[layer.mlp.gate_up_proj] = [torch.cat(parts) for parts in zip(expected[layer.mlp.gate_up_proj], up)]
        for linear, (codes, scales) in expected.items():
            assert isinstance(linear.packed, int8.NativeInt8BlocksLinear)
            assert linear.weight.numel() == 0
            assert torch.equal(linear.packed.qweight, codes) and torch.equal(linear.packed.scale, scales)


@pytest.mark.parametrize("quantization", ["int8", "gguf"])
def test_q8_0_projections_pack_from_the_files_bytes_in_one_pass(q8_0_tiny, monkeypatch, quantization: str) -> None:
    """A Q8_0 GGUF on the CPU (quantization "int8", a Q8_0 file's default, or "gguf"): each projection's shards go
    from the file's bytes to its packed panels in one pass, never decoded to int8 codes on the way, and the panels and
    scales are bit for bit those of the int8 blocks the file holds, joined and packed as before."""
    from kvloom.ops import cpu

    if not cpu.int8_kernels_available():
        pytest.skip("the CPU int8 kernels are not built here")
    from kvloom.layers.linear import Linear

    decoded = []
    real = Linear.q8_0_to_int8
    monkeypatch.setattr(Linear, "q8_0_to_int8", lambda layer: decoded.extend(layer.q8_0) or real(layer))
    _, path = q8_0_tiny
    llm = LLM(model=path, dtype="bfloat16", max_model_len=128, quantization=quantization)
    assert decoded == []
    model = llm.llm_engine.executor.driver.model
    stored = file_q8_0_blocks(path)
    heads, kv_heads = SMOLLM2_SHAPE["num_attention_heads"], SMOLLM2_SHAPE["num_key_value_heads"]
    for i, layer in enumerate(model.layers):
        parts = {
            layer.self_attn.qkv_proj: [[hf_rows(t, heads) for t in stored[f"blk.{i}.attn_q.weight"]],
                                       [hf_rows(t, kv_heads) for t in stored[f"blk.{i}.attn_k.weight"]],
                                       stored[f"blk.{i}.attn_v.weight"]],
            layer.self_attn.o_proj: [stored[f"blk.{i}.attn_output.weight"]],
            layer.mlp.gate_up_proj: [stored[f"blk.{i}.ffn_gate.weight"], stored[f"blk.{i}.ffn_up.weight"]],
            layer.mlp.down_proj: [stored[f"blk.{i}.ffn_down.weight"]],
        }
        for linear, shards in parts.items():
            expected = cpu.PackedInt8BlocksWeight(*(torch.cat(t) for t in zip(*shards)), None)
            assert isinstance(linear.packed, cpu.PackedInt8BlocksWeight) and linear.q8_0 == {}
            assert torch.equal(linear.packed.data, expected.data) and torch.equal(linear.packed.scale, expected.scale)
    assert llm.generate(["The"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].outputs[0].text


def blocks_llm(path: str, backend: str, dtype: str = "float32", overrides: dict | None = None, **kwargs) -> LLM:
    return LLM(model=path, dtype=dtype, max_model_len=256, quantization="int8",
               override_backend_config={"attention_backend": backend, **(overrides or {})}, **kwargs)


def assert_same_greedy_up_to_near_ties(llm: LLM, reference: LLM, prompts: list[list[int]], max_tokens: int,
                                       gap: float) -> None:
    """llm's greedy tokens equal reference's, except from a step where reference's two best logprobs are
    within ``gap`` (activations rounded to int8 make the model a step function: sums in another fp32 order
    may move one across a rounding boundary, and a near tie of a random model then flips)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    expected = reference.generate(inputs, params, use_tqdm=False)
    actual = kvloom_greedy(llm, prompts, max_tokens)
    identical = 0
    for want, got in zip(expected, actual):
        tokens = want.outputs[0].token_ids
        if tokens == got:
            identical += 1
            continue
        step = next(i for i, (a, b) in enumerate(zip(tokens, got)) if a != b)
        best = sorted((lp.logprob for lp in want.outputs[0].logprobs[step].values()), reverse=True)
        assert got[step] in want.outputs[0].logprobs[step] and best[0] - best[1] < gap, (step, tokens, got)
    assert identical >= len(prompts) - 2


def test_q8_0_blocks_greedy_with_the_cpu_kernel_equals_the_reference_ops(q8_0_tiny, monkeypatch) -> None:
    """The C++ product in place of the torch one, all else the reference ops (fp32): the same greedy tokens,
    up to near ties."""
    from kvloom.ops import cpu, table

    if not cpu.int8_kernels_available():
        pytest.skip("the CPU int8 kernels are not built here")
    _, path = q8_0_tiny
    reference = blocks_llm(path, "reference")
    monkeypatch.setattr(table, "REFERENCE_OPS", dataclasses.replace(
        table.REFERENCE_OPS, pack_linear_int8_blocks=cpu.PackedInt8BlocksWeight))
    fast = blocks_llm(path, "reference")
    assert isinstance(fast.llm_engine.executor.driver.model.layers[0].mlp.down_proj.packed, cpu.PackedInt8BlocksWeight)
    assert_same_greedy_up_to_near_ties(fast, reference, mixed_prompts(400, count=8), 16, gap=0.1)


def test_q8_0_blocks_on_the_fast_path_in_bf16_agree_with_the_reference_ops(q8_0_tiny) -> None:
    """The whole fast path (C++ attention and GEMMs, bf16) against the reference ops in fp32: most prompts
    start the same (bf16 and activation rounding may flip a near tie)."""
    _, path = q8_0_tiny
    prompts = mixed_prompts(400, count=8)
    fast = kvloom_greedy(blocks_llm(path, "auto", dtype="bfloat16"), prompts, 8)
    slow = kvloom_greedy(blocks_llm(path, "reference"), prompts, 8)
    assert sum(a[:4] == b[:4] for a, b in zip(fast, slow)) >= 6, (fast, slow)


def test_q8_0_blocks_greedy_equals_transformers_on_the_dequantized_weights_and_blocked_activations(
        q8_0_tiny, tmp_path) -> None:
    """The oracle: transformers with the Q8_0 weights dequantized (exact in fp32) and every projection's input, and
    the LM head's (kept in its Q8_0 blocks too), rounded through int8 per block of 32 (a pre-hook), as the blocks'
    product quantizes it."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from kvloom.loader.gguf import iter_gguf_weights

    checkpoint, path = q8_0_tiny
    target = str(tmp_path / "dequantized")
    shutil.copytree(checkpoint, target)
    weights = dict(iter_gguf_weights(path, SMOLLM2_SHAPE["num_attention_heads"], SMOLLM2_SHAPE["num_key_value_heads"]))
    save_file(weights, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def blocked_input(_module: torch.nn.Module, inputs: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
        x = inputs[0]
        rows = int8.dequantize_blocks(*int8.quantize_per_block(x.reshape(-1, x.shape[-1])))
        return (rows.view(x.shape),)

    for name, module in model.named_modules():
        if name.endswith(PROJECTIONS) or name == "lm_head":
            module.register_forward_pre_hook(blocked_input)
    prompts = mixed_prompts(400, count=8)
    actual = kvloom_greedy(blocks_llm(path, "reference"), prompts, 16)
    identical = 0
    with torch.no_grad():
        for prompt, got in zip(prompts, actual):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16,
                                 pad_token_id=0, eos_token_id=None, output_scores=True, return_dict_in_generate=True)
            want = out.sequences[0, len(prompt):].tolist()
            if want == got:
                identical += 1
                continue
            # Activations rounded to int8 make the model a step function: torch's fp32 products in another order
            # (oneDNN's AMX-era kernels order sums by shape) may move one across a rounding boundary, and a near
            # tie of a random model then flips. Allowed only from a step where transformers' two best are that close.
            step = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
            logprobs = torch.log_softmax(out.scores[step][0].float(), dim=-1)
            best, second = logprobs.topk(2).values.tolist()
            assert best - second < 0.1 and logprobs[got[step]] >= second, (step, best - second, want, got)
    assert identical >= len(prompts) - 1


def test_q8_0_blocks_skip_smoothing_and_say_so(q8_0_tiny, caplog) -> None:
    """Blocks need no smoothing: an alpha set by hand is not applied, with a warning naming the way to get
    it; int8_gguf_blocks=false re-quantizes per row (and smooths) instead."""
    _, path = q8_0_tiny
    with caplog.at_level(logging.INFO, logger="kvloom"):
        llm = blocks_llm(path, "reference", overrides={"int8_smoothing_alpha": 0.5})
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "int8_smoothing_alpha=0.5" in r.message]
    assert warnings and "int8_gguf_blocks" in warnings[0].message
    assert llm.llm_engine.executor.driver.model.layers[0].mlp.down_proj.packed.scale.dim() == 2
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvloom"):
        rows = blocks_llm(path, "reference", overrides={"int8_gguf_blocks": False})
    assert isinstance(rows.llm_engine.executor.driver.model.layers[0].mlp.down_proj.packed, int8.NativeInt8Linear)
    assert "not applied" not in caplog.text


def test_a_q8_0_gguf_keeps_its_blocks_by_default(q8_0_tiny) -> None:
    """quantization=None on a GGUF whose projections are Q8_0 keeps them as int8 blocks (the file's own format,
    as a 4-bit file keeps its code blocks): the same tokens as quantization="int8"; "none" dequantizes them."""
    _, path = q8_0_tiny
    prompts = mixed_prompts(400, count=4)
    default = LLM(model=path, dtype="float32", max_model_len=256,
                  override_backend_config={"attention_backend": "reference"})
    assert default.llm_engine.config.quantization == "int8"
    assert default.llm_engine.executor.driver.model.layers[0].mlp.down_proj.packed.scale.dim() == 2
    assert kvloom_greedy(default, prompts, 8) == kvloom_greedy(blocks_llm(path, "reference"), prompts, 8)
    dequantized = LLM(model=path, dtype="float32", max_model_len=256, quantization="none",
                      override_backend_config={"attention_backend": "reference"})
    assert dequantized.llm_engine.config.quantization is None
    off = LLM(model=path, dtype="float32", max_model_len=256,
              override_backend_config={"attention_backend": "reference", "int8_gguf_blocks": False})
    assert off.llm_engine.config.quantization is None


def test_quantized_checkpoint_keeps_the_block_scales(q8_0_tiny, tmp_path, caplog, monkeypatch) -> None:
    from safetensors import safe_open

    from kvloom.loader import gguf as kvloom_gguf

    _, path = q8_0_tiny
    saved = str(tmp_path / "q8_0-int8.safetensors")
    prompts = mixed_prompts(400, count=4)
    first = kvloom_greedy(blocks_llm(path, "auto", quantized_checkpoint_path=saved), prompts, 8)
    with safe_open(saved, framework="pt") as f:
        assert tuple(f.get_slice("layers.0.mlp.down_proj.weight_scale").get_shape()) == (576, 1536 // 32)

    def no_reading(*args, **kwargs):
        raise AssertionError("the GGUF's weights were read again although the checkpoint matches")

    monkeypatch.setattr(kvloom_gguf, "iter_gguf_weights", no_reading)
    with caplog.at_level(logging.INFO, logger="kvloom"):
        second = kvloom_greedy(blocks_llm(path, "auto", quantized_checkpoint_path=saved), prompts, 8)
    assert "Loaded the quantized checkpoint" in caplog.text
    assert second == first


def test_tensor_parallel_q8_0_blocks_equal_one_rank(tiny_llama_dir, tmp_path) -> None:
    """Column-parallel layers keep their rows' block scales, row-parallel ones the scales of their own blocks."""
    import tiny_models

    q8 = GGML_Q8_0
    path = tiny_models.write_tiny_gguf(str(tmp_path / "q8.gguf"), tiny_llama_dir,
                                       types={"attn": q8, "attn_o": q8, "ffn": q8, "ffn_down": q8})
    prompts = mixed_prompts(400, count=4)
    one = blocks_llm(path, "reference")
    assert one.llm_engine.executor.driver.model.layers[0].self_attn.o_proj.packed.scale.shape == (64, 2)
    two = blocks_llm(path, "reference", tensor_parallel_size=2)
    try:
        assert kvloom_greedy(two, prompts, 8) == kvloom_greedy(one, prompts, 8)
    finally:
        two.llm_engine.shutdown()


def test_tensor_parallel_q8_0_bytes_equal_one_rank(tiny_llama_dir, tmp_path) -> None:
    """quantization "gguf" on a CPU hands the Q8_0 projections over as the file's bytes: each rank cuts them as int8
    blocks (columns and rows alike) and greedy decoding equals one rank's, which packs them from the bytes."""
    import tiny_models

    q8 = GGML_Q8_0
    path = tiny_models.write_tiny_gguf(str(tmp_path / "q8.gguf"), tiny_llama_dir,
                                       types={"attn": q8, "attn_o": q8, "ffn": q8, "ffn_down": q8})
    prompts = mixed_prompts(400, count=4)
    one = LLM(model=path, dtype="float32", max_model_len=256, quantization="gguf")
    two = LLM(model=path, dtype="float32", max_model_len=256, quantization="gguf", tensor_parallel_size=2)
    try:
        assert kvloom_greedy(two, prompts, 8) == kvloom_greedy(one, prompts, 8)
    finally:
        two.llm_engine.shutdown()


def test_row_parallel_split_must_keep_whole_blocks() -> None:
    from kvloom.layers.tensor_parallel import _shard_rows_in

    linear = Linear(64, [8])
    linear.load_shard("weight", 0, int8.Int8Blocks(*int8.quantize_per_block(torch.randn(8, 64))))
    with pytest.raises(ValueError, match=r"gives each rank 16 of the layer's inputs \(64\), which cuts the GGUF's "
                                         r"blocks of 32"):
        _shard_rows_in(linear, 0, 4, None)


def test_tensor_parallel_that_would_cut_q8_0_blocks_is_refused_before_any_process_starts() -> None:
    from kvloom.layers.tensor_parallel import validate_tensor_parallel
    from kvloom.loader.model_config import ModelConfig

    config = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 96,
                                       "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 2,
                                       "num_key_value_heads": 2}, "config.json")
    validate_tensor_parallel(config, 2, torch.device("cpu"))  # per-row int8 or float: fine
    with pytest.raises(ValueError, match=r"each rank 48 of the attention output \(o_proj\) inputs \(96\)"):
        validate_tensor_parallel(config, 2, torch.device("cpu"), int8_blocks=True)


def test_a_fused_layer_of_rows_and_blocks_holds_blocks_exactly() -> None:
    """A GGUF may store q as Q8_0 and k as another type: the layer holds blocks, the rows' scale repeated."""
    linear = Linear(64, [8, 4])
    rows = int8.Int8Rows.quantize(torch.randn(4, 64))
    blocks = int8.Int8Blocks(*int8.quantize_per_block(torch.randn(8, 64)))
    linear.load_shard("weight", 1, rows)
    linear.load_shard("weight", 0, blocks)
    assert linear.blocks and torch.equal(linear.qweight, torch.cat([blocks.qweight, rows.qweight]))
    assert torch.equal(int8.dequantize_blocks(linear.qweight, linear.weight_scale)[8:], int8.dequantize(*rows))


@pytest.fixture(scope="module")
def smollm2_q8_0(smollm2_gguf_path, tmp_path_factory) -> str:
    """A Q8_0 SmolLM2, made from the shipped (Q4_1) weights with the gguf package."""
    import tiny_models

    return tiny_models.requantize_gguf(smollm2_gguf_path, str(tmp_path_factory.mktemp("q8") / "smollm2-q8_0.gguf"))


def test_smollm2_q8_0_loads_as_int8_with_the_perplexity_of_its_float_load(smollm2_q8_0) -> None:
    from kvloom.bench.int8_quality import perplexity, reference_text

    results = {}
    for quantization in (None, "int8"):
        llm = LLM(model=smollm2_q8_0, dtype="bfloat16", max_model_len=600, quantization=quantization)
        ids = llm.get_tokenizer().encode(reference_text())[:1024]
        results[quantization] = perplexity(llm, ids, 512)
        llm.llm_engine.shutdown()
    assert results["int8"] / results[None] < 1.02, results


@pytest.fixture(scope="module")
def smollm2_bf16_quality(smollm2_gguf_path) -> dict:
    from kvloom.bench.int8_quality import measure

    return measure("SmolLM2-135M-Instruct", None, 32, 4096, 512, False)


# (int8_activations, perplexity ratio bound, identical share, mean identical prefix): bounds below the
# measured 1.004 / 0.375 / 21.2 (weight-only) and 1.007 / 0.19 / 13.2 (W8A8 smoothed, alpha 0.65; unsmoothed
# W8A8 measured 1.033 / 0.06 / 8.8, which the bounds reject).
@pytest.mark.parametrize("activations, max_ratio, share, prefix", [
    ("off", 1.02, 0.25, 16), ("default", 1.015, 0.125, 11)], ids=["weight_only", "w8a8_smoothed_default"])
def test_smollm2_int8_quality_bounds(smollm2_bf16_quality, activations, max_ratio, share, prefix) -> None:
    """The issue's quality measure (benchmarks/int8_quality.py) on the default model: perplexity within 2%
    of bf16's (the default, W8A8 with smoothing, with margin) and greedy chat answers that agree."""
    from kvloom.bench.int8_quality import compare, measure

    quantized = measure("SmolLM2-135M-Instruct", "int8", 32, 4096, 512, False,
                        activations=None if activations == "default" else activations)
    result = compare(smollm2_bf16_quality, quantized, 32)
    assert quantized["int8_activations"] == (activations == "default"), quantized
    assert result["perplexity_ratio"] < max_ratio, result
    assert result["identical_share"] >= share and result["mean_identical_prefix"] >= prefix, result
    assert result["weight_bytes_ratio"] < 0.7, result

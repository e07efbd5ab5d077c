"""GPTQ and AWQ safetensors checkpoints, read from their quantization_config.

The tests quantize a tiny Llama themselves: integer codes q, zero points z and fp16 scales s per group, packed
the way each format's writer packs them (AutoGPTQ: 8 inputs per int32 along K, zeros stored minus one; AutoAWQ:
8 output columns per int32 in the order 0 2 4 6 1 3 5 7). The oracle is transformers running a plain float
checkpoint of W = s (q - z) computed from those integers, never kvloom's unpacking.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from e2e.test_correctness import hf_greedy, kvloom_greedy, mixed_prompts
from kvloom import LLM, SamplingParams
from kvloom.layers.linear import Linear
from kvloom.ops import cpu

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's writer: nibble j holds column order[j] of each 8


def _words(nibbles: np.ndarray) -> torch.Tensor:
    """[..., 8] values 0..15 -> int32 [...]: value j in bits 4 j."""
    packed = np.zeros(nibbles.shape[:-1], dtype=np.uint32)
    for j in range(8):
        packed |= nibbles[..., j].astype(np.uint32) << np.uint32(4 * j)
    return torch.from_numpy(packed.view(np.int32))


def quantize_checkpoint(source: str, target: str, float_target: str, method: str, group_size: int,
                        act_order: bool = False, seed: int = 0) -> None:
    """``target``: ``source`` with every projection quantized to 4 bits in ``method``'s packing; ``float_target``:
    the same model with W = s (q - z) in float32, for transformers."""
    rng = np.random.default_rng(seed)
    shutil.copytree(source, target)
    shutil.copytree(source, float_target)
    weights = load_file(os.path.join(source, "model.safetensors"))
    packed, dense = {}, {}
    for name, weight in weights.items():
        prefix = name.removesuffix(".weight")
        if not prefix.endswith(PROJECTIONS):
            packed[name] = dense[name] = weight
            continue
        n, k = weight.shape
        groups = k // group_size
        q = rng.integers(0, 16, size=(k, n))
        z = rng.integers(1, 16, size=(groups, n))
        s = (rng.uniform(0.5, 1.5, size=(groups, n)) * weight.abs().max().item() / 8).astype(np.float16)
        g_idx = np.arange(k) // group_size
        if act_order:
            g_idx = rng.permutation(g_idx)
        w = s.astype(np.float32)[g_idx] * (q - z[g_idx])  # [K, N]
        dense[name] = torch.from_numpy(w.T.copy()).float()
        if method == "gptq":
            packed[f"{prefix}.qweight"] = _words(q.reshape(k // 8, 8, n).transpose(0, 2, 1))
            packed[f"{prefix}.qzeros"] = _words((z - 1).reshape(groups, n // 8, 8))
            packed[f"{prefix}.g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        else:
            order = list(AWQ_PACK_ORDER)
            packed[f"{prefix}.qweight"] = _words(q.reshape(k, n // 8, 8)[..., order])
            packed[f"{prefix}.qzeros"] = _words(z.reshape(groups, n // 8, 8)[..., order])
        packed[f"{prefix}.scales"] = torch.from_numpy(s)
    save_file(packed, os.path.join(target, "model.safetensors"))
    save_file(dense, os.path.join(float_target, "model.safetensors"))
    config_path = os.path.join(target, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": False,
         "checkpoint_format": "gptq"} if method == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"})
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f)


@pytest.fixture(scope="module", params=[("gptq", 32, False), ("gptq", 64, True), ("awq", 32, False)],
                ids=["gptq", "gptq-act-order", "awq"])
def int4_pair(request: pytest.FixtureRequest, tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[str, str, bool]:
    method, group_size, act_order = request.param
    root = tmp_path_factory.mktemp(request.node.callspec.id if hasattr(request.node, "callspec") else method)
    quantized, dense = str(root / "int4"), str(root / "float")
    quantize_checkpoint(tiny_llama_dir, quantized, dense, method, group_size, act_order)
    return quantized, dense, act_order


def test_dequantized_equals_transformers_on_the_same_values(int4_pair: tuple[str, str, bool]) -> None:
    quantized, dense, _ = int4_pair
    prompts = mixed_prompts(400, count=4, seed=1)
    llm = LLM(model=quantized, dtype="float32", max_model_len=128, quantization="none")
    assert kvloom_greedy(llm, prompts, 8) == hf_greedy(dense, prompts, 8)


def test_default_keeps_4bit_blocks_of_exactly_those_values(int4_pair: tuple[str, str, bool]) -> None:
    from kvloom.loader.weights import iter_weights, resolve_model
    from kvloom.ops.q4 import Q4Blocks

    quantized, _, act_order = int4_pair
    source = resolve_model(quantized)
    floats = dict(iter_weights(source))
    kept = dict(iter_weights(source, keep_q4=True))
    projections = [name for name in kept if name.removesuffix(".weight").endswith(PROJECTIONS)]
    assert len(projections) == 2 * len(PROJECTIONS)
    for name in projections:
        # Activation order has no blocks of 32 sharing a scale: those weights come dequantized (a log line says so),
        # except where a layer has a single group (the tiny model's 64 inputs in groups of 64).
        shuffled = act_order and floats[name].shape[1] > 64
        assert isinstance(kept[name], torch.Tensor if shuffled else Q4Blocks), name
        values = kept[name].dequantize() if isinstance(kept[name], Q4Blocks) else kept[name]
        assert torch.equal(values, floats[name]), name


def test_default_runs_the_4bit_product(int4_pair: tuple[str, str, bool]) -> None:
    """The kept weights run csrc/gemm_q4.cpp, which equals torch's Q4 product (the reference backend) up to an
    activation code at a rounding tie (tests/e2e/test_gguf_4bit.py says more)."""
    if not cpu.cpu_kernel_available():
        pytest.skip("the CPU kernels could not be built here")
    quantized, _, act_order = int4_pair
    if act_order:
        pytest.skip("activation order: dequantized, nothing 4-bit to run")
    method = json.load(open(os.path.join(quantized, "config.json")))["quantization_config"]["quant_method"]
    results = []
    for backend in ("auto", "reference"):
        llm = LLM(model=quantized, dtype="float32", max_model_len=128,
                  override_backend_config={"attention_backend": backend})
        assert llm.llm_engine.config.quantization == method
        kinds = {type(m.packed).__name__ for m in llm.llm_engine.executor.driver.model.modules()
                 if isinstance(m, Linear)}
        assert kinds == ({"PackedQ4Weight"} if backend == "auto" else {"NativeQ4Linear"}), kinds
        prompts = [{"prompt_token_ids": p} for p in mixed_prompts(400, count=4, seed=3)]
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        results.append([[next(iter(lp.values())).logprob for lp in o.prompt_logprobs[1:]] for o in outputs])
    for fast, reference in zip(*results):
        assert np.abs(np.subtract(fast, reference)).max() < 2e-2


def test_bad_int4_configs_are_refused(tiny_llama_dir: str, tmp_path) -> None:
    for config, match in (({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits=8"),
                          ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "group_size=48"),
                          ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported"),
                          ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "'gemv'")):
        target = str(tmp_path / config["quant_method"] / str(len(config)) / str(config.get("bits")))
        shutil.copytree(tiny_llama_dir, target)
        with open(os.path.join(target, "config.json"), encoding="utf-8") as f:
            values = json.load(f)
        values["quantization_config"] = config
        with open(os.path.join(target, "config.json"), "w", encoding="utf-8") as f:
            json.dump(values, f)
        with pytest.raises(ValueError, match=match):
            LLM(model=target)
    with pytest.raises(ValueError, match="not quantized"):
        LLM(model=tiny_llama_dir, quantization="awq")


def test_a_missing_part_names_the_tensor(tiny_llama_dir: str, tmp_path) -> None:
    quantized, dense = str(tmp_path / "q"), str(tmp_path / "f")
    quantize_checkpoint(tiny_llama_dir, quantized, dense, "awq", 32)
    tensors = load_file(os.path.join(quantized, "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.scales"]
    save_file(tensors, os.path.join(quantized, "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj.*scales"):
        LLM(model=quantized)

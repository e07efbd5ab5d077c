"""quantization="int8" on the mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE), from safetensors and GGUF: the
experts run int8 (the dense layers' per-row format, each expert's product packed for the platform's int8 GEMM),
the routers stay float, and the model stays close to the float one, as the dense families' int8 does."""

from __future__ import annotations

import pytest
import tiny_models

from e2e.test_correctness import kvloom_greedy, mixed_prompts
from kvloom import LLM, SamplingParams
from kvloom.layers.linear import Linear
from kvloom.layers.moe import FusedMoE
from kvloom.ops.native import PackedInt8Experts


def _experts_and_routers(llm: LLM) -> tuple[list[FusedMoE], list[Linear]]:
    model = llm.llm_engine.executor.driver.model
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    routers = [m for m in model.modules() if isinstance(m, Linear) and getattr(m, "keep_float", False)]
    return experts, routers


def _prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[float]:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [next(iter(lp.values())).logprob for out in outputs for lp in out.prompt_logprobs[1:]]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_int8_experts_run_int8_and_stay_close_to_float(family: str, tmp_path) -> None:
    model_dir = tiny_models.build_tiny_family_checkpoint(str(tmp_path / family), family)
    prompts = mixed_prompts(400, count=6, seed=4)
    dense = LLM(model=model_dir, dtype="float32", max_model_len=128)
    int8 = LLM(model=model_dir, dtype="float32", max_model_len=128, quantization="int8")
    experts, routers = _experts_and_routers(int8)
    assert experts and all(isinstance(e.packed, PackedInt8Experts) for e in experts)
    assert routers and all(not r.quantized for r in routers)
    # As the dense families' int8 test: the first greedy token mostly stays ...
    float_tokens, int8_tokens = kvloom_greedy(dense, prompts, 1), kvloom_greedy(int8, prompts, 1)
    assert sum(a == b for a, b in zip(float_tokens, int8_tokens)) >= 4
    # ... and the prompt logprobs move little (W8A8 on the CPU rounds the activations too, unsmoothed here).
    diffs = [abs(a - b) for a, b in zip(_prompt_logprobs(dense, prompts), _prompt_logprobs(int8, prompts))]
    assert sum(diffs) / len(diffs) < 0.05, sum(diffs) / len(diffs)


def test_int8_experts_from_a_gguf(tmp_path) -> None:
    """A Qwen2-MoE GGUF (its expert stacks dequantized as read, then quantized per row like the checkpoint's)."""
    checkpoint = tiny_models.build_tiny_family_checkpoint(str(tmp_path / "hf"), "qwen2_moe")
    path = tiny_models.write_tiny_family_gguf(str(tmp_path / "f32.gguf"), checkpoint, "qwen2moe")
    prompts = mixed_prompts(400, count=3, seed=6)
    from_gguf = LLM(model=path, dtype="float32", max_model_len=128, quantization="int8")
    from_checkpoint = LLM(model=checkpoint, dtype="float32", max_model_len=128, quantization="int8")
    experts, _ = _experts_and_routers(from_gguf)
    assert experts and all(isinstance(e.packed, PackedInt8Experts) for e in experts)
    assert kvloom_greedy(from_gguf, prompts, 4) == kvloom_greedy(from_checkpoint, prompts, 4)


def test_a_quantized_checkpoint_path_is_refused_for_experts(tmp_path) -> None:
    model_dir = tiny_models.build_tiny_family_checkpoint(str(tmp_path / "mixtral"), "mixtral")
    with pytest.raises(ValueError, match="quantized_checkpoint_path is not supported for MixtralForCausalLM"):
        LLM(model=model_dir, dtype="float32", max_model_len=64, quantization="int8",
            quantized_checkpoint_path=str(tmp_path / "q"))

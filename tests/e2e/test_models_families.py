"""Every model family against HF transformers (the oracle) on tiny random checkpoints that transformers'
own config classes build (tests/tiny_models.py _FAMILIES): greedy tokens equal token for token in fp32
through ``LLM.generate`` with the paged cache, batched prompts of different lengths, and prompt logprobs
within 1e-4."""

from __future__ import annotations

import pytest
import torch

from kvloom import LLM, SamplingParams

from .test_correctness import assert_no_blocks_held, hf_greedy, kvloom_greedy, mixed_prompts

FAMILIES = ["qwen2", "qwen2_tied", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Built on first use, one per family, shared by this module's tests."""
    return {}


def family_dir(family: str, dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    from tiny_models import build_tiny_family_checkpoint

    if family not in dirs:
        dirs[family] = build_tiny_family_checkpoint(str(tmp_path_factory.mktemp(family)), family)
    return dirs[family]


def assert_prompt_logprobs_match(model_dir: str, prompt: list[int], **llm_kwargs: object) -> None:
    """Logprobs at every prompt position and the first sampled one within 1e-4 of transformers' (fp32)."""
    from transformers import AutoModelForCausalLM

    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, **llm_kwargs)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=10, logprobs=10),
                       use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for position in range(1, len(prompt)):
        entry = out.prompt_logprobs[position]
        assert prompt[position] in entry
        for token_id, logprob in entry.items():
            assert abs(logprob.logprob - expected[position - 1, token_id].item()) < 1e-4, position
    for token_id, logprob in out.outputs[0].logprobs[0].items():
        assert abs(logprob.logprob - expected[-1, token_id].item()) < 1e-4
    assert out.outputs[0].token_ids[0] == int(expected[-1].argmax())


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logprobs_match_transformers(family: str, family_dirs: dict[str, str],
                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    model_dir = family_dir(family, family_dirs, tmp_path_factory)
    assert_prompt_logprobs_match(model_dir, mixed_prompts(400, count=1, seed=5)[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_batch_equals_transformers_generate(family: str, family_dirs: dict[str, str],
                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """Prompts of 3..60 tokens in one batch (chunked by a small token budget, so prefill chunks and
    decodes share steps), 12 greedy tokens each."""
    model_dir = family_dir(family, family_dirs, tmp_path_factory)
    prompts = mixed_prompts(400, count=6, seed=1)
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, max_num_batched_tokens=64)
    assert kvloom_greedy(llm, prompts, MAX_TOKENS) == expected
    assert_no_blocks_held(llm)



def hf_cached_greedy(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens through its KV cache, one forward per token and nothing else: each key
    keeps the rotation it was computed with (Phi-3's generate instead drops its cache and recomputes the
    whole sequence with the long factors once it outgrows the original context)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cache = DynamicCache(config=model.config)
    tokens, step = [], torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(step, past_key_values=cache, use_cache=True).logits[0, -1]
            tokens.append(int(logits.argmax()))
            step = torch.tensor([[tokens[-1]]])
    return tokens


def test_phi3_longrope_equals_transformers_across_the_original_context(
        family_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> None:
    """LongRoPE with an original context of 48 positions (factor 512 / 48: attention factor ~1.2). Prompt
    logprobs within it (short factors) as transformers'; then generation past it, where each position
    takes the long factors, against transformers' cached forward (kvloom rotates each position once, as
    vLLM does; transformers' Phi-3 generate re-rotates the whole sequence with the long factors instead)."""
    model_dir = family_dir("phi3_longrope", family_dirs, tmp_path_factory)
    prompts = [p for p in mixed_prompts(400, count=8, seed=3) if 20 <= len(p) <= 40][:3]
    assert_prompt_logprobs_match(model_dir, prompts[0])
    expected = [hf_cached_greedy(model_dir, prompt, 20) for prompt in prompts]
    assert all(len(p) + 20 > 48 for p in prompts)
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256)
    assert kvloom_greedy(llm, prompts, 20) == expected


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_gemma3_windows_per_layer_under_every_attention_backend(
        backend: str, family_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> None:
    """Sliding layers (window 8) beside a global one, prompts up to 60 tokens, prefills chunked by a budget of
    7 tokens so chunks continue sequences past their window: the native backend's narrowed decode masks and the
    reference's per-request masks give transformers' tokens too (the C++ kernel: the family tests above)."""
    model_dir = family_dir("gemma3", family_dirs, tmp_path_factory)
    prompts = mixed_prompts(400, count=4, seed=6)
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    llm = LLM(model=model_dir, dtype="float32", max_model_len=128, max_num_batched_tokens=7,
              override_backend_config={"attention_backend": backend})
    assert kvloom_greedy(llm, prompts, MAX_TOKENS) == expected


def test_gemma2_attention_runs_the_reference_with_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """The native ops have no soft-capping: the op table hands Gemma 2 the reference attention, and says so."""
    import logging

    from kvloom.ops import reference
    from kvloom.ops.table import NATIVE_OPS, attention_for

    assert attention_for(NATIVE_OPS, None) is NATIVE_OPS.attention
    with caplog.at_level(logging.INFO, logger="kvloom"):
        chosen = attention_for(NATIVE_OPS, 50.0)
    assert chosen.func is reference.attention_reference and chosen.keywords == {"logit_softcap": 50.0}
    assert "soft-capping" in caplog.text


def test_gemma2_attention_takes_the_cpu_kernel(caplog: pytest.LogCaptureFixture) -> None:
    """The C++ kernel caps the scores itself: Gemma 2 on the CPU ops runs it, with no fallback log line (the
    family tests above then check its greedy tokens against transformers through it)."""
    import logging

    from kvloom.ops import cpu
    from kvloom.ops.table import attention_for, select_ops

    if not cpu.cpu_kernel_available():
        pytest.skip("the CPU attention kernel cannot be built here")
    ops = select_ops(torch.device("cpu"), torch.float32, "cpu")
    with caplog.at_level(logging.INFO, logger="kvloom"):
        chosen = attention_for(ops, 50.0)
    assert chosen.func is cpu.attention and chosen.keywords == {"logit_softcap": 50.0}
    assert "soft-capping" not in caplog.text


_GEMMA3_COMMON = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 400, "hidden_size": 64,
                  "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                  "hidden_activation": "gelu_pytorch_tanh"}


def test_gemma3_config_reads_the_same_in_the_hub_and_transformers5_layouts() -> None:
    from kvloom.loader.model_config import ModelConfig

    hub = ModelConfig.from_hf_dict(dict(_GEMMA3_COMMON, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                                        sliding_window_pattern=6,
                                        rope_scaling={"rope_type": "linear", "factor": 8.0}))
    tf5 = ModelConfig.from_hf_dict(dict(_GEMMA3_COMMON, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                                        rope_parameters={
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                               "rope_theta": 1000000.0}}))
    for config in (hub, tf5):
        assert config.layer_sliding_windows == [8] * 5 + [None]
        assert config.sliding_window is None  # the runner's metadata stays global; layers narrow it
        assert (config.rope_theta, config.local_rope_theta) == (1000000.0, 10000.0)
        assert config.rope_scaling["rope_type"] == "linear" and config.rope_scaling["factor"] == 8.0
        assert config.local_rope_scaling is None and config.qk_norm


def test_qwen2_hub_config_without_use_sliding_window_has_no_window() -> None:
    from kvloom.loader.model_config import ModelConfig

    config = ModelConfig.from_hf_dict({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 400, "hidden_size": 64,
                                       "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                       "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28})
    assert config.sliding_window is None and config.layer_sliding_windows is None and config.qkv_bias


@pytest.mark.parametrize(("change", "message"), [
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn' is not supported"),
    ({"architectures": ["GPTNeoXForCausalLM"]}, "is not supported; supported:"),
    ({"hidden_activation": "relu"}, "hidden activation 'relu' is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_unsupported_config_options_are_clear_errors(change: dict, message: str, tmp_path) -> None:
    import json

    from tiny_models import build_tiny_family_checkpoint

    model_dir = build_tiny_family_checkpoint(str(tmp_path / "phi3"), "phi3")
    path = f"{model_dir}/config.json"
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config.pop("rope_parameters", None)
    config.update(change)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=message):
        LLM(model=model_dir, dtype="float32", max_model_len=64)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "phi3", "gemma2"])
def test_int8_weights_load_for_the_dense_families(family: str, family_dirs: dict[str, str],
                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    """quantization="int8" (smoothed W8A8 on the CPU, but for Gemma, whose norms smoothing cannot fold into):
    Phi-3's fused tensors are split before smoothing sees them; the first greedy token mostly stays."""
    model_dir = family_dir(family, family_dirs, tmp_path_factory)
    prompts = mixed_prompts(400, count=6, seed=4)
    float_tokens = kvloom_greedy(LLM(model=model_dir, dtype="float32", max_model_len=128), prompts, 1)
    int8_tokens = kvloom_greedy(LLM(model=model_dir, dtype="float32", max_model_len=128, quantization="int8"),
                                prompts, 1)
    assert sum(a == b for a, b in zip(float_tokens, int8_tokens)) >= 4


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_prefix_cache_hits_give_the_same_tokens(family: str, family_dirs: dict[str, str],
                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same prompts twice: the second pass starts from cached blocks (past Gemma 3's window of 8)."""
    model_dir = family_dir(family, family_dirs, tmp_path_factory)
    prompts = mixed_prompts(400, count=4, seed=8)
    llm = LLM(model=model_dir, dtype="float32", max_model_len=128, block_size=16)
    first = kvloom_greedy(llm, prompts, MAX_TOKENS)
    hits = llm.llm_engine.kv_cache_manager.prefix_hits
    assert kvloom_greedy(llm, prompts, MAX_TOKENS) == first == hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert llm.llm_engine.kv_cache_manager.prefix_hits > hits


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen2_moe"])
def test_bf16_fast_path_is_as_close_to_fp32_as_the_reference_path(family: str, family_dirs: dict[str, str],
                                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    """bf16 on the CPU: the C++ kernels and packed GEMMs (module by module), and plain torch everywhere, each
    against fp32 through the logprob of every prompt token. Both paths round differently (and a router may
    flip a near-tie between experts), but a path that dropped a bias or a norm would be off by far more.
    (Greedy tokens are no measure here: the tiny models' next-token distributions are nearly flat.)"""
    model_dir = family_dir(family, family_dirs, tmp_path_factory)
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(400, count=6, seed=4)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    logprobs = {}
    for dtype, backend in (("float32", "reference"), ("bfloat16", "auto"), ("bfloat16", "reference")):
        llm = LLM(model=model_dir, dtype=dtype, max_model_len=128,
                  override_backend_config={"attention_backend": backend})
        logprobs[dtype, backend] = torch.tensor([next(iter(entry.values())).logprob for out in llm.generate(
            prompts, params, use_tqdm=False) for entry in out.prompt_logprobs[1:]])
    exact = logprobs["float32", "reference"]
    # A flipped near-tie moves one token's logprob alone (Mixtral's router: 0.17 on the fast path with oneDNN's AMX
    # products, 0.09 without, 0.08 on the reference path, every other token within 0.04): every token within 0.15
    # but one, and that one within 0.4.
    for path in ("auto", "reference"):
        diffs = (logprobs["bfloat16", path] - exact).abs()
        assert int((diffs > 0.15).sum()) <= 1 and diffs.max().item() < 0.4, (path, sorted(diffs.tolist())[-3:])


@pytest.mark.parametrize("family", ["qwen2", "phi3", "mixtral"])
def test_the_llama_layer_stack_is_not_picked_for_other_families(family: str, family_dirs: dict[str, str],
                                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    """csrc/decoder.cpp runs Llama's layers only: the other families run module by module even where the op
    table has the stack (bf16 on the CPU)."""
    model_dir = family_dir(family, family_dirs, tmp_path_factory)
    llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=64)
    model = llm.llm_engine.executor.driver.model
    assert model.ops.llama_layer_stack is not None or model.ops.name != "cpu"
    assert model.layer_stack is None


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_speculative_decoding_with_a_draft_of_the_same_family(family: str, family_dirs: dict[str, str],
                                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    """A draft model of the family (here the target itself) proposes 2 tokens a step: greedy output stays
    transformers'."""
    model_dir = family_dir(family, family_dirs, tmp_path_factory)
    prompts = mixed_prompts(400, count=3, seed=9)
    llm = LLM(model=model_dir, dtype="float32", max_model_len=128,
              speculative_config={"method": "draft_model", "model": model_dir, "num_speculative_tokens": 2})
    assert kvloom_greedy(llm, prompts, MAX_TOKENS) == hf_greedy(model_dir, prompts, MAX_TOKENS)


def test_qwen2_sliding_window_from_max_window_layers_equals_transformers(tmp_path) -> None:
    """use_sliding_window with max_window_layers=1: layer 0 global, layer 1 within 8 positions."""
    from tiny_models import build_tiny_family_checkpoint

    model_dir = build_tiny_family_checkpoint(str(tmp_path / "qwen2-sw"), "qwen2", use_sliding_window=True,
                                             sliding_window=8, max_window_layers=1)
    prompts = mixed_prompts(400, count=4, seed=2)
    llm = LLM(model=model_dir, dtype="float32", max_model_len=128)
    assert llm.llm_engine.executor.driver.model.config.layer_sliding_windows == [None, 8]
    assert kvloom_greedy(llm, prompts, MAX_TOKENS) == hf_greedy(model_dir, prompts, MAX_TOKENS)

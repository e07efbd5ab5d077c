"""kv_cache_dtype="int8": keys and values stored as int8 codes with an fp16 scale per token and head.

The kernels against the reference op by op are in tests/unit/test_cpu_attention.py; here the engine: twice
the tokens in the same memory, the C++ path equal to the reference path, close to the model-dtype cache, and
prefix caching over int8 blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from e2e.test_correctness import kvloom_greedy, mixed_prompts
from kvloom import LLM, SamplingParams
from kvloom.ops import cpu


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[list[float]]:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[next(iter(lp.values())).logprob for lp in o.prompt_logprobs[1:]] for o in outputs]


@pytest.fixture(scope="module")
def kernels() -> None:
    if not cpu.cpu_kernel_available():
        pytest.skip("the CPU kernels could not be built here")


def test_int8_kv_holds_twice_the_tokens_and_stays_close(kernels: None, tiny_llama_dir: str) -> None:
    prompts = mixed_prompts(400, count=6, seed=11)
    auto = LLM(model=tiny_llama_dir, dtype="bfloat16", max_model_len=128, kv_cache_memory="2MiB")
    int8 = LLM(model=tiny_llama_dir, dtype="bfloat16", max_model_len=128, kv_cache_memory="2MiB",
               kv_cache_dtype="int8")
    blocks = [llm.llm_engine.kv_cache_manager.num_blocks - 1 for llm in (auto, int8)]
    # A row of head_dim D takes D + 2 bytes against bf16's 2 D: 1.78x the tokens at this model's D = 16, 1.94x at
    # SmolLM2's 64.
    head_dim = auto.llm_engine.model_config.head_dim
    assert abs(blocks[1] / blocks[0] - 2 * head_dim / (head_dim + 2)) < 0.01, blocks
    assert all(c.dtype.is_floating_point is False for c in int8.llm_engine.executor.driver.kv_caches[0])
    # Against the fp32 cache (the same model in fp32 with int8 keys and values), on random weights: each logprob
    # moves by a few hundredths at most (SmolLM2's perplexity with int8 KV: docs/quantization.md).
    fp32 = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128)
    fp32_int8 = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128, kv_cache_dtype="int8")
    diffs = np.concatenate([np.abs(np.subtract(a, b)) for a, b in zip(prompt_logprobs(fp32_int8, prompts),
                                                                        prompt_logprobs(fp32, prompts))])
    assert diffs.mean() < 0.02 and diffs.max() < 0.1, diffs


def test_int8_kv_fast_path_equals_the_reference_path(kernels: None, tiny_llama_dir: str) -> None:
    """The C++ attention over int8 KV against the plain-torch one. The two paths' projections agree to fp32 rounding
    (with the model-dtype cache their logprobs are 5e-6 apart), and such a difference can move a value across a
    rounding boundary of its int8 code: so the caches they write must hold the same codes but a handful one apart,
    and scales within fp16 rounding; most logprobs agree to fp32 rounding, the rest within what a code one step off
    moves them (a kernel reading the cache wrong misses all of these by far)."""
    prompts = mixed_prompts(400, count=6, seed=12)
    results, caches = [], []
    for backend in ("auto", "reference"):
        llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128, kv_cache_dtype="int8",
                  override_backend_config={"attention_backend": backend})
        results.append((prompt_logprobs(llm, prompts), kvloom_greedy(llm, prompts, 8)))
        caches.append([t.clone() for layer in llm.llm_engine.executor.driver.kv_caches for t in layer])
    head_dim = llm.llm_engine.model_config.head_dim
    written = 0
    for a, b in zip(*caches):  # [blocks, block_size, kv heads, head_dim codes + an fp16 scale's 2 bytes]
        codes_a, codes_b = a[..., :head_dim].int(), b[..., :head_dim].int()
        written += int((codes_a != 0).sum())
        apart = codes_a != codes_b
        assert int(apart.sum()) <= max(8, written // 10_000) and (codes_a - codes_b).abs().max() <= 1
        scales_a = a[..., head_dim:].contiguous().view(torch.float16).float()
        scales_b = b[..., head_dim:].contiguous().view(torch.float16).float()
        torch.testing.assert_close(scales_a, scales_b, rtol=1e-3, atol=0)
    assert written > 10_000  # the prompts did fill the caches
    diffs = np.concatenate([np.abs(np.subtract(a, b)) for a, b in zip(results[0][0], results[1][0])])
    assert np.median(diffs) < 1e-5 and diffs.max() < 5e-3, diffs
    assert results[0][1] == results[1][1]


def test_int8_kv_prefix_cache_reuses_blocks(kernels: None, tiny_llama_dir: str) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128, kv_cache_dtype="int8",
              enable_prefix_caching=True)
    prompt = mixed_prompts(400, count=1, seed=13)[0] * 3
    first = kvloom_greedy(llm, [prompt], 8)
    hits = llm.llm_engine.kv_cache_manager.prefix_hits
    assert kvloom_greedy(llm, [prompt], 8) == first
    assert llm.llm_engine.kv_cache_manager.prefix_hits > hits


def test_fp8_kv_holds_twice_the_tokens_and_stays_close(tiny_llama_dir: str) -> None:
    """kv_cache_dtype="fp8" (e4m3) through the engine on the plain-torch reference attention (the CPU has no fp8
    kernels; on CUDA the Triton kernels read it: tests/unit/test_triton_attention.py, tests/gpu)."""
    prompts = mixed_prompts(400, count=6, seed=14)
    reference = {"attention_backend": "reference"}
    auto = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128, kv_cache_memory="2MiB",
               override_backend_config=reference)
    fp8 = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128, kv_cache_memory="2MiB",
              kv_cache_dtype="fp8", override_backend_config=reference)
    assert fp8.llm_engine.executor.driver.kv_caches[0][0].dtype == torch.float8_e4m3fn
    blocks = [llm.llm_engine.kv_cache_manager.num_blocks - 1 for llm in (auto, fp8)]
    assert abs(blocks[1] / blocks[0] - 4.0) < 0.01, blocks  # fp32's 4 bytes against fp8's 1
    diffs = np.concatenate([np.abs(np.subtract(a, b)) for a, b in zip(prompt_logprobs(fp8, prompts),
                                                                        prompt_logprobs(auto, prompts))])
    # e4m3 keeps 3 mantissa bits (int8 rows keep ~7): each logprob moves by a few hundredths on random weights
    # (SmolLM2's perplexity with an fp8 cache: docs/quantization.md).
    assert 0 < diffs.mean() < 0.1 and diffs.max() < 0.5, (diffs.mean(), diffs.max())


def test_kv_cache_dtypes_kvloom_lacks_are_refused(tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match="'auto', 'int8', 'fp8' or 'fp8_e4m3'"):
        LLM(model=tiny_llama_dir, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="'fp8'.*runs on CUDA.*'int8'"):
        LLM(model=tiny_llama_dir, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' needs the 'auto', 'cpu', 'triton' or 'reference'"):
        LLM(model=tiny_llama_dir, kv_cache_dtype="int8", override_backend_config={"attention_backend": "native"})

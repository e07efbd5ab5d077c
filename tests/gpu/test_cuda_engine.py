"""The engine on CUDA (skipped without a GPU): the Triton ops, CUDA graphs and shape buckets against
transformers and against the eager path. Run on a GPU machine: ``pytest -m gpu tests``."""

from __future__ import annotations

import pytest
import torch
from e2e.test_correctness import hf_greedy, kvloom_greedy, mixed_prompts

from kvloom import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MAX_TOKENS = 24


def _llm(model_dir: str, **kwargs) -> LLM:
    kwargs.setdefault("dtype", "float32")
    return LLM(model=model_dir, device="cuda", max_model_len=256, kv_cache_memory="64MiB", **kwargs)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama3_dir", "tiny_mistral_dir"])
def test_cuda_greedy_equals_transformers_in_fp32(fixture: str, request: pytest.FixtureRequest) -> None:
    """Graphs on (the default): decodes replay captured graphs, prefills run the Triton kernels eagerly."""
    model_dir = request.getfixturevalue(fixture)
    prompts = mixed_prompts(400)
    llm = _llm(model_dir)
    assert llm.llm_engine.executor.driver.ops.name == "triton"
    assert llm.llm_engine.executor.driver.graphs is not None
    assert kvloom_greedy(llm, prompts, MAX_TOKENS) == hf_greedy(model_dir, prompts, MAX_TOKENS)


def test_graph_replay_equals_eager_and_buckets_keep_tokens(tiny_llama_dir: str) -> None:
    """Odd batch sizes pad to buckets; prefill padded to context buckets; chunked prefill; all agree."""
    prompts = mixed_prompts(400, count=13, seed=3)
    eager = kvloom_greedy(_llm(tiny_llama_dir, enforce_eager=True), prompts, MAX_TOKENS)
    graphs = _llm(tiny_llama_dir, override_backend_config={"token_gen_buckets": [1, 4, 16],
                                                          "context_length_buckets": [64, 256, 1024]})
    assert graphs.llm_engine.executor.driver.graphs.buckets == [1, 4, 16]
    assert kvloom_greedy(graphs, prompts, MAX_TOKENS) == eager
    chunked = _llm(tiny_llama_dir, max_num_batched_tokens=32)
    assert kvloom_greedy(chunked, prompts, MAX_TOKENS) == eager
    # One at a time: every decode runs the bucket-1 graph.
    assert [kvloom_greedy(graphs, [p], MAX_TOKENS)[0] for p in prompts[:3]] == eager[:3]


def test_cuda_bf16_triton_matches_native_ops(tiny_llama_dir: str) -> None:
    """bf16: the Triton ops and torch's native ones agree on most greedy tokens (bf16 near-ties may part)."""
    prompts = mixed_prompts(400, count=8, seed=4)
    native = kvloom_greedy(_llm(tiny_llama_dir, dtype="bfloat16", enforce_eager=True,
                                override_backend_config={"attention_backend": "native",
                                                         "enable_bucketing": False}), prompts, 8)
    triton = kvloom_greedy(_llm(tiny_llama_dir, dtype="bfloat16"), prompts, 8)
    same_first = sum(a[0] == b[0] for a, b in zip(native, triton))
    assert same_first >= 7, (native, triton)


def test_cuda_sampling_seeded_reproducible(tiny_llama_dir: str) -> None:
    llm = _llm(tiny_llama_dir)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=16, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3, params, use_tqdm=False)
    second = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert first[0].outputs[0].token_ids == second[0].outputs[0].token_ids

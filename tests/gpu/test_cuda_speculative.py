"""Speculative decoding on CUDA (skipped without a GPU): with n-gram lookup, a draft model and EAGLE heads,
greedy output equals the plain CUDA engine's, and the target as its own draft has every guess accepted.
Run on a GPU machine: ``pytest -m gpu tests``."""

from __future__ import annotations

import pytest
import torch
from e2e.test_speculative_models import EAGLE_HEADS, greedy_params, run, varied_prompts

from kvloom import LLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _llm(model_dir: str, **kwargs) -> LLM:
    kwargs.setdefault("dtype", "float32")
    return LLM(model=model_dir, device="cuda", max_model_len=256, kv_cache_memory="64MiB", **kwargs)


@pytest.fixture(scope="module")
def plain_cuda(tiny_llama3_dir: str) -> list:
    prompts = varied_prompts()
    return run(_llm(tiny_llama3_dir), greedy_params(len(prompts)), prompts)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3"])
def test_cuda_greedy_with_speculation_equals_plain_greedy(tiny_llama3_dir: str, tiny_mistral_dir: str,
                                                         plain_cuda: list, method: str, tmp_path) -> None:
    import tiny_models

    config: dict = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        config.update(prompt_lookup_max=3, prompt_lookup_min=1)
    elif method == "draft_model":
        config["model"] = tiny_mistral_dir
    else:
        config["model"] = tiny_models.build_tiny_eagle(str(tmp_path / method), tiny_llama3_dir,
                                                       **EAGLE_HEADS[method])
    prompts = varied_prompts()
    llm = _llm(tiny_llama3_dir, speculative_config=config)
    for _ in range(2):  # the second time with prefix-cache hits
        assert run(llm, greedy_params(len(prompts)), prompts) == plain_cuda
    assert llm.llm_engine.scheduler.stats().num_draft_tokens > 0


def test_cuda_target_as_its_own_draft_has_every_guess_accepted(tiny_llama3_dir: str, plain_cuda: list) -> None:
    prompts = varied_prompts()
    llm = _llm(tiny_llama3_dir, speculative_config={"method": "draft_model", "model": tiny_llama3_dir,
                                                    "num_speculative_tokens": 4})
    llm.llm_engine.executor.driver.speculator.policy.adaptive = False  # k = 4 at every step
    assert run(llm, greedy_params(len(prompts)), prompts) == plain_cuda
    stats = llm.llm_engine.scheduler.stats()
    assert stats.num_draft_tokens > 50 and stats.num_accepted_tokens == stats.num_draft_tokens, stats


def test_cuda_verification_steps_replay_graphs(tiny_llama3_dir: str, plain_cuda: list) -> None:
    """At batch 1 every verification step has the same shape (a token and k drafts): it replays the graph
    captured for (bucket 1, k + 1 tokens), and the tokens stay the plain engine's."""
    prompts = varied_prompts()
    llm = _llm(tiny_llama3_dir, max_num_seqs=1, speculative_config={
        "method": "draft_model", "model": tiny_llama3_dir, "num_speculative_tokens": 4})
    driver = llm.llm_engine.executor.driver
    driver.speculator.policy.adaptive = False
    assert run(llm, greedy_params(len(prompts)), prompts) == plain_cuda
    assert (1, 5) in driver.graphs.captured, sorted(driver.graphs.captured)

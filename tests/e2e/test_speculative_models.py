"""Speculative decoding with a second model (a draft model, EAGLE heads): greedy outputs equal the plain
engine's under every batching mode, a draft that is the target itself has every guess accepted (so its KV
cache stays in step through chunked prefill, prefix-cache hits and preemption), and bad configs are refused."""

from __future__ import annotations

import pytest

from kvloom import LLM, SamplingParams


def varied_prompts(count: int = 10) -> list[list[int]]:
    """Prompts that share a 24-token head in pairs (prefix-cache hits), of many lengths."""
    head = [7 + (j * 11) % 290 for j in range(24)]
    return [(head if i % 2 else [])[:24] + [5 + (i * 13 + j * 7) % 300 for j in range(6 + 3 * i)]
            for i in range(count)]


def greedy_params(count: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=6 + 4 * (i % 5), ignore_eos=True) for i in range(count)]


def run(llm: LLM, params: SamplingParams | list[SamplingParams], prompts: list[list[int]]) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama3_dir: str) -> dict[str, list]:
    """The target alone (greedy), per engine setting; computed once each."""
    return {}


def plain(tiny_llama3_dir: str, cache: dict[str, list], engine_args: dict, prompts: list[list[int]]) -> list:
    key = repr(sorted(engine_args.items()))
    if key not in cache:
        cache[key] = run(LLM(model=tiny_llama3_dir, max_model_len=256, **engine_args),
                         greedy_params(len(prompts)), prompts)
    return cache[key]


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 20},  # chunked prefill, and drafts cut to the budget
    {"kv_cache_memory": 60 * 2048, "block_size": 4},  # preemption (a block holds target and draft KV)
])
def test_greedy_with_a_draft_model_equals_plain_greedy(tiny_llama3_dir: str, tiny_mistral_dir: str,
                                                      plain_outputs: dict, engine_args: dict) -> None:
    """A different model (a Mistral) drafts for the Llama target: few guesses hold, the output is the same."""
    prompts = varied_prompts()
    expected = plain(tiny_llama3_dir, plain_outputs, engine_args, prompts)
    llm = LLM(model=tiny_llama3_dir, max_model_len=256, speculative_model=tiny_mistral_dir, num_speculative_tokens=3,
              **engine_args)
    assert run(llm, greedy_params(len(prompts)), prompts) == expected
    assert run(llm, greedy_params(len(prompts)), prompts) == expected  # again: prefix-cache hits
    stats = llm.llm_engine.scheduler.stats()
    assert stats.num_draft_tokens > 0, stats
    if "kv_cache_memory" in engine_args:
        assert stats.num_preemptions > 0
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks


@pytest.mark.parametrize("engine_args", [
    {"max_num_batched_tokens": 20, "block_size": 4},  # chunked prefill
    {"kv_cache_memory": 60 * 2048, "block_size": 4},  # preemption
])
def test_the_target_as_its_own_draft_has_every_guess_accepted(tiny_llama3_dir: str, plain_outputs: dict,
                                                              engine_args: dict) -> None:
    """The draft's KV cache is the target's, token for token: through chunked prefill, prefix-cache hits
    (the second run) and preemption no guess is ever rejected."""
    prompts = varied_prompts()
    expected = plain(tiny_llama3_dir, plain_outputs, engine_args, prompts)
    llm = LLM(model=tiny_llama3_dir, max_model_len=256, speculative_config={
        "method": "draft_model", "model": tiny_llama3_dir, "num_speculative_tokens": 4}, **engine_args)
    for _ in range(2):
        assert run(llm, greedy_params(len(prompts)), prompts) == expected
    stats = llm.llm_engine.scheduler.stats()
    assert stats.prefix_cache_hits > 0
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens == stats.num_draft_tokens, stats


def test_draft_model_in_mixed_batches(tiny_llama3_dir: str, tiny_mistral_dir: str) -> None:
    """n > 1, logprobs (not speculated), seeded sampling and greedy requests share batches; greedy and logprob
    requests match the plain engine, seeded sampled ones are reproducible whatever shares the batch."""
    prompts = varied_prompts(6)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, n=2),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True)] * 2
    expected = run(LLM(model=tiny_llama3_dir, max_model_len=256), params, prompts)
    llm = LLM(model=tiny_llama3_dir, max_model_len=256, speculative_config={"model": tiny_mistral_dir,
                                                                          "num_speculative_tokens": 2})
    assert llm.llm_engine.config.speculative.method == "draft_model"  # vLLM's shorthand: a model, no method
    got = run(llm, params, prompts)
    for i in (0, 1, 3, 4):
        assert got[i] == expected[i]
    assert run(llm, params[2], prompts[2:3]) == got[2:3]
    assert llm.llm_engine.scheduler.stats().num_draft_tokens > 0


def test_no_drafts_past_speculative_max_model_len(tiny_llama3_dir: str) -> None:
    prompts = [p for p in varied_prompts() if len(p) > 20][:3]
    expected = run(LLM(model=tiny_llama3_dir, max_model_len=256), greedy_params(3), prompts)
    llm = LLM(model=tiny_llama3_dir, max_model_len=256, speculative_model=tiny_llama3_dir, num_speculative_tokens=2,
              speculative_max_model_len=20)
    assert run(llm, greedy_params(3), prompts) == expected
    assert llm.llm_engine.scheduler.stats().num_draft_tokens == 0


@pytest.mark.parametrize("spec, message", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 2}, "ngram' only"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "takes no 'model'"),
    ({"model": "x", "num_speculative_tokens": 2, "max_model_len": 0}, "max_model_len"),
    ({"model": "x", "num_speculative_tokens": 0}, "num_speculative_tokens"),
])
def test_bad_draft_model_configs_are_value_errors(spec: dict, message: str) -> None:
    from kvloom.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=spec)


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama3_dir: str, tmp_path) -> None:
    import tiny_models

    draft = tiny_models.build_tiny_checkpoint(str(tmp_path / "draft"), arch="llama", vocab_size=512)
    with pytest.raises(ValueError, match=r"vocabulary of 512 tokens, the target model 4\d\d"):
        LLM(model=tiny_llama3_dir, max_model_len=256, speculative_model=draft, num_speculative_tokens=2)

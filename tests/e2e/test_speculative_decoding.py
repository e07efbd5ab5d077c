"""Speculative decoding with n-gram prompt lookup: greedy outputs equal the plain engine's under every
batching mode (drafts accepted or not), sampled outputs stay reproducible, and bad configs are refused."""

from __future__ import annotations

import pytest

from kvloom import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def repetitive_prompts(count: int = 12) -> list[list[int]]:
    """Prompts that repeat themselves, so lookup finds drafts (tiny random models also loop)."""
    prompts = []
    for i in range(count):
        motif = [5 + (i * 7 + j * 3) % 300 for j in range(3 + i % 4)]
        prompts.append((motif * 6)[: 10 + 3 * i])
    return prompts


def run(llm: LLM, params: SamplingParams | list[SamplingParams], prompts: list[list[int]]) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 24},  # chunked prefill, and drafts cut to the budget
    {"kv_cache_memory": 80 * 1024, "block_size": 4},  # preemption
    {"enable_prefix_caching": False, "block_size": 1},
])
def test_greedy_with_ngram_speculation_equals_plain_greedy(tiny_llama_dir: str, engine_args: dict) -> None:
    prompts = repetitive_prompts()
    greedy = [SamplingParams(temperature=0, max_tokens=8 + 5 * (i % 5), ignore_eos=True,
                             stop=["zq"] if i % 3 == 0 else None) for i in range(len(prompts))]
    plain = run(LLM(model=tiny_llama_dir, max_model_len=256, **engine_args), greedy, prompts)
    llm = LLM(model=tiny_llama_dir, max_model_len=256, speculative_config=NGRAM, **engine_args)
    assert run(llm, greedy, prompts) == plain
    stats = llm.llm_engine.scheduler.stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats
    if "kv_cache_memory" in engine_args:
        assert stats.num_preemptions > 0  # the small cache did preempt speculating requests
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_speculation_with_n_and_mixed_batches(tiny_llama_dir: str) -> None:
    """n > 1, and requests with logprobs (not speculated) beside speculated ones, in one batch."""
    prompts = repetitive_prompts(6)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)] * 3
    plain = LLM(model=tiny_llama_dir, max_model_len=256).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    spec = LLM(model=tiny_llama_dir, max_model_len=256, speculative_model="[ngram]", num_speculative_tokens=4
               ).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(plain, spec):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert [c.logprobs is None for c in a.outputs] == [c.logprobs is None for c in b.outputs]
        if a.outputs[0].logprobs is not None:
            assert [sorted(d) for d in a.outputs[0].logprobs] == [sorted(d) for d in b.outputs[0].logprobs]


def test_seeded_sampled_speculation_is_reproducible_whatever_shares_the_batch(tiny_llama_dir: str) -> None:
    prompts = repetitive_prompts(8)
    params = SamplingParams(temperature=0.8, top_k=3, seed=11, max_tokens=24, ignore_eos=True)
    llm = LLM(model=tiny_llama_dir, max_model_len=256, speculative_config=NGRAM)
    first = run(llm, params, prompts)
    assert run(llm, params, prompts) == first  # seeded: the same tokens again
    assert run(llm, params, prompts[3:5]) == first[3:5]  # whatever shares the batch
    assert all(len(c[0]) == 24 for row in first for c in row)
    assert llm.llm_engine.scheduler.stats().num_accepted_tokens > 0


@pytest.mark.parametrize("kwargs, message", [
    ({"speculative_config": {"method": "medusa", "num_speculative_tokens": 2}}, "not supported yet"),
    ({"speculative_config": {"method": "lookahead"}}, "method must be one of"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}}, "num_speculative_tokens"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "k": 3}}, "unknown key"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                             "prompt_lookup_max": 2}}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 3}, "needs a speculative method"),
    ({"speculative_config": "{not json"}, "JSON object"),
])
def test_bad_speculative_configs_are_value_errors(kwargs: dict, message: str) -> None:
    from kvloom.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_a_speculated_request_with_nan_logits_fails_and_emits_nothing(tiny_llama_dir: str) -> None:
    engine = LLM(model=tiny_llama_dir, max_model_len=256, speculative_config=NGRAM).llm_engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(repetitive_prompts(4)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    for _ in range(50):
        scheduler_output = engine.scheduler.schedule()
        if any(item.num_draft_tokens for item in scheduler_output.scheduled):
            break
        engine._update(scheduler_output, engine.executor.execute(scheduler_output),
                       [engine.scheduler.requests[s.request_id] for s in scheduler_output.scheduled])
    else:
        pytest.fail("no step had drafts")
    speculated = [item.request_id for item in scheduler_output.scheduled if item.num_draft_tokens]
    runner = engine.executor.driver
    compute_logits = runner.model.compute_logits
    runner.model.compute_logits = lambda hidden: compute_logits(hidden) * float("nan")
    output = engine.executor.execute(scheduler_output)
    runner.model.compute_logits = compute_logits
    assert sorted(speculated) == sorted(set(output.failed_request_ids) & set(speculated))
    assert not any(request_id in output.sampled_token_ids for request_id in speculated)


def test_served_with_speculation_streams_the_same_text_and_counts_acceptance(tiny_llama_dir: str,
                                                                             server_factory) -> None:
    """--speculative-config on the server: streamed deltas (several tokens a step) join into the text the
    plain engine gives, and /metrics counts drafts and accepted tokens."""
    import json

    import httpx

    prompt = repetitive_prompts(3)[2]
    expected = run(LLM(model=tiny_llama_dir, max_model_len=256),
                   SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), [prompt])[0][0]
    with server_factory(tiny_llama_dir, "--max-model-len", "256", "--speculative-config", json.dumps(NGRAM)) as server:
        body = {"model": server.model, "prompt": prompt, "max_tokens": 30, "temperature": 0, "stream": True,
                "ignore_eos": True}
        events = [line[6:] for line in httpx.post(server.url + "/v1/completions", json=body, timeout=60).text
                  .splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
        text = "".join(json.loads(event)["choices"][0]["text"] for event in events)
        assert text == expected[1]
        metrics = server.metrics()
        assert metrics["kvloom:spec_decode_num_draft_tokens_total"] > 0
        assert 0 < metrics["kvloom:spec_decode_num_accepted_tokens_total"] <= (
            metrics["kvloom:spec_decode_num_draft_tokens_total"])

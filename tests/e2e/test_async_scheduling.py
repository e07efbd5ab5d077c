"""Async scheduling (``async_scheduling=True``): step N+1 is scheduled and launched before step N's tokens are read
back, its placeholder tokens taken from step N's output on the device. Whatever the requests ask, the tokens,
texts and finish reasons equal the synchronous engine's. On the CPU the device work is synchronous, so these
check the bookkeeping (placeholders, pending tokens, wasted steps after a stop, releases); tests/gpu runs it on
CUDA, where it overlaps."""

from __future__ import annotations

import logging

import pytest

from kvloom import LLM, SamplingParams
from kvloom.engine.request import Request
from kvloom.engine.scheduler import Scheduler
from kvloom.sampling_params import StructuredOutputsParams
from kvloom.step_io import PLACEHOLDER_TOKEN_ID

from .test_correctness import mixed_prompts


def _llm(model_dir: str, **kwargs) -> LLM:
    kwargs = {"dtype": "float32", "max_model_len": 256, **kwargs}
    return LLM(model=model_dir, **kwargs)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


def _both(model_dir: str, prompts: list[list[int]], params, **kwargs) -> tuple[list, list, LLM]:
    plain = _run(_llm(model_dir, **kwargs), prompts, params)
    llm = _llm(model_dir, async_scheduling=True, **kwargs)
    assert llm.llm_engine.async_scheduling
    return plain, _run(llm, prompts, params), llm


def test_greedy_equals_the_synchronous_engine(tiny_llama_dir: str) -> None:
    """Prompts of 3..60 tokens, each with its own max_tokens, chunked prefill beside decodes."""
    prompts = mixed_prompts(400, count=12, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=1 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    plain, ahead, llm = _both(tiny_llama_dir, prompts, params, max_num_batched_tokens=64)
    assert ahead == plain
    assert [len(o[0][0]) for o in ahead] == [1 + 3 * i for i in range(len(prompts))]
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.executor.driver.requests
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_usable_blocks


def test_stops_mid_flight_drop_the_wasted_token(tiny_llama_dir: str) -> None:
    """A stop token or stop string ends a request while its next step already runs: that step's token is
    dropped and the output ends where the synchronous engine's does."""
    prompts = mixed_prompts(400, count=6, seed=5)
    free = _run(_llm(tiny_llama_dir), prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    params = []
    for output in free:
        tokens, text = output[0][0], output[0][1]
        params.append(SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[tokens[9]])
                      if len(params) % 2 else SamplingParams(temperature=0, max_tokens=24, stop=[text[6:9]]))
    plain, ahead, _ = _both(tiny_llama_dir, prompts, params)
    assert ahead == plain
    assert {o[0][2] for o in ahead} == {"stop"}


def test_seeded_sampling_logprobs_and_n(tiny_llama_dir: str) -> None:
    prompts = mixed_prompts(400, count=5, seed=7)
    params = SamplingParams(n=2, temperature=0.9, top_p=0.9, top_k=40, seed=11, max_tokens=12, logprobs=2,
                            ignore_eos=True)
    plain, ahead, _ = _both(tiny_llama_dir, prompts, params)
    assert ahead == plain
    llm = _llm(tiny_llama_dir, async_scheduling=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0]
    assert first.outputs[0].logprobs is not None and len(first.outputs[0].logprobs) == 12


def test_requests_that_need_their_last_token_wait_for_it(tiny_llama_dir: str) -> None:
    """Penalties, bad words, min_tokens and a grammar read the tokens so far: such requests sit out a step
    rather than run ahead, beside plain ones that do; every output is still the synchronous engine's."""
    prompts = mixed_prompts(400, count=6, seed=9)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, presence_penalty=0.4,
                             ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, min_tokens=8),
              SamplingParams(temperature=0, max_tokens=16, bad_words=["a"], ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, logit_bias={7: 2.0}, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(regex="[ab]{3,9}"))]
    plain, ahead, _ = _both(tiny_llama_dir, prompts, params)
    assert ahead == plain


def test_preemption_and_prefix_cache_hits(tiny_llama_dir: str) -> None:
    """A cache too small for the batch preempts requests (some while their last step runs); the second pass
    finds the prompts in the prefix cache."""
    prompts = mixed_prompts(400, count=10, seed=13)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain, ahead, llm = _both(tiny_llama_dir, prompts, params, kv_cache_memory="96KiB", block_size=8)
    assert ahead == plain
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert _run(llm, prompts, params) == plain


def test_an_abort_mid_flight_leaves_the_others_whole(tiny_llama_dir: str) -> None:
    prompts = mixed_prompts(400, count=4, seed=15)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = _run(_llm(tiny_llama_dir), prompts, params)
    engine = _llm(tiny_llama_dir, async_scheduling=True).llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    finished = {}
    for step in range(200):
        outputs = engine.step()
        if step == 5:
            outputs += engine.abort_request("1")  # a step is in flight now
        for output in outputs:
            if output.finished:
                finished[output.request_id] = output
        if not engine.has_unfinished_requests():
            break
    assert finished["1"].outputs[0].finish_reason == "abort"
    for i in (0, 2, 3):
        assert finished[str(i)].outputs[0].token_ids == expected[i][0][0]
    assert not engine.executor.driver.requests


def test_the_scheduler_runs_ahead_with_a_placeholder_but_never_past_max_tokens() -> None:
    from kvloom.engine.kv_cache_manager import KVCacheManager

    scheduler = Scheduler(KVCacheManager(64, 4, False), max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=64, async_scheduling=True)
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=2)))
    first = scheduler.schedule()
    assert first.scheduled[0].token_ids == [1, 2, 3] and first.scheduled[0].samples
    second = scheduler.schedule()  # step one still "runs": its token is pending
    assert second.scheduled[0].token_ids == [PLACEHOLDER_TOKEN_ID] and second.scheduled[0].num_computed_tokens == 3
    assert scheduler.schedule().is_empty  # two tokens pending = max_tokens: nothing more to run ahead
    from kvloom.step_io import ModelRunnerOutput

    scheduler.update_from_output(first, ModelRunnerOutput(sampled_token_ids={"a": [7]}))
    finished = scheduler.update_from_output(second, ModelRunnerOutput(sampled_token_ids={"a": [8]}))
    assert [r.request_id for r in finished] == ["a"] and finished[0].output_token_ids == [7, 8]


def test_speculative_decoding_turns_it_off(tiny_llama_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvloom"):
        llm = _llm(tiny_llama_dir, async_scheduling=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})
    assert not llm.llm_engine.async_scheduling and "async_scheduling is off" in caplog.text


def test_a_request_that_needs_its_token_never_sits_a_step_out(tiny_llama_dir: str) -> None:
    """Beside a plain request, one with a penalty finishes as many tokens in as many steps: a step in flight
    holding it is read back before the next is scheduled (that step runs synchronously) rather than leave it
    out of every other step."""
    engine = _llm(tiny_llama_dir, async_scheduling=True).llm_engine
    prompts = mixed_prompts(400, count=2, seed=17)
    engine.add_request("plain", {"prompt_token_ids": prompts[0]},
                       SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.add_request("penalty", {"prompt_token_ids": prompts[1]},
                       SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.2))
    finished_at = {}
    for step in range(100):
        for output in engine.step():
            if output.finished:
                finished_at[output.request_id] = step
        if not engine.has_unfinished_requests():
            break
    assert abs(finished_at["plain"] - finished_at["penalty"]) <= 1, finished_at

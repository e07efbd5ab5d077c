"""The overlapped step (CUDA's: the previous step's text work runs while the device computes) gives the
same outputs as the plain step. Forced on here on the CPU, where the step is synchronous."""

from __future__ import annotations

import pytest

from kvloom import LLM, SamplingParams


def _generate(llm: LLM, overlap: bool) -> list:
    llm.llm_engine.overlap_postprocess = overlap
    prompts = ["Hello there", "The quick brown fox", "a b c d e", "Once upon"]
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop=["e", "x"], ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=16, n=3, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, stop=["the "], include_stop_str_in_output=True,
                       prompt_logprobs=1, ignore_eos=True),
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.prompt_token_ids, [(c.text, c.token_ids, c.finish_reason, c.stop_reason,
                                   None if c.logprobs is None else [sorted(d) for d in c.logprobs])
                                  for c in o.outputs]) for o in outputs]


def test_overlapped_postprocess_gives_the_same_outputs(tiny_llama_dir: str) -> None:
    llm = LLM(model=tiny_llama_dir, max_model_len=256)
    plain = _generate(llm, overlap=False)
    overlapped = _generate(llm, overlap=True)
    assert overlapped == plain
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert not llm.llm_engine.executor.driver.requests  # every request's runner state was released


@pytest.mark.parametrize("abort_at", [1, 3])
def test_overlapped_postprocess_survives_an_abort(tiny_llama_dir: str, abort_at: int) -> None:
    llm = LLM(model=tiny_llama_dir, max_model_len=256)
    engine = llm.llm_engine
    engine.overlap_postprocess = True
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["zz"])
    for request_id in ("a", "b"):
        engine.add_request(request_id, {"prompt_token_ids": [5, 6, 7, 8]}, params)
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        steps += 1
        if steps == abort_at:
            for output in engine.abort_request("a"):
                finished[output.request_id] = output
    assert finished["a"].outputs[0].finish_reason == "abort"
    assert finished["b"].outputs[0].finish_reason == "length" and len(finished["b"].outputs[0].token_ids) == 12
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_usable_blocks
    assert not engine.executor.driver.requests

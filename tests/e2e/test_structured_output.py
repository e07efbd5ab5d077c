"""Structured outputs offline: LLM.generate / LLM.chat with SamplingParams(structured_outputs=...) on a tiny
random model. Whatever the random model prefers, the output must follow the constraint; the grammar must
follow each request through chunked prefill, preemption, prefix-cache hits and speculative decoding."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from kvloom import LLM, SamplingParams
from kvloom.sampling_params import StructuredOutputsParams

# Nested objects, arrays with bounds, enums, integer ranges, patterns, additionalProperties: false; every string
# bounded, so a random model cannot wander for ever.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 0, "maximum": 99999},
                                                     "ok": {"type": "boolean"}},
                    "required": ["zip", "ok"], "additionalProperties": False},
    },
    "required": ["name", "age", "code", "tags", "address"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a person as JSON:", "The quick brown fox", "def fibonacci(n):", "Once upon a time"]


def json_params(temperature: float, **kwargs: object) -> SamplingParams:
    # No free whitespace: a random model would otherwise spend its tokens on it.
    return SamplingParams(temperature=temperature, max_tokens=160, seed=7, **kwargs,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, max_num_seqs=8)


def texts(llm: LLM, prompts: list[str], params: SamplingParams | list[SamplingParams]) -> list[str]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output in outputs:
        assert all(c.finish_reason == "stop" for c in output.outputs), output
    return [c.text for output in outputs for c in output.outputs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llm: LLM, temperature: float) -> None:
    for text in texts(llm, PROMPTS, json_params(temperature)):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_choice_grammar_and_json_object_in_one_batch(llm: LLM) -> None:
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9] | [1-9] [0-9]'
    params = [
        SamplingParams(temperature=1.0, seed=1, max_tokens=40,
                       structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,5}-\d{3}")),
        SamplingParams(temperature=1.0, seed=2, max_tokens=40,
                       structured_outputs=StructuredOutputsParams(choice=["positive", "negative", "neutral"])),
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(grammar=grammar)),
        SamplingParams(temperature=1.0, seed=3, max_tokens=200,
                       structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True)),
    ]
    regex, choice, expression, obj = texts(llm, PROMPTS, params)
    assert re.fullmatch(r"[a-z]{2,5}-\d{3}", regex)
    assert choice in ("positive", "negative", "neutral")
    assert re.fullmatch(r"\((\d|[1-9]\d)(\+(\d|[1-9]\d))*\)", expression)
    assert isinstance(json.loads(obj), dict)


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(llm: LLM) -> None:
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS[:2], plain, use_tqdm=False)
    mixed = llm.generate(PROMPTS[:2] * 2, [plain, plain, json_params(0.0), json_params(0.0)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]


def test_n_completions_each_follow_the_grammar(llm: LLM) -> None:
    output = llm.generate(PROMPTS[0], json_params(1.0, n=3), use_tqdm=False)[0]
    assert len(output.outputs) == 3
    for completion in output.outputs:
        jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_chat_honours_structured_outputs(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Pick a colour"}]
    output = llm.chat(messages, SamplingParams(temperature=1.0, seed=5, max_tokens=20, structured_outputs=(
        StructuredOutputsParams(choice=["red", "green"]))), use_tqdm=False)[0]
    assert output.outputs[0].text in ("red", "green")


def test_a_constrained_request_out_of_tokens_ends_with_length(llm: LLM) -> None:
    output = llm.generate(PROMPTS[0], json_params(0.0, ignore_eos=False).clone(), use_tqdm=False)[0]
    assert output.outputs[0].finish_reason == "stop"
    short = SamplingParams(temperature=0, max_tokens=3, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    output = llm.generate(PROMPTS[0], short, use_tqdm=False)[0]
    assert output.outputs[0].finish_reason == "length" and len(output.outputs[0].token_ids) == 3


def test_bad_constraints_are_value_errors_and_the_engine_goes_on(llm: LLM) -> None:
    for params, message in [(StructuredOutputsParams(json={"type": "nope"}), "json is not valid"),
                            (StructuredOutputsParams(regex="(("), "regex is not valid"),
                            (StructuredOutputsParams(grammar="root ::= undefined_rule"), "grammar is not valid")]:
        with pytest.raises(ValueError, match=message):
            llm.generate(PROMPTS[0], SamplingParams(structured_outputs=params), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    jsonschema.validate(json.loads(texts(llm, PROMPTS[:1], json_params(0.0))[0]), SCHEMA)


@pytest.mark.parametrize("engine_args", [
    {"max_num_batched_tokens": 7},  # every prompt chunked: the matcher moves only on sampled tokens
    {"kv_cache_memory": 24 * 2 * 2 * 16 * 2 * 16 * 4, "max_num_seqs": 16},  # preempted and recomputed
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}},
], ids=["chunked_prefill", "preemption", "ngram_speculation"])
def test_the_grammar_follows_requests_through_batching(llm: LLM, tiny_llama_dir: str, engine_args: dict) -> None:
    prompts = PROMPTS * 2
    params = [json_params(0.0), json_params(0.0), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              json_params(0.0)] * 2
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    other = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, **engine_args)
    outputs = other.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if "kv_cache_memory" in engine_args:
        assert other.llm_engine.scheduler.num_preemptions > 0
    # Prefix-cache hits on the second run of the same prompts change nothing either.
    assert [o.outputs[0].token_ids for o in other.generate(prompts, params, use_tqdm=False)] == expected


def test_a_request_waits_for_its_grammar_without_stalling_others(llm: LLM) -> None:
    engine = llm.llm_engine
    manager = engine.structured_output
    backend = manager.backend
    compile_grammar = backend.compile
    release = threading.Event()

    def slow_compile(params: StructuredOutputsParams) -> object:
        release.wait(30)
        return compile_grammar(params)

    backend.compile = slow_compile
    try:
        slow = StructuredOutputsParams(regex=r"slow-[0-9]{2}")
        engine.add_request("constrained", PROMPTS[0], SamplingParams(temperature=0, max_tokens=20,
                                                                     structured_outputs=slow))
        engine.add_request("plain", PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        finished: dict[str, str] = {}
        while "plain" not in finished:
            finished.update({o.request_id: o.outputs[0].text for o in engine.step() if o.finished})
        assert "constrained" not in finished  # still compiling: the other request ran meanwhile
        release.set()
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o.outputs[0].text for o in engine.step() if o.finished})
        assert re.fullmatch(r"slow-[0-9]{2}", finished["constrained"])
    finally:
        backend.compile = compile_grammar
        release.set()


def test_a_grammar_compile_timeout_ends_only_its_request(tiny_llama_dir: str) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256,
              structured_outputs_config={"compile_timeout": 0.2})
    backend = llm.llm_engine.structured_output.backend
    compile_grammar = backend.compile
    backend.compile = lambda params: (time.sleep(1.0), compile_grammar(params))[1]
    try:
        params = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(regex=r"timeout-[a-z]"))
        with pytest.raises(ValueError, match="did not compile within 0.2 s"):
            llm.generate(PROMPTS[0], params, use_tqdm=False)
    finally:
        backend.compile = compile_grammar
    assert not llm.llm_engine.has_unfinished_requests()
    output = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 3

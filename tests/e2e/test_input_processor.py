"""The way in: every path tokenizes and validates a prompt once, into an EngineRequest that the
engine queues as it is, and a prompt too long for the context gets one message everywhere."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvloom import LLM, SamplingParams
from kvloom.config import EngineConfig
from kvloom.engine.async_engine import AsyncLLM
from kvloom.engine.input_processor import EngineRequest, InputProcessor
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.request import ContextLengthError
from kvloom.entrypoints.openai.api_server import build_app

MAX_MODEL_LEN = 128
CHAT = [{"role": "user", "content": "Hello there"}]


def count_calls(counts: Counter, obj: Any, name: str) -> None:
    """Count the calls of obj.name (an instance attribute wrapping the original)."""
    method: Callable = getattr(obj, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[name] += 1
        return method(*args, **kwargs)

    setattr(obj, name, counted)


def watch(engine: LLMEngine) -> Counter:
    """Counts of tokenizer.encode and of the scheduler's fit check (the last validation step)."""
    counts: Counter = Counter()
    count_calls(counts, engine.tokenizer, "encode")
    count_calls(counts, engine.input_processor, "check_fits")
    return counts


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(model=tiny_llama_dir, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def async_llm(tiny_llama_dir: str) -> AsyncLLM:
    engine = AsyncLLM.from_config(EngineConfig(model=tiny_llama_dir, max_model_len=MAX_MODEL_LEN), stats_interval=0)
    yield engine
    engine.shutdown()


def post(async_llm: AsyncLLM, path: str, body: dict[str, Any]) -> httpx.Response:
    """A request to the server's app, in process (no API key)."""
    args = argparse.Namespace(model="tiny", served_model_name=None, chat_template=None, api_key=None)
    app = build_app(async_llm, args)

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            return await http.post(path, json=body)

    return asyncio.run(run())


def test_llm_tokenizes_and_validates_each_prompt_once(llm: LLM) -> None:
    counts = watch(llm.llm_engine)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate(["The quick brown fox", "Once upon a time", {"prompt_token_ids": [5, 6]}], params,
                 use_tqdm=False)
    assert counts == {"encode": 2, "check_fits": 3}
    counts.clear()
    llm.chat(CHAT, params, use_tqdm=False)
    assert counts == {"encode": 1, "check_fits": 1}
    assert params.output_kind.name == "CUMULATIVE"  # the caller's params are left as they were


def test_async_llm_and_the_server_tokenize_and_validate_each_prompt_once(async_llm: AsyncLLM) -> None:
    counts = watch(async_llm.engine)

    async def generate() -> None:
        async for _ in async_llm.generate("The quick brown fox", SamplingParams(max_tokens=3), "once"):
            pass

    asyncio.run(generate())
    assert counts == {"encode": 1, "check_fits": 1}
    counts.clear()
    for stream in (False, True):
        response = post(async_llm, "/v1/completions", {"prompt": ["The quick brown fox", "Once upon a time"],
                                                       "max_tokens": 3, "stream": stream})
        assert response.status_code == 200
        response = post(async_llm, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "stream": stream})
        assert response.status_code == 200
    assert counts == {"encode": 6, "check_fits": 6}


def test_one_context_length_message_offline_and_served(llm: LLM, async_llm: AsyncLLM) -> None:
    prompt = [5] * (MAX_MODEL_LEN + 10)
    with pytest.raises(ContextLengthError) as info:
        llm.generate({"prompt_token_ids": prompt}, use_tqdm=False)
    offline = str(info.value)
    assert offline == (f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
                       f"{len(prompt) + 1} tokens ({len(prompt)} in the prompt, 1 in the completion). Please "
                       f"reduce the length of the prompt or completion.")
    response = post(async_llm, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] == offline
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"


def test_an_engine_request_is_queued_as_it_is(llm: LLM) -> None:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    request = engine.input_processor.process("as-is", "The quick brown fox", params)
    assert isinstance(request, EngineRequest) and request.prompt == "The quick brown fox"
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.prompt_token_ids = (1,)  # type: ignore[misc]
    counts = watch(engine)
    engine.add_request("as-is", request)
    with pytest.raises(ValueError, match="sampling_params"):
        engine.add_request("other", request, SamplingParams())
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert counts == {}
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 3


def test_bad_prompts_are_value_errors_before_anything_is_queued(llm: LLM) -> None:
    processor: InputProcessor = llm.llm_engine.input_processor
    for prompt, match in [("", "empty"), ([], "empty"), ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one"),
                          ({"prompt": "a", "multi_modal_data": {"image": 1}}, "multi_modal_data"),
                          ([1, True], r"\[0, "), (3.5, "a prompt must be"), ("bad \ud800", "Unicode")]:
        with pytest.raises(ValueError, match=match):
            processor.process("bad", prompt)
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        processor.process("bad", "hi", {"max_tokens": 3})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stop_token_ids"):
        processor.process("bad", "hi", SamplingParams(stop_token_ids=[10 ** 6]))
    assert not llm.llm_engine.has_unfinished_requests()

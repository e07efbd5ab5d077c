"""Chat Completions tool loops through the server, with the official ``openai`` client and LangChain, on a tiny
random model whose chat template (plain ChatML) has no tool section: histories with assistant tool calls
(content null, "" or absent, several calls a turn) and tool results render (as the Hermes text documented in
docs/serving.md), forced calls end when their list closes, and a list cut by max_tokens comes back as the complete
calls before the cut with finish_reason "length", whole and streamed."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from kvloom.loader.tokenizer import load_tokenizer
from kvloom.loader.weights import resolve_model

from .test_structured_output_server import TOOL_SERVER_ARGS

WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
NEWS = {"type": "function", "function": {"name": "get_news", "strict": True, "parameters": {
    "type": "object", "properties": {"topic": {"enum": ["sport", "art"]}}, "required": ["topic"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME, NEWS]
QUESTION = {"role": "user", "content": "Weather in Paris?"}
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, server_factory: Any) -> Any:
    with server_factory(tiny_llama_dir, *TOOL_SERVER_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls or []]


def test_two_turn_tool_loop_with_the_sdks_own_assistant_message(client: openai.OpenAI, model: str) -> None:
    first = client.chat.completions.create(model=model, messages=[QUESTION], tools=TOOLS, tool_choice=FORCE_WEATHER,
                                           max_tokens=40, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [name for name, _ in _calls(choice.message)] == ["get_weather"]
    call = choice.message.tool_calls[0]
    # The SDK's message object as it came back (content None), then the tool's result: the OpenAI loop.
    history = [QUESTION, choice.message, {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    second = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize("content", ["absent", None, "", [{"type": "text", "text": "Checking."}]])
def test_history_renders_as_the_documented_hermes_text(client: openai.OpenAI, model: str, tiny_llama_dir: str,
                                                       content: Any) -> None:
    """Several calls in one turn, two results (one as text parts): the prompt the server counts is the one written
    out by hand in the documented format (the tiny model's ChatML template has no tool section)."""
    calls = [{"id": "call_a", "type": "function", "function": {"name": "get_weather",
                                                                "arguments": '{"city": "Paris", "unit": "c"}'}},
             {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]
    assistant: dict[str, Any] = {"role": "assistant", "tool_calls": calls}
    if content != "absent":
        assistant["content"] = content
    history = [QUESTION, assistant, {"role": "tool", "tool_call_id": "call_a", "content": "18 C"},
               {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "09:30"}]}]
    response = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=2,
                                              temperature=0)
    said = "Checking.\n" if isinstance(content, list) else ""
    expected = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        f"<|im_start|>assistant\n{said}<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n09:30\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")
    tokenizer = load_tokenizer(resolve_model(tiny_llama_dir))
    assert response.usage.prompt_tokens == len(tokenizer.encode(expected, add_special_tokens=False))


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_gives_one_call_and_ends_at_the_list_close(client: openai.OpenAI, model: str,
                                                                            stream: bool) -> None:
    kwargs: dict[str, Any] = dict(model=model, messages=[QUESTION], tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=7)
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    # The closed list allows only EOS: the reply ends well before max_tokens.
    assert whole.usage.completion_tokens < 60
    if stream:
        assert _streamed(client, kwargs) == (_calls(choice.message), "tool_calls")


def _streamed(client: openai.OpenAI, kwargs: dict[str, Any]) -> tuple[list[tuple[str, dict[str, Any]]], str]:
    """The streamed calls, reassembled from their deltas, and the finish reason; content must stay empty."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or []:
                if delta.function.name:
                    names[delta.index] = delta.function.name
                arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
            finish = choice.finish_reason or finish
    return [(names[i], json.loads(arguments[i])) for i in sorted(names)], finish


def test_required_list_cut_by_max_tokens_returns_its_complete_calls(client: openai.OpenAI, model: str) -> None:
    """Greedy decoding makes the cut reply a prefix of the uncut one: its calls are the uncut reply's complete
    calls before the cut, never the raw array as content, whole and streamed."""
    kwargs: dict[str, Any] = dict(model=model, messages=[QUESTION], tools=TOOLS, tool_choice="required",
                                  temperature=0)
    full = client.chat.completions.create(**kwargs, max_tokens=120)
    full_calls = _calls(full.choices[0].message)
    assert len(full_calls) >= 2, "the tiny model's greedy reply should hold several calls"
    cuts = {}
    for max_tokens in sorted({full.usage.completion_tokens - 1, full.usage.completion_tokens // 2, 3}):
        cut = client.chat.completions.create(**kwargs, max_tokens=max_tokens)
        choice = cut.choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None
        calls = _calls(choice.message)
        assert calls == full_calls[:len(calls)]
        assert _streamed(client, {**kwargs, "max_tokens": max_tokens}) == (calls, "length")
        cuts[max_tokens] = len(calls)
    assert cuts[3] == 0 and cuts[full.usage.completion_tokens - 1] >= len(full_calls) - 1 >= 1


def test_langchain_bind_tools_then_a_tool_message(server: Any, model: str) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model=model, max_tokens=40, temperature=0,
                     max_retries=0)
    bound = llm.bind_tools([WEATHER], tool_choice="get_weather")
    messages: list[Any] = [HumanMessage("Weather in Paris?")]
    reply = bound.invoke(messages)
    assert [call["name"] for call in reply.tool_calls] == ["get_weather"]
    assert reply.tool_calls[0]["args"]["city"] in ("Paris", "Rome", "Oslo")
    messages += [reply, ToolMessage("18 C, sunny", tool_call_id=reply.tool_calls[0]["id"])]
    answer = llm.bind_tools([WEATHER]).invoke(messages)
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")

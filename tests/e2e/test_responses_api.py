"""The Responses API (``/v1/responses``) through the official ``openai`` client against a kvloom server on a tiny
random model. The oracle is the same server's Chat Completions answer to the conversation a Responses request
stands for (greedy, so the texts must be equal), and the client's own parsing of the response and its events."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response
from unit.test_responses_api import EVENT_TYPES

from .test_reasoning_server import END_BIAS, reasoning_model_dir  # noqa: F401 - the fixture
from .test_reasoning_server import TEMPLATE as REASONING_TEMPLATE
from .test_structured_output_server import SCHEMA, TOOL_SERVER_ARGS, template_file

WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                       "unit": {"enum": ["c", "f"]}},
                      "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": WEATHER_PARAMETERS, "strict": True}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                 "parameters": WEATHER_PARAMETERS, "strict": True}}


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, server_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with server_factory(tiny_llama_dir, *TOOL_SERVER_ARGS, "--chat-template", template_file(tmp_path_factory)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="key-a", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def chat_text(client: openai.OpenAI, model: str, messages: list[dict[str, Any]], **fields: Any) -> Any:
    return client.chat.completions.create(model=model, messages=messages, temperature=0, **fields).choices[0]


def test_text_equals_the_chat_answer(client: openai.OpenAI, model: str) -> None:
    response = client.responses.create(model=model, input="What is the weather in Paris?", temperature=0,
                                       max_output_tokens=12)
    choice = chat_text(client, model, [{"role": "user", "content": "What is the weather in Paris?"}],
                       max_completion_tokens=12)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == choice.message.content
    assert response.output[0].type == "message" and response.output[0].content[0].type == "output_text"
    assert response.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    usage = response.usage
    assert usage.output_tokens <= 12 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0


def test_instructions_and_items_render_as_the_chat_conversation(client: openai.OpenAI, model: str) -> None:
    response = client.responses.create(
        model=model, instructions="Be brief.", temperature=0, max_output_tokens=10, metadata={"k": "v"},
        input=[{"role": "developer", "content": "Answer in French."},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi"}]},
               {"role": "user", "content": "How are you?"}])
    choice = chat_text(client, model, [{"role": "system", "content": "Be brief."},
                                       {"role": "system", "content": "Answer in French."},
                                       {"role": "user", "content": "Hello"},
                                       {"role": "assistant", "content": "Hi"},
                                       {"role": "user", "content": "How are you?"}], max_completion_tokens=10)
    assert response.output_text == choice.message.content
    assert response.instructions == "Be brief." and response.metadata == {"k": "v"}


def test_max_output_tokens_cut_is_incomplete(client: openai.OpenAI, model: str) -> None:
    response = client.responses.create(model=model, input="Tell me a story", temperature=0, max_output_tokens=1)
    choice = chat_text(client, model, [{"role": "user", "content": "Tell me a story"}], max_completion_tokens=1)
    if choice.finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.output[0].status == "incomplete"
    else:
        assert response.status == "completed"


def test_forced_function_call_then_its_output(client: openai.OpenAI, model: str) -> None:
    user = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.responses.create(model=model, input=[user], tools=[WEATHER], tool_choice="required",
                                    temperature=0, max_output_tokens=120, parallel_tool_calls=False)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_PARAMETERS)
    assert first.status == "completed" and first.output_text == ""

    second = client.responses.create(
        model=model, tools=[WEATHER], tool_choice="none", temperature=0, max_output_tokens=10,
        input=[user, *[item.model_dump(exclude_none=True) for item in first.output],
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    choice = chat_text(client, model, [
        user, {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny, 21 C"}],
        tools=[CHAT_WEATHER], tool_choice="none", max_completion_tokens=10)
    assert second.output_text == choice.message.content
    assert [item.type for item in second.output] == ["message"]

    named = client.responses.create(model=model, input=[user], tools=[WEATHER], temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=120)
    assert [item.name for item in named.output if item.type == "function_call"] == ["get_weather"]


def test_json_schema_text_format_validates(client: openai.OpenAI, model: str) -> None:
    response = client.responses.create(
        model=model, input="A person, please", max_output_tokens=200,
        text={"format": {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)


def test_stream_events_and_final_response(client: openai.OpenAI, model: str) -> None:
    whole = client.responses.create(model=model, input="Hello there", temperature=0, max_output_tokens=12)
    with client.responses.stream(model=model, input="Hello there", temperature=0, max_output_tokens=12) as stream:
        events = list(stream)
        # get_final_response() is the response.completed one; an incomplete response ends the stream instead.
        final = stream.get_final_response() if whole.status == "completed" else events[-1].response
    kinds = [event.type for event in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == whole.output_text
    assert final.output_text == whole.output_text and final.id == events[0].response.id
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == final.output_text  # stored once the stream ended


def test_stream_function_call_events(client: openai.OpenAI, model: str) -> None:
    events = list(client.responses.create(model=model, input="Weather in Paris?", tools=[WEATHER],
                                          tool_choice="required", max_output_tokens=120, stream=True))
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    done = events[-3]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert done.arguments == arguments and done.name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)
    final = events[-1].response
    assert [(item.type, item.arguments) for item in final.output] == [("function_call", arguments)]


def test_previous_response_id_get_and_delete(client: openai.OpenAI, model: str, server: Any) -> None:
    first = client.responses.create(model=model, input="Hello", temperature=0, max_output_tokens=6)
    second = client.responses.create(model=model, input="And then?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=6)
    choice = chat_text(client, model, [{"role": "user", "content": "Hello"},
                                       {"role": "assistant", "content": first.output_text},
                                       {"role": "user", "content": "And then?"}], max_completion_tokens=6)
    assert second.output_text == choice.message.content and second.previous_response_id == first.id

    fetched = client.responses.retrieve(first.id)
    assert fetched.id == first.id and fetched.output_text == first.output_text

    other = openai.OpenAI(base_url=server.url + "/v1", api_key="key-b", max_retries=0)
    with pytest.raises(openai.NotFoundError):  # stored per API key
        other.responses.retrieve(first.id)

    reply = httpx.delete(server.url + f"/v1/responses/{first.id}", headers={"Authorization": "Bearer key-a"})
    assert reply.json() == {"id": first.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(first.id)
    assert info.value.body["message"].startswith("Response with id")
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=model, input="x", previous_response_id=first.id)
    assert info.value.body["param"] == "previous_response_id"

    unstored = client.responses.create(model=model, input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens"),  # past the context: the chat check's
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "nope"}}}},
     "text.format"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": []}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(server: Any, body: dict[str, Any], param: str) -> None:
    reply = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize("tools", [False, True])
def test_bodies_and_events_validate_against_the_openai_types(server: Any, tools: bool) -> None:
    body: dict[str, Any] = {"input": "Hi", "max_output_tokens": 120}
    if tools:
        body |= {"tools": [WEATHER], "tool_choice": "required"}
    reply = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    response = Response.model_validate(reply.json())
    assert response.output and response.output[-1].type == ("function_call" if tools else "message")
    assert Response.model_validate(httpx.get(server.url + f"/v1/responses/{response.id}", timeout=10).json()) == (
        response)

    with httpx.stream("POST", server.url + "/v1/responses", timeout=60, json=body | {"stream": True}) as reply:
        text = "".join(reply.iter_text())
    assert "[DONE]" not in text
    for block in filter(None, text.split("\n\n")):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name.removeprefix("event: ") == event["type"]
        EVENT_TYPES[event["type"]].model_validate(event)


@pytest.fixture(scope="module")
def reasoning_server(reasoning_model_dir: str, server_factory: Any,  # noqa: F811 - the imported fixture
                     tmp_path_factory: pytest.TempPathFactory) -> Any:
    template = template_file(tmp_path_factory, "{% set opens_think = true %}" + REASONING_TEMPLATE)
    with server_factory(reasoning_model_dir, "--max-model-len", "512", "--chat-template", template,
                        "--reasoning-parser", "qwen3") as s:
        yield s


def test_reasoning_items_whole_and_streamed(reasoning_server: Any) -> None:
    client = openai.OpenAI(base_url=reasoning_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    both = 0
    for seed in range(4):
        sampling = {"temperature": 0.8, "max_output_tokens": 24}
        extra = {"seed": seed, "logit_bias": END_BIAS}
        message = client.chat.completions.create(
            model=reasoning_server.model, messages=[{"role": "user", "content": "Why is the sky blue?"}],
            temperature=0.8, max_completion_tokens=24, **extra).choices[0].message
        response = client.responses.create(model=reasoning_server.model, input="Why is the sky blue?",
                                           extra_body=extra, **sampling)
        reasoning = [item for item in response.output if item.type == "reasoning"]
        assert [item.content[0].text for item in reasoning] == ([message.reasoning_content]
                                                                if message.reasoning_content else []), seed
        assert (response.output_text or None) == message.content, seed
        assert [item.type for item in response.output] == (["reasoning"] if message.reasoning_content else []) + (
            ["message"] if message.content else [])
        details = response.usage.output_tokens_details
        assert (details.reasoning_tokens > 0) == bool(message.reasoning_content)
        assert details.reasoning_tokens <= response.usage.output_tokens

        events = list(client.responses.create(model=reasoning_server.model, input="Why is the sky blue?",
                                              stream=True, extra_body=extra, **sampling))
        thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert (thought or None, text or None) == (message.reasoning_content, message.content), seed
        final = events[-1].response
        assert [item.type for item in final.output] == [item.type for item in response.output]
        assert final.usage.output_tokens_details.reasoning_tokens == details.reasoning_tokens
        both += bool(message.reasoning_content and message.content)
    assert both, "no seed gave both reasoning and text: the test would not tell them apart"

"""Structured outputs and tool calling through the server, with the official ``openai`` client, on a tiny
random model: whatever it prefers, JSON follows its schema, forced tool calls carry valid arguments,
streamed tool calls reassemble, and bad input is a 400 that leaves the server serving."""

from __future__ import annotations

import json
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                    "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "code", "tags", "address"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=120)
    colour: Literal["red", "green"]


# ChatML naming the tools in a line: the tiny model's context (512 tokens of a tokenizer trained on a few
# lines) cannot hold examples/tool_chat_template_hermes.jinja's instructions (that template is rendered in
# tests/unit/test_structured_output_tool_parsers.py).
TEMPLATE = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
            "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
            "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# A server a tiny random model's tool calls can finish on: the hermes parser, and JSON without free whitespace (a
# random model would otherwise spend its tokens on it). The Responses, Agents SDK and tool-loop tests share it.
TOOL_SERVER_ARGS = ("--max-model-len", "512", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                    "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}')


def template_file(tmp_path_factory: pytest.TempPathFactory, text: str = TEMPLATE) -> str:
    path = tmp_path_factory.mktemp("template") / "tools.jinja"
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, server_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with server_factory(tiny_llama_dir, *TOOL_SERVER_ARGS, "--chat-template", template_file(tmp_path_factory)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_response_format_validates(client: openai.OpenAI, temperature: float) -> None:
    response = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, temperature=temperature, seed=3, max_tokens=200, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_on_completions_and_structured_outputs_extra(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt="JSON:", max_tokens=200, temperature=1.0, seed=1,
                                           extra_body={"response_format": {"type": "json_object"}})
    choice = completion.choices[0]
    # Any object: a random model may write a string that never ends, so only a finished one must parse.
    assert choice.finish_reason == "length" or isinstance(json.loads(choice.text), dict)
    assert choice.text.startswith("{")
    for extra, check in [({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                         ({"regex": r"\d{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[3] == "-"),
                         ({"grammar": 'root ::= "a" ("b" | "c")'}, lambda t: t in ("ab", "ac"))]:
        chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=20, temperature=1.0, seed=2,
                                              extra_body={"structured_outputs": extra})
        assert check(chat.choices[0].message.content), (extra, chat.choices[0].message.content)


def test_openai_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(model=client.models.list().data[0].id, messages=MESSAGES,
                                               response_format=Person, max_tokens=200, temperature=0.7, seed=4)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and person.colour in ("red", "green")


def test_streamed_json_schema_joins_to_valid_json(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=200, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_tool_calls_validate(client: openai.OpenAI, tool_choice: Any, temperature: float) -> None:
    response = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES,
                                              tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=200,
                                              temperature=temperature, seed=5)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        if isinstance(tool_choice, dict):
            assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_calls_reassemble(client: openai.OpenAI, tool_choice: Any) -> None:
    model = client.models.list().data[0].id
    kwargs = dict(model=model, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=200,
                  temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                if delta.id:
                    call["id"] = delta.id
                if delta.function.name:
                    call["name"] = delta.function.name
                call["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"] for c in calls.values())


def test_auto_tool_choice_and_history_with_tool_messages(client: openai.OpenAI) -> None:
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}]
    for stream in (False, True):
        response = client.chat.completions.create(model=client.models.list().data[0].id, messages=history,
                                                  tools=[WEATHER], tool_choice="auto", max_tokens=10, temperature=0,
                                                  stream=stream)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in response if c.choices)
        else:
            text = response.choices[0].message.content
            # The random model writes no <tool_call>: its text comes back as content.
            assert response.choices[0].finish_reason in ("stop", "length")
        assert isinstance(text, str)


BAD_REQUESTS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "not valid"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be 'text', 'json_object' or 'json_schema'"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "regex is not valid"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs", "grammar is not valid"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "undefined"}}}, "tool_choice",
     "not in tools"),
    ({"tools": [{"type": "function"}]}, "tools", "must be"),
]


@pytest.mark.parametrize(("extra", "param", "message"), BAD_REQUESTS)
def test_bad_structured_requests_are_400s(server: Any, extra: dict, param: str, message: str) -> None:
    body = {"messages": MESSAGES, "max_tokens": 5, **extra}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_auto_without_the_flag_is_a_400(tiny_llama_dir: str, server_factory: Any) -> None:
    with server_factory(tiny_llama_dir, "--max-model-len", "256") as plain:
        body = {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 5}
        response = httpx.post(plain.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400 and "--enable-auto-tool-choice" in response.json()["error"]["message"]
        # tool_choice none renders the tools and answers with content.
        response = httpx.post(plain.url + "/v1/chat/completions", json={**body, "tool_choice": "none"}, timeout=60)
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["tool_calls"] == []

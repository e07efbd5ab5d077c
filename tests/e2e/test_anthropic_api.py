"""Anthropic's Messages API (``/v1/messages``) through a kvloom server, driven by the official ``anthropic`` client
on a tiny random model. The oracle is the same conversation sent through ``/v1/chat/completions`` with the
``openai`` client: the Messages API is a translation of it, so greedy text, token counts and tool calls agree.
Every error is checked in Anthropic's shape."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
import tiny_models
from tiny_models import EOS_ID

from kvloom.entrypoints.anthropic.serving_messages import _stop_reason

API_KEY = "anthropic-test-key"
MAX_BODY = 65536
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                   "unit": {"enum": ["c", "f"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
               "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA},
         {"name": "get_time", "description": "The time in a zone", "input_schema": TIME_SCHEMA}]
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                "parameters": t["input_schema"]}} for t in TOOLS]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
QUESTION = "What is the weather in Paris?"
# ChatML naming the tools and writing tool calls, small enough for the tiny model's 512-token context.
TEMPLATE = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}: "
            "{{ t.function.description }}{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>"
            "{{ m.role }}\n{{ m.content or '' }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}"
            "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% endif %}")


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, server_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TEMPLATE)
    with server_factory(tiny_llama_dir, "--max-model-len", "512", "--served-model-name", "tiny",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(template),
                        "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}',
                        "--max-request-body-bytes", str(MAX_BODY), api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Any) -> anthropic.Anthropic:
    """The client as agents configure it: the key in ``x-api-key``, ``anthropic-version`` sent."""
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


# Today's client sends no sampling fields (the API deprecates them); kvloom honours those that older clients and
# agents send, given here in the body.
GREEDY = {"temperature": 0}


def chat_text(chat: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    """The oracle: the same conversation through /v1/chat/completions, greedy."""
    return chat.chat.completions.create(model="tiny", messages=messages, temperature=0, **kwargs)


def prompt_tokens(usage: Any) -> int:
    """The prompt's tokens in Anthropic's usage: those computed (input_tokens) and those the prefix cache served."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


# ---- text ----------------------------------------------------------------------------------------

def test_text_with_a_system_prompt_is_the_chat_completion(client: anthropic.Anthropic, chat: openai.OpenAI) -> None:
    message = client.messages.create(model="tiny", max_tokens=12, extra_body=GREEDY, system="Answer briefly.",
                                     messages=[{"role": "user", "content": QUESTION}])
    oracle = chat_text(chat, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}],
                       max_tokens=12)
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert text_of(message) == oracle.choices[0].message.content
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert prompt_tokens(message.usage) == oracle.usage.prompt_tokens
    assert message.usage.output_tokens == oracle.usage.completion_tokens == 12


def test_system_blocks_and_text_blocks_render_as_chat_parts(client: anthropic.Anthropic, chat: openai.OpenAI) -> None:
    message = client.messages.create(
        model="tiny", max_tokens=8, extra_body=GREEDY,
        system=[{"type": "text", "text": "Answer briefly."}, {"type": "text", "text": "Use French."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello."}, {"type": "text", "text": QUESTION}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]},
                  {"role": "user", "content": "And tomorrow?"}])
    oracle = chat_text(chat, [
        {"role": "system", "content": [{"type": "text", "text": "Answer briefly."},
                                       {"type": "text", "text": "Use French."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hello."}, {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And tomorrow?"}], max_tokens=8)
    assert text_of(message) == oracle.choices[0].message.content
    assert prompt_tokens(message.usage) == oracle.usage.prompt_tokens


def test_stop_sequences_end_the_text_at_the_match(client: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = dict(model="tiny", extra_body=GREEDY, messages=[{"role": "user", "content": QUESTION}])
    full = text_of(client.messages.create(max_tokens=40, **kwargs))
    stop = full[10:13]  # three characters from within the greedy text: it stops at their first match
    assert len(stop) == 3
    message = client.messages.create(max_tokens=40, stop_sequences=["never written", stop], **kwargs)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert text_of(message) == full[:full.index(stop)]


def test_sampling_parameters_are_honoured(client: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = dict(model="tiny", max_tokens=16, messages=[{"role": "user", "content": QUESTION}],
                                  metadata={"user_id": "u-1"})
    greedy = text_of(client.messages.create(extra_body=GREEDY, **kwargs))
    top_k_1 = client.messages.create(extra_body={"temperature": 1.0, "top_k": 1}, **kwargs)
    assert text_of(top_k_1) == greedy  # top_k 1 is greedy
    tiny_top_p = client.messages.create(extra_body={"temperature": 1.0, "top_p": 1e-9}, **kwargs)
    assert text_of(tiny_top_p) == greedy  # so is a tiny top_p
    # thinking is accepted (the template gets enable_thinking; this one ignores it).
    assert text_of(client.messages.create(extra_body=GREEDY, thinking={"type": "disabled"}, **kwargs)) == greedy


def test_end_of_turn_and_vllm_sampling_extras(server: Any, client: anthropic.Anthropic, chat: openai.OpenAI) -> None:
    """vLLM's extra sampling fields pass through: EOS pushed up by logit_bias but held back by min_tokens ends the
    turn after 3 tokens (end_turn), as the chat API's stop does; a seed makes temperature 1 repeatable."""
    extras = {"temperature": 0, "min_tokens": 3, "logit_bias": {str(EOS_ID): 100}}
    kwargs: dict[str, Any] = dict(model="tiny", max_tokens=20, messages=[{"role": "user", "content": QUESTION}])
    message = client.messages.create(extra_body=extras, **kwargs)
    oracle = chat.chat.completions.create(extra_body=extras, **kwargs)
    assert oracle.choices[0].finish_reason == "stop" and oracle.usage.completion_tokens <= 4
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert text_of(message) == oracle.choices[0].message.content
    assert message.usage.output_tokens == oracle.usage.completion_tokens
    with client.messages.stream(extra_body=extras, **kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn" and text_of(final) == text_of(message)
    seeded = [text_of(client.messages.create(extra_body={"temperature": 1.0, "seed": 7}, **kwargs)) for _ in range(2)]
    assert seeded[0] == seeded[1] == chat.chat.completions.create(
        temperature=1.0, seed=7, **kwargs).choices[0].message.content
    response = post(server, "/v1/messages", {**kwargs, "seed": "x"})
    assert_anthropic_error(response, 400, "invalid_request_error", "seed")


def test_stop_reason_of_each_chat_finish() -> None:
    assert _stop_reason("stop", None) == ("end_turn", None)
    assert _stop_reason("stop", 2) == ("end_turn", None)  # a stop token id ends the turn
    assert _stop_reason("stop", "##") == ("stop_sequence", "##")
    assert _stop_reason("length", None) == ("max_tokens", None)
    assert _stop_reason("tool_calls", None) == ("tool_use", None)


# ---- tools ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_time"},
                                         {"type": "any", "disable_parallel_tool_use": True}])
def test_forced_tool_choice_gives_tool_use_blocks(client: anthropic.Anthropic, chat: openai.OpenAI,
                                                  tool_choice: dict[str, Any]) -> None:
    message = client.messages.create(model="tiny", max_tokens=200, extra_body=GREEDY, tools=TOOLS,
                                     tool_choice=tool_choice, messages=[{"role": "user", "content": QUESTION}])
    assert message.stop_reason == "tool_use"
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses and len(uses) == len(message.content)
    for use in uses:
        assert use.id.startswith("toolu_") and isinstance(use.input, dict)
        jsonschema.validate(use.input, SCHEMAS[use.name])
    if tool_choice["type"] == "tool":
        assert [use.name for use in uses] == ["get_time"]
    if tool_choice.get("disable_parallel_tool_use"):
        assert len(uses) == 1
    # The chat oracle's calls, with the tool choice it stands for.
    chat_choice = ("required" if tool_choice["type"] == "any"
                   else {"type": "function", "function": {"name": tool_choice["name"]}})
    oracle = chat_text(chat, [{"role": "user", "content": QUESTION}], max_tokens=200, tools=CHAT_TOOLS,
                       tool_choice=chat_choice, parallel_tool_calls=not tool_choice.get("disable_parallel_tool_use"))
    assert [(use.name, use.input) for use in uses] == [
        (call.function.name, json.loads(call.function.arguments)) for call in oracle.choices[0].message.tool_calls]


def test_a_tool_result_turn_is_the_chat_tool_message(client: anthropic.Anthropic, chat: openai.OpenAI) -> None:
    first = client.messages.create(model="tiny", max_tokens=200, extra_body=GREEDY, tools=TOOLS,
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   messages=[{"role": "user", "content": QUESTION}])
    use = first.content[0]
    assert use.type == "tool_use"
    history: list[dict[str, Any]] = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, use.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": "21 C"}, {"type": "text", "text": "sunny"}]},
                                     {"type": "text", "text": "Thanks."}]}]
    message = client.messages.create(model="tiny", max_tokens=10, extra_body=GREEDY, tools=TOOLS,
                                     tool_choice={"type": "none"}, messages=history)
    oracle = chat_text(chat, [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [{"id": use.id, "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "21 C\nsunny"},
        {"role": "user", "content": "Thanks."}], max_tokens=10, tools=CHAT_TOOLS, tool_choice="none")
    assert text_of(message) == oracle.choices[0].message.content
    assert prompt_tokens(message.usage) == oracle.usage.prompt_tokens
    # An error result is the tool message's text after "Error: ".
    history[2]["content"] = [{"type": "tool_result", "tool_use_id": use.id, "content": "no network", "is_error": True}]
    counted = client.messages.count_tokens(model="tiny", tools=TOOLS, messages=history)
    oracle = chat_text(chat, [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [{"id": use.id, "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "Error: no network"}], max_tokens=1, tools=CHAT_TOOLS,
        tool_choice="none")
    assert counted.input_tokens == oracle.usage.prompt_tokens


def test_auto_tool_choice_answers_with_text_when_the_model_calls_nothing(client: anthropic.Anthropic,
                                                                         chat: openai.OpenAI) -> None:
    message = client.messages.create(model="tiny", max_tokens=10, extra_body=GREEDY, tools=TOOLS,
                                     messages=[{"role": "user", "content": QUESTION}])
    oracle = chat_text(chat, [{"role": "user", "content": QUESTION}], max_tokens=10, tools=CHAT_TOOLS)
    assert oracle.choices[0].message.tool_calls == []  # the random model writes no <tool_call>
    assert text_of(message) == oracle.choices[0].message.content and message.stop_reason == "max_tokens"


# ---- streaming -----------------------------------------------------------------------------------

def test_streamed_text_is_the_whole_message(client: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = dict(model="tiny", max_tokens=20, extra_body=GREEDY, system="Be brief.",
                                  messages=[{"role": "user", "content": QUESTION}])
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == text_of(whole)
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in whole.content]
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert prompt_tokens(final.usage) == prompt_tokens(whole.usage)
    assert final.usage.output_tokens == whole.usage.output_tokens == 20


def test_streamed_stop_sequence(client: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = dict(model="tiny", max_tokens=40, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": QUESTION}])
    full = text_of(client.messages.create(**kwargs))
    stop = full[10:13]
    with client.messages.stream(stop_sequences=[stop], **kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert text_of(final) == full[:full.index(stop)]


@pytest.mark.parametrize("tool_choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_streamed_tool_use_is_the_whole_message(client: anthropic.Anthropic, tool_choice: dict[str, Any]) -> None:
    kwargs: dict[str, Any] = dict(model="tiny", max_tokens=200, extra_body=GREEDY, tools=TOOLS, tool_choice=tool_choice,
                                  messages=[{"role": "user", "content": QUESTION}])
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [event for event in events if event.type == "content_block_start"]
    assert [start.content_block.type for start in starts] == ["tool_use"] * len(whole.content)
    assert any(event.type == "content_block_delta" and event.delta.type == "input_json_delta" for event in events)
    assert kinds.count("content_block_stop") == len(starts)
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in whole.content]
    assert all(block.id.startswith("toolu_") for block in final.content)


def test_stream_events_on_the_wire(server: Any) -> None:
    """The raw stream: named events, a ping, one text block, the stop reason and usage at the end."""
    body = {"model": "tiny", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60,
                      headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = []
    for block in raw.strip().split("\n\n"):
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: ")
        data = json.loads(data_line[len("data: "):])
        assert data["type"] == name_line[len("event: "):]
        events.append(data)
    assert [e["type"] for e in events[:3]] == ["message_start", "ping", "content_block_start"]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["usage"]["output_tokens"] == 0
    assert events[2]["content_block"] == {"type": "text", "text": ""}
    assert {e["delta"]["type"] for e in events if e["type"] == "content_block_delta"} == {"text_delta"}
    assert [e["type"] for e in events[-3:]] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2]["usage"] == {"output_tokens": 5}


# ---- count_tokens --------------------------------------------------------------------------------

def test_count_tokens_counts_system_tools_and_messages(client: anthropic.Anthropic, chat: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    plain = client.messages.count_tokens(model="tiny", messages=messages)
    full = client.messages.count_tokens(model="tiny", messages=messages, system="Answer briefly.", tools=TOOLS)
    oracle = chat_text(chat, [{"role": "system", "content": "Answer briefly."}, *messages], max_tokens=1,
                       tools=CHAT_TOOLS, tool_choice="none")
    assert full.input_tokens == oracle.usage.prompt_tokens
    assert plain.input_tokens == chat_text(chat, messages, max_tokens=1).usage.prompt_tokens < full.input_tokens
    created = client.messages.create(model="tiny", max_tokens=1, messages=messages, system="Answer briefly.",
                                     tools=TOOLS, tool_choice={"type": "none"})
    assert prompt_tokens(created.usage) == full.input_tokens


# ---- auth ----------------------------------------------------------------------------------------

def test_the_key_in_either_header(server: Any) -> None:
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=API_KEY, max_retries=0, timeout=60)
    assert bearer.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "hi"}]).input_tokens > 0
    for wrong in (anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0),
                  anthropic.Anthropic(base_url=server.url, auth_token="wrong", max_retries=0)):
        with pytest.raises(anthropic.AuthenticationError) as error:
            wrong.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
        assert error.value.status_code == 401
        assert error.value.body["type"] == "error" and error.value.body["error"]["type"] == "authentication_error"
    response = httpx.post(server.url + "/v1/messages/count_tokens", json={}, timeout=30)
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    # The OpenAI routes keep their own header and error shape.
    response = httpx.post(server.url + "/v1/chat/completions", headers={"x-api-key": API_KEY}, timeout=30,
                          json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


# ---- errors --------------------------------------------------------------------------------------

def post(server: Any, path: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"x-api-key": API_KEY, **headers}, timeout=60)


def assert_anthropic_error(response: httpx.Response, status: int, error_type: str, *words: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == error_type, body
    for word in words:
        assert word in body["error"]["message"], body


USER = [{"role": "user", "content": "hi"}]
BAD_BODIES = [
    ("missing max_tokens", {"model": "tiny", "messages": USER}, "max_tokens", "required"),
    ("max_tokens 0", {"model": "tiny", "max_tokens": 0, "messages": USER}, "max_tokens", "greater than"),
    ("missing model", {"max_tokens": 5, "messages": USER}, "model", "required"),
    ("bad role", {"model": "tiny", "max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}, "role",
     "'user' or 'assistant'"),
    ("no messages", {"model": "tiny", "max_tokens": 5, "messages": []}, "messages", "at least 1"),
    ("unknown block", {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {}}]}]}, "document", "'text', 'image', 'tool_use', 'tool_result'"),
    ("tool_use from the user", {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "tool_use", "only an assistant"),
    ("tool_result from the assistant", {"model": "tiny", "max_tokens": 5, "messages": [*USER, {
        "role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}, *USER]}, "tool_result",
     "only a user"),
    ("prefill", {"model": "tiny", "max_tokens": 5, "messages": [*USER, {"role": "assistant", "content": "Hel"}]},
     "last message", "prefill"),
    ("unknown tool in tool_choice", {"model": "tiny", "max_tokens": 5, "tools": TOOLS,
                                     "tool_choice": {"type": "tool", "name": "get_moon"}, "messages": USER},
     "get_moon", "not in tools"),
    ("bad tool_choice type", {"model": "tiny", "max_tokens": 5, "tools": TOOLS, "tool_choice": {"type": "some"},
                              "messages": USER}, "tool_choice", "'auto', 'any', 'tool', 'none'"),
    ("tool without a schema", {"model": "tiny", "max_tokens": 5, "tools": [{"name": "f"}], "messages": USER},
     "input_schema", "required"),
    ("bad tool name", {"model": "tiny", "max_tokens": 5, "tools": [{"name": "a b", "input_schema": {}}],
                       "messages": USER}, "name", "letters"),
    ("negative temperature", {"model": "tiny", "max_tokens": 5, "temperature": -1, "messages": USER},
     "temperature", "at least"),
    ("too long", {"model": "tiny", "max_tokens": 5000, "messages": USER}, "maximum context length", "5000"),
    ("bad image", {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/bmp", "data": ""}}]}]}, "media_type",
     "image/png"),
    ("image to a text model", {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]}, "image", "text-only"),
]


@pytest.mark.parametrize(("body", "words"), [(b, w) for _, b, *w in BAD_BODIES], ids=[c[0] for c in BAD_BODIES])
def test_bad_requests_are_anthropic_400s(server: Any, body: dict[str, Any], words: list[str]) -> None:
    for stream in (False, True):
        assert_anthropic_error(post(server, "/v1/messages", {**body, "stream": stream}), 400,
                               "invalid_request_error", *words)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_client_errors_are_typed(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as error:
        client.messages.create(model="claude-opus", max_tokens=5, messages=USER)
    assert error.value.body["error"] == {"type": "not_found_error",
                                         "message": "The model `claude-opus` does not exist."}
    with pytest.raises(anthropic.NotFoundError):
        with client.messages.stream(model="claude-opus", max_tokens=5, messages=USER) as stream:
            stream.get_final_message()
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-opus", messages=USER)
    with pytest.raises(anthropic.BadRequestError) as error:
        client.messages.create(model="tiny", max_tokens=5, messages=USER, tools=TOOLS,
                               tool_choice={"type": "tool", "name": "get_moon"})
    assert error.value.body["error"]["type"] == "invalid_request_error"


def test_malformed_bodies_paths_and_methods(server: Any) -> None:
    response = httpx.post(server.url + "/v1/messages", content=b"{", timeout=30,
                          headers={"x-api-key": API_KEY, "Content-Type": "application/json"})
    assert_anthropic_error(response, 400, "invalid_request_error", "not valid JSON")
    response = httpx.post(server.url + "/v1/messages", content=b"{}", timeout=30,
                          headers={"x-api-key": API_KEY, "Content-Type": "text/plain"})
    assert_anthropic_error(response, 415, "invalid_request_error", "application/json")
    too_large = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}
    assert_anthropic_error(post(server, "/v1/messages", too_large), 413, "request_too_large",
                           "--max-request-body-bytes")
    assert_anthropic_error(post(server, "/v1/messages/count_tokens", {"model": "tiny", "messages": "hi"}), 400,
                           "invalid_request_error", "messages")
    assert_anthropic_error(post(server, "/v1/messages/batches", {}), 404, "not_found_error", "/v1/messages/batches")
    response = httpx.get(server.url + "/v1/messages", headers={"x-api-key": API_KEY}, timeout=30)
    assert_anthropic_error(response, 405, "invalid_request_error", "use POST")
    # The rest of the server keeps OpenAI's shape.
    response = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": "hi"}, timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_openapi_documents_the_bodies_and_anthropic_errors(server: Any) -> None:
    from kvloom.entrypoints.anthropic import protocol

    document = httpx.get(server.url + "/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"},
                         timeout=30).json()
    schemas = document["components"]["schemas"]
    for path, model in [("/v1/messages", "AnthropicMessagesRequest"),
                        ("/v1/messages/count_tokens", "AnthropicCountTokensRequest")]:
        operation = document["paths"][path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"] == \
            f"#/components/schemas/{model}"
        fields = getattr(protocol, model).model_fields
        assert set(schemas[model]["properties"]) == set(fields)
        assert set(schemas[model]["required"]) == {name for name, field in fields.items() if field.is_required()}
        for status in ("400", "413", "415", "4XX", "5XX"):
            error = operation["responses"][status]["content"]["application/json"]["schema"]["$ref"]
            assert error == "#/components/schemas/AnthropicErrorResponse"
    assert set(schemas["AnthropicErrorResponse"]["properties"]) == {"type", "error"}
    assert set(schemas["AnthropicErrorDetail"]["properties"]) == {"type", "message"}


# ---- images --------------------------------------------------------------------------------------

def test_image_blocks_are_chat_image_parts(server_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    """On a tiny vision model: base64 image blocks, in a message and in a tool result, give the chat API's reply
    to the same image as an image_url part; an undecodable image is a 400 in Anthropic's shape."""
    import base64
    import io

    import numpy as np
    from PIL import Image
    from tiny_vision import build_tiny_idefics3

    model_dir = build_tiny_idefics3(str(tmp_path_factory.mktemp("tiny_idefics3")))
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (20, 40, 3), dtype=np.uint8)).save(buffer, "PNG")
    data = base64.b64encode(buffer.getvalue()).decode()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    image_part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}
    with server_factory(model_dir, "--dtype", "float32", "--served-model-name", "vlm") as vlm:
        client = anthropic.Anthropic(base_url=vlm.url, api_key="none", max_retries=0, timeout=120)
        chat = openai.OpenAI(base_url=vlm.url + "/v1", api_key="none", max_retries=0, timeout=120)
        message = client.messages.create(model="vlm", max_tokens=8, extra_body=GREEDY, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}])
        oracle = chat.chat.completions.create(model="vlm", max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is it?"}, image_part]}])
        assert text_of(message) == oracle.choices[0].message.content
        assert prompt_tokens(message.usage) == oracle.usage.prompt_tokens
        counted = client.messages.count_tokens(model="vlm", messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}])
        assert counted.input_tokens == oracle.usage.prompt_tokens
        # A tool's result with an image: the tool message holds its text, a user message after it the image.
        call = {"type": "tool_use", "id": "toolu_1", "name": "look", "input": {}}
        message = client.messages.create(model="vlm", max_tokens=8, extra_body=GREEDY, messages=[
            {"role": "user", "content": "Look."}, {"role": "assistant", "content": [call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "A photo:"}, image]}]}])
        oracle = chat.chat.completions.create(model="vlm", max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": "Look."},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "look", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "A photo:"},
            {"role": "user", "content": [image_part]}])
        assert text_of(message) == oracle.choices[0].message.content
        assert prompt_tokens(message.usage) == oracle.usage.prompt_tokens
        garbage = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                               "data": base64.b64encode(b"garbage").decode()}}
        response = httpx.post(vlm.url + "/v1/messages", timeout=60, json={
            "model": "vlm", "max_tokens": 2, "messages": [{"role": "user", "content": [garbage]}]})
        assert_anthropic_error(response, 400, "invalid_request_error")


# ---- a dead engine -------------------------------------------------------------------------------

def test_a_dead_engine_mid_stream_is_an_error_event_then_overloaded(tiny_llama_dir: str) -> None:
    """In process: a step that raises kills the engine under a stream, which ends with an ``error`` event; the
    next request is a 503 ``overloaded_error``."""
    import argparse
    import asyncio

    from kvloom.config import EngineConfig
    from kvloom.engine.async_engine import AsyncLLM
    from kvloom.entrypoints.openai.api_server import build_app

    engine = AsyncLLM.from_config(EngineConfig(model=tiny_llama_dir), stats_interval=0)

    def broken_step() -> None:
        raise RuntimeError("simulated device failure")

    engine.engine.step = broken_step  # type: ignore[method-assign]
    args = argparse.Namespace(model=tiny_llama_dir, served_model_name=None, chat_template=None, api_key=None)
    app = build_app(engine, args)
    body = {"model": tiny_llama_dir, "max_tokens": 3, "messages": USER}

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            response = await http.post("/v1/messages", json={**body, "stream": True})
            assert response.status_code == 200
            events = [block.split("\n") for block in response.text.strip().split("\n\n")]
            assert [name for name, _ in events] == ["event: message_start", "event: ping", "event: error"]
            error = json.loads(events[-1][1][len("data: "):])
            assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
            assert "simulated device failure" in error["error"]["message"]
            assert_anthropic_error(await http.post("/v1/messages", json=body), 503, "overloaded_error",
                                   "not running")

    try:
        asyncio.run(run())
        assert engine.errored
    finally:
        engine.shutdown()


# ---- thinking ------------------------------------------------------------------------------------

# The tiny model with <think> / </think> (ids 400, 401) and a bias on </think>, as tests/e2e/test_reasoning_server.py
# builds it: the model reasons a few tokens, then answers.
END_THINK_BIAS = {str(tiny_models.TOKENIZER_VOCAB_SIZE + 1): 6.0}
THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>"
                  "{{ m.reasoning_content }}</think>{% endif %}{{ m.content or '' }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                  "{% endif %}")


@pytest.fixture(scope="module")
def reasoning_server(server_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tokenizers import Tokenizer

    path = str(tmp_path_factory.mktemp("tiny_reasoning"))
    tiny_models.build_tiny_checkpoint(path, arch="llama", vocab_size=tiny_models.TOKENIZER_VOCAB_SIZE + 2)
    tokenizer = Tokenizer.from_file(f"{path}/tokenizer.json")
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save(f"{path}/tokenizer.json")
    template = tmp_path_factory.mktemp("template") / "deepseek_r1.jinja"
    template.write_text(THINK_TEMPLATE)
    with server_factory(path, "--max-model-len", "512", "--served-model-name", "thinker", "--chat-template",
                        str(template), "--reasoning-parser", "deepseek_r1") as s:
        yield s


def test_reasoning_comes_as_thinking_blocks(reasoning_server: Any) -> None:
    client = anthropic.Anthropic(base_url=reasoning_server.url, api_key="none", max_retries=0, timeout=120)
    chat = openai.OpenAI(base_url=reasoning_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": QUESTION}]
    both = 0
    for seed in range(4):
        sampling = {"temperature": 0.8, "seed": seed, "logit_bias": END_THINK_BIAS}
        oracle = chat.chat.completions.create(model="thinker", max_tokens=24, messages=messages,
                                              extra_body=sampling).choices[0].message
        expected = [("thinking", oracle.reasoning_content)] if oracle.reasoning_content else []
        expected += [("text", oracle.content)] if oracle.content else []
        message = client.messages.create(model="thinker", max_tokens=24, messages=messages, extra_body=sampling)
        got = [(b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content]
        assert got == expected, seed
        with client.messages.stream(model="thinker", max_tokens=24, messages=messages, extra_body=sampling) as stream:
            events = list(stream)
            final = stream.get_final_message()
        assert [(b.type, b.thinking if b.type == "thinking" else b.text) for b in final.content] == expected, seed
        deltas = {event.delta.type for event in events if event.type == "content_block_delta"}
        assert deltas == {"thinking_delta" if kind == "thinking" else "text_delta" for kind, _ in expected}
        both += len(expected) == 2
        # thinking disabled: the template closes the block, and the reply is text alone.
        off = client.messages.create(model="thinker", max_tokens=24, messages=messages, extra_body=sampling,
                                     thinking={"type": "disabled"})
        assert [block.type for block in off.content] in ([], ["text"])
    assert both, "no seed gave both reasoning and text: the test would not tell them apart"
    # A thinking block sent back is the assistant message's reasoning_content, which this template replays.
    history = [*messages, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Light scatters.",
                                                             "signature": ""}, {"type": "text", "text": "Rayleigh."}]},
               {"role": "user", "content": "More?"}]
    counted = client.messages.count_tokens(model="thinker", messages=history).input_tokens
    oracle = chat.chat.completions.create(model="thinker", max_tokens=1, messages=[
        *messages, {"role": "assistant", "content": "Rayleigh.", "reasoning_content": "Light scatters."},
        {"role": "user", "content": "More?"}])
    assert counted == oracle.usage.prompt_tokens
    history[1]["content"] = history[1]["content"][1:]
    assert client.messages.count_tokens(model="thinker", messages=history).input_tokens < counted

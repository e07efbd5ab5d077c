"""Ollama's API (``/api/...``) through a kvloom server, driven by the official ``ollama`` client and
``langchain-ollama`` on a tiny random model (with ``<think>`` tokens and a reasoning parser). The oracle is the
same conversation sent through ``/v1/chat/completions`` (and ``/v1/completions``, ``/v1/embeddings``) with the
``openai`` client: Ollama's API is a translation of them, so greedy text, token counts, tool calls, reasoning
and embeddings agree. Every error is checked in Ollama's shape."""

from __future__ import annotations

import base64
import datetime
import json
import math
import os
from typing import Any

import httpx
import jsonschema
import ollama
import openai
import pytest
import tiny_models
from safetensors import safe_open
from tokenizers import Tokenizer

from kvloom.loader.tokenizer import load_tokenizer
from kvloom.loader.weights import resolve_model

API_KEY = "ollama-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
QUESTION = "What is the weather in Paris?"
# ChatML that writes tool calls and results (hermes), opens <think> where the request asks to think, and writes an
# empty closed block where it asks not to (Qwen3's way, which tells the grammar where the content starts).
TEMPLATE = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
            "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
            "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking %}<think>\n{% elif enable_thinking is defined %}"
            "<think>\n\n</think>\n\n{% endif %}{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
# The tiny random model writes no tool call by itself: this grammar (kvloom's extension in options) makes it write
# one in hermes' syntax, which the auto tool parser then reads.
CALL_REGEX = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}"\}\}</tool_call>'
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "n"], "additionalProperties": False}
# A bias on </think> (id 401): the model reasons a few tokens, then closes its reasoning.
END_BIAS = {str(tiny_models.TOKENIZER_VOCAB_SIZE + 1): 6.0}
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(24)).decode()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama with <think> and </think> added to its tokenizer (ids 400, 401)."""
    path = str(tmp_path_factory.mktemp("tiny_ollama"))
    tiny_models.build_tiny_checkpoint(path, arch="llama", vocab_size=tiny_models.TOKENIZER_VOCAB_SIZE + 2)
    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def server(model_dir: str, server_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    template = tmp_path_factory.mktemp("template") / "ollama.jinja"
    template.write_text(TEMPLATE)
    with server_factory(model_dir, "--max-model-len", "512", "--served-model-name", "tiny",
                        "--chat-template", str(template), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--reasoning-parser", "qwen3", "--structured-outputs-config",
                        '{"backend": "xgrammar", "disable_any_whitespace": true}', api_key=API_KEY) as s:
        s.template = TEMPLATE
        yield s


@pytest.fixture(scope="module")
def client(server: Any) -> ollama.Client:
    return ollama.Client(host=server.url, headers=AUTH, timeout=120)


@pytest.fixture(scope="module")
def chat(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def post(server: Any, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=120, headers={**AUTH, **(headers or {})})


def oracle(chat: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int, **kwargs: Any) -> Any:
    """The same conversation through /v1/chat/completions, greedy unless told otherwise."""
    kwargs.setdefault("temperature", 0)
    return chat.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, **kwargs)


def is_rfc3339(value: str) -> bool:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).tzinfo is not None


GREEDY = {"temperature": 0}
CONVERSATION = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]


# ---- chat -----------------------------------------------------------------------------------------

def test_chat_is_the_chat_completion(client: ollama.Client, chat: openai.OpenAI) -> None:
    reply = client.chat(model="tiny", messages=CONVERSATION, stream=False, options={**GREEDY, "num_predict": 12})
    expected = oracle(chat, CONVERSATION, 12)
    assert reply.model == "tiny" and reply.done and reply.done_reason == "length"
    assert reply.message.role == "assistant" and reply.message.content == expected.choices[0].message.content
    assert reply.message.thinking is None and reply.message.tool_calls is None
    assert reply.prompt_eval_count == expected.usage.prompt_tokens and reply.eval_count == 12
    assert is_rfc3339(reply.created_at)
    assert reply.total_duration >= reply.load_duration + reply.prompt_eval_duration + reply.eval_duration > 0
    # logprobs: the chat API's, per token, with the top alternatives.
    scored = client.chat(model="tiny", messages=CONVERSATION, stream=False, logprobs=True, top_logprobs=2,
                         options={**GREEDY, "num_predict": 12})
    expected_logprobs = oracle(chat, CONVERSATION, 12, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert [entry.token for entry in scored.logprobs] == [entry.token for entry in expected_logprobs]
    assert [entry.logprob for entry in scored.logprobs] == pytest.approx([e.logprob for e in expected_logprobs])
    assert [[top.token for top in entry.top_logprobs] for entry in scored.logprobs] == [
        [top.token for top in entry.top_logprobs] for entry in expected_logprobs]
    # Ollama's tag: tiny:latest is tiny.
    again = client.chat(model="tiny:latest", messages=CONVERSATION, stream=False, options={**GREEDY, "num_predict": 12})
    assert again.model == "tiny:latest" and again.message.content == reply.message.content


def test_streamed_chat_is_the_whole_reply_in_ndjson(server: Any, client: ollama.Client) -> None:
    options = {**GREEDY, "num_predict": 16, "stop": ["never written"]}
    whole = client.chat(model="tiny", messages=CONVERSATION, stream=False, options=options)
    parts = list(client.chat(model="tiny", messages=CONVERSATION, stream=True, options=options))
    # (deltas a slower reader has not taken yet come merged: a tiny model's can come in one)
    assert len(parts) >= 2 and all(not p.done and p.done_reason is None for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == whole.message.content
    last = parts[-1]
    assert last.done and last.done_reason == whole.done_reason == "length" and last.message.content == ""
    assert (last.prompt_eval_count, last.eval_count) == (whole.prompt_eval_count, whole.eval_count) == (
        whole.prompt_eval_count, 16)
    assert last.eval_duration > 0 and last.total_duration > 0
    # On the wire: NDJSON, one object per line, stream true unless told.
    with httpx.stream("POST", server.url + "/api/chat", headers=AUTH, timeout=60, content=json.dumps(
            {"model": "tiny", "messages": CONVERSATION, "options": options})) as response:
        assert response.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert "".join(line["message"]["content"] for line in lines) == whole.message.content
    assert lines[-1]["done"] is True and set(lines[-1]) >= {
        "total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration"}


def test_sampling_options_are_honoured(client: ollama.Client, chat: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": QUESTION}]

    def content(**options: Any) -> str:
        return client.chat(model="tiny", messages=messages, stream=False,
                           options={"num_predict": 16, **options}).message.content

    greedy = content(temperature=0)
    assert content(temperature=1.0, top_k=1) == greedy
    assert content(temperature=1.0, top_p=1e-9) == greedy
    # A seed makes sampling repeatable, and is the chat API's seed.
    seeded = content(temperature=1.0, seed=7, repeat_penalty=1.3, min_p=0.01)
    assert seeded == content(temperature=1.0, seed=7, repeat_penalty=1.3, min_p=0.01)
    assert seeded == oracle(chat, messages, 16, temperature=1.0, seed=7, top_p=0.9, extra_body={
        "top_k": 40, "repetition_penalty": 1.3, "min_p": 0.01}).choices[0].message.content
    # stop ends the text at its first match; num_ctx over the server's context is clamped to it.
    stop = greedy[8:11]
    assert content(temperature=0, stop=[stop]) == greedy[:greedy.index(stop)]
    assert content(temperature=0, num_ctx=100000, num_thread=2) == greedy


def test_generate_templated_raw_and_streamed(client: ollama.Client, chat: openai.OpenAI) -> None:
    reply = client.generate(model="tiny", prompt=QUESTION, system="Answer briefly.", options={**GREEDY,
                                                                                               "num_predict": 10})
    assert reply.response == oracle(chat, CONVERSATION, 10).choices[0].message.content
    assert reply.done and reply.done_reason == "length" and reply.eval_count == 10 and reply.context is None
    parts = list(client.generate(model="tiny", prompt=QUESTION, system="Answer briefly.", stream=True,
                                 options={**GREEDY, "num_predict": 10}))
    assert "".join(p.response for p in parts) == reply.response and parts[-1].done
    # raw: the prompt as it is, as /v1/completions runs it.
    raw = client.generate(model="tiny", prompt="The quick brown fox", raw=True, options={**GREEDY, "num_predict": 8})
    completion = chat.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0)
    assert raw.response == completion.choices[0].text and raw.prompt_eval_count == completion.usage.prompt_tokens
    streamed = list(client.generate(model="tiny", prompt="The quick brown fox", raw=True, stream=True,
                                    options={**GREEDY, "num_predict": 8}))
    assert "".join(p.response for p in streamed) == raw.response and streamed[-1].eval_count == 8
    # An empty prompt loads the model (it is loaded).
    loaded = client.generate(model="tiny", prompt="")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    assert client.chat(model="tiny", messages=[]).done_reason == "load"


# ---- tools ----------------------------------------------------------------------------------------

def test_tool_call_comes_back_in_ollamas_shape(client: ollama.Client, chat: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    options = {**GREEDY, "num_predict": 200, "structured_outputs": {"regex": CALL_REGEX}}
    reply = client.chat(model="tiny", messages=messages, tools=[WEATHER], stream=False, options=options)
    expected = oracle(chat, messages, 200, tools=[WEATHER], extra_body={"structured_outputs": {"regex": CALL_REGEX}})
    expected_call = expected.choices[0].message.tool_calls[0]
    assert reply.done_reason == "stop" and reply.message.content == ""
    [call] = reply.message.tool_calls
    assert call.function.name == "get_weather" == expected_call.function.name
    assert dict(call.function.arguments) == json.loads(expected_call.function.arguments)
    # Streamed: the call comes whole, in one object.
    parts = list(client.chat(model="tiny", messages=messages, tools=[WEATHER], stream=True, options=options))
    calls = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather",
                                                                                dict(call.function.arguments))]
    # The call and its result sent back are the chat API's assistant tool_calls and tool message.
    history = [*messages, reply.message, {"role": "tool", "content": "21 C", "tool_name": "get_weather"},
               {"role": "user", "content": "Thanks."}]
    answer = client.chat(model="tiny", messages=history, tools=[WEATHER], stream=False,
                         options={**GREEDY, "num_predict": 8})
    chat_history = [*messages, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": expected_call.function.arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}, {"role": "user", "content": "Thanks."}]
    chat_answer = oracle(chat, chat_history, 8, tools=[WEATHER])
    assert answer.message.content == chat_answer.choices[0].message.content
    assert answer.prompt_eval_count == chat_answer.usage.prompt_tokens


# ---- structured outputs ------------------------------------------------------------------------------

def test_format_schema_and_json(client: ollama.Client, chat: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]
    # think false: no reasoning (the random model would open <think>), so the grammar holds from the start.
    reply = client.chat(model="tiny", messages=messages, format=SCHEMA, think=False, stream=False,
                        options={**GREEDY, "num_predict": 100})
    jsonschema.validate(json.loads(reply.message.content), SCHEMA)
    expected = oracle(chat, messages, 100, response_format={"type": "json_schema", "json_schema": {
        "name": "format", "schema": SCHEMA}}, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.message.content == expected.choices[0].message.content and reply.done_reason == "stop"
    generated = client.generate(model="tiny", prompt="Is the sky blue?", format=SCHEMA, think=False,
                                options={**GREEDY, "num_predict": 100})
    jsonschema.validate(json.loads(generated.response), SCHEMA)
    as_json = client.chat(model="tiny", messages=messages, format="json", think=False, stream=False,
                          options={**GREEDY, "num_predict": 30})
    assert as_json.message.content.startswith("{")


# ---- thinking -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_think_splits_the_reasoning_into_thinking(client: ollama.Client, chat: openai.OpenAI, seed: int) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    options = {"temperature": 0.8, "seed": seed, "num_predict": 24, "logit_bias": END_BIAS}
    reply = client.chat(model="tiny", messages=messages, think=True, stream=False, options=options)
    expected = oracle(chat, messages, 24, temperature=0.8, seed=seed, top_p=0.9, logit_bias=END_BIAS,
                      extra_body={"top_k": 40, "chat_template_kwargs": {"enable_thinking": True}})
    assert reply.message.thinking == expected.choices[0].message.reasoning_content
    assert (reply.message.content or None) == expected.choices[0].message.content
    assert reply.message.thinking  # the template opened <think>: the reply starts in its reasoning
    parts = list(client.chat(model="tiny", messages=messages, think="high", stream=True, options=options))
    assert "".join(p.message.thinking or "" for p in parts) == reply.message.thinking
    assert "".join(p.message.content for p in parts) == reply.message.content
    generated = client.generate(model="tiny", prompt=QUESTION, think=True, options=options)
    assert generated.thinking == reply.message.thinking and generated.response == reply.message.content
    plain = client.chat(model="tiny", messages=messages, think=False, stream=False, options=options)
    assert plain.message.thinking is None


# ---- embeddings ----------------------------------------------------------------------------------------

def test_embed_is_the_embeddings_endpoint(client: ollama.Client, chat: openai.OpenAI, model_dir: str) -> None:
    texts = ["The sky is blue.", "Grass is green."]
    reply = client.embed(model="tiny", input=texts)
    expected = chat.embeddings.create(model="tiny", input=texts)
    assert reply.model == "tiny" and len(reply.embeddings) == 2
    for got, want in zip(reply.embeddings, expected.data):
        assert got == pytest.approx(want.embedding, abs=1e-6)
    assert reply.prompt_eval_count == expected.usage.prompt_tokens and reply.total_duration > 0
    single = client.embed(model="tiny", input=texts[0])
    assert single.embeddings[0] == pytest.approx(reply.embeddings[0], abs=1e-6)
    legacy = client.embeddings(model="tiny", prompt=texts[0])
    assert list(legacy.embedding) == pytest.approx(reply.embeddings[0], abs=1e-6)
    # truncate (the default) cuts an input to the longest an embedding takes; truncate false refuses it.
    long = "word " * 600
    truncated = client.embed(model="tiny", input=long).embeddings[0]
    ids = load_tokenizer(resolve_model(model_dir)).encode(long, add_special_tokens=True)[:511]
    assert truncated == pytest.approx(chat.embeddings.create(model="tiny", input=[ids]).data[0].embedding, abs=1e-6)
    with pytest.raises(ollama.ResponseError) as error:
        client.embed(model="tiny", input=long, truncate=False)
    assert error.value.status_code == 400 and "exceeds the context length" in error.value.error
    with pytest.raises(ollama.ResponseError) as error:  # not a Matryoshka model
        client.embed(model="tiny", input="x", dimensions=8)
    assert error.value.status_code == 400 and "dimensions" in error.value.error


# ---- listings ------------------------------------------------------------------------------------------

def test_tags_ps_show_and_version(server: Any, client: ollama.Client, model_dir: str) -> None:
    with safe_open(os.path.join(model_dir, "model.safetensors"), "np") as f:
        parameters = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    [listed] = client.list().models
    weights = os.path.join(model_dir, "model.safetensors")
    assert listed.model == "tiny:latest" and listed.size == os.path.getsize(weights)
    assert listed.details.format == "safetensors" and listed.details.family == "llama"
    assert listed.details.families == ["llama"] and listed.details.quantization_level == "F32"
    assert listed.details.parameter_size == f"{parameters / 1e3:.1f}K" and len(listed.digest) == 64
    [running] = client.ps().models
    assert running.model == "tiny:latest" and running.digest == listed.digest and running.context_length == 512
    assert running.size_vram == 0 and running.expires_at.year > 2200  # loaded for the server's life, on the CPU
    shown = client.show("tiny")
    assert shown.template == server.template and shown.details.family == "llama"
    assert shown.modelinfo["general.parameter_count"] == parameters
    assert shown.modelinfo["llama.context_length"] == 512 and shown.modelinfo["llama.block_count"] == 2
    assert set(shown.capabilities) == {"completion", "tools", "thinking", "embedding"}
    assert client.show("tiny:latest").modelinfo == shown.modelinfo
    version = httpx.get(server.url + "/api/version", headers=AUTH).json()
    from kvloom import __version__
    assert version == {"version": __version__}
    root = httpx.get(server.url + "/", headers=AUTH)
    assert root.status_code == 200 and root.text == "Ollama is running"
    for path in ("/", "/api/tags", "/api/version"):
        assert httpx.head(server.url + path, headers=AUTH).status_code == 200


# ---- errors --------------------------------------------------------------------------------------------

def expect_error(call: Any, status: int, *words: str) -> str:
    with pytest.raises(ollama.ResponseError) as error:
        result = call()
        if not isinstance(result, (ollama.ChatResponse, ollama.GenerateResponse)):
            list(result)
    assert error.value.status_code == status, error.value.error
    for word in words:
        assert word in error.value.error
    return error.value.error


def test_errors_in_ollamas_shape(server: Any, client: ollama.Client) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    expect_error(lambda: client.chat(model="nope", messages=messages, stream=False), 404, "model 'nope' not found",
                 "tiny:latest")
    expect_error(lambda: client.show("nope"), 404, "tiny:latest")
    expect_error(lambda: client.embed(model="nope", input="x"), 404)
    expect_error(lambda: client.chat(model="tiny", messages=[{"role": "user", "content": "x", "images": [PNG]}],
                                     stream=False), 400, "text-only")
    expect_error(lambda: client.generate(model="tiny", prompt="def f(", suffix="return x"), 400,
                 "does not support insert")
    expect_error(lambda: client.chat(model="tiny", messages=messages, think="deep", stream=False), 400,
                 "invalid think value")
    expect_error(lambda: client.chat(model="tiny", messages=messages, keep_alive="five minutes", stream=False), 400,
                 "keep_alive")
    expect_error(lambda: client.chat(model="tiny", messages=[], keep_alive=0), 400, "cannot unload")
    expect_error(lambda: client.chat(model="tiny", messages=messages, options={"num_predict": 0}, stream=False), 400,
                 "num_predict")
    expect_error(lambda: client.chat(model="tiny", messages=messages, options={"mirostat": 2}, stream=False), 400,
                 "mirostat")
    expect_error(lambda: client.chat(model="tiny", messages=messages, options={"temperature": "hot"}, stream=False),
                 400, "options.temperature")
    expect_error(lambda: client.chat(model="tiny", messages=[{"role": "robot", "content": "x"}], stream=False), 400,
                 "role")
    expect_error(lambda: client.generate(model="tiny", prompt="x", template="{{ .Prompt }}"), 400, "template")
    expect_error(lambda: client.generate(model="tiny", prompt="x", raw=True, system="s"), 400, "raw mode")
    # keep_alive as Ollama takes it: a duration, seconds, 0, negative.
    for keep_alive in ("5m", "1h30m", 300, 0, -1, "-1m", 2.5):
        assert client.chat(model="tiny", messages=messages, keep_alive=keep_alive, stream=False,
                           options={**GREEDY, "num_predict": 1}).done
    # The wire: a body sent as curl sends it (no JSON content type), 401, unknown routes, wrong methods.
    curl = post(server, "/api/chat", {"model": "tiny", "messages": messages, "stream": False,
                                      "options": {"num_predict": 2}},
                headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert curl.status_code == 200 and curl.json()["done"] is True
    assert post(server, "/api/chat", "{not json").json()["error"].startswith("the request body is not valid JSON")
    unauthorized = httpx.post(server.url + "/api/chat", json={"model": "tiny", "messages": messages})
    assert unauthorized.status_code == 401 and set(unauthorized.json()) == {"error"}
    assert httpx.get(server.url + "/api/chat", headers=AUTH).status_code == 405
    missing = httpx.get(server.url + "/api/nothing", headers=AUTH)
    assert missing.status_code == 404 and "/api/chat" in missing.json()["error"]
    pull = post(server, "/api/pull", {"model": "llama3"})
    assert pull.status_code == 501 and "model store" in pull.json()["error"]
    empty = post(server, "/api/chat", "")
    assert empty.status_code == 400 and set(empty.json()) == {"error"}


# ---- langchain-ollama ----------------------------------------------------------------------------------

def test_langchain_ollama_chat_and_embeddings(server: Any, client: ollama.Client) -> None:
    from langchain_ollama import ChatOllama, OllamaEmbeddings

    model = ChatOllama(model="tiny", base_url=server.url, temperature=0, num_predict=10,
                       client_kwargs={"headers": AUTH})
    expected = client.chat(model="tiny", messages=[{"role": "user", "content": QUESTION}], stream=False,
                           options={**GREEDY, "num_predict": 10})
    answer = model.invoke(QUESTION)
    assert answer.content == expected.message.content
    assert answer.usage_metadata["input_tokens"] == expected.prompt_eval_count
    assert answer.usage_metadata["output_tokens"] == 10
    assert "".join(chunk.content for chunk in model.stream(QUESTION)) == expected.message.content
    structured = ChatOllama(model="tiny", base_url=server.url, temperature=0, num_predict=100, reasoning=False,
                            client_kwargs={"headers": AUTH})
    result = structured.with_structured_output(SCHEMA, method="json_schema").invoke("Is the sky blue?")
    jsonschema.validate(result, SCHEMA)
    embeddings = OllamaEmbeddings(model="tiny", base_url=server.url, client_kwargs={"headers": AUTH})
    assert embeddings.embed_query("The sky is blue.") == pytest.approx(
        client.embed(model="tiny", input="The sky is blue.").embeddings[0], abs=1e-6)


def test_openapi_documents_the_bodies_and_ollama_errors(server: Any) -> None:
    from openapi_spec_validator import validate

    document = httpx.get(server.url + "/openapi.json", headers=AUTH).json()
    validate(document)
    for path, model in (("/api/chat", "OllamaChatRequest"), ("/api/generate", "OllamaGenerateRequest"),
                        ("/api/embed", "OllamaEmbedRequest"), ("/api/show", "OllamaShowRequest")):
        operation = document["paths"][path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + model)
        error = operation["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
        assert error.endswith("/OllamaErrorResponse") and "422" not in operation["responses"]
    assert {"/api/tags", "/api/ps", "/api/version"} <= set(document["paths"])

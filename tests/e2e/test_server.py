"""The OpenAI-compatible server as clients see it: one real server process per module, driven with
the official ``openai`` package (and httpx for raw bodies). Greedy texts are checked against the
offline ``LLM`` on the same tiny model, the oracle.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from kvloom import SamplingParams

# The server fixtures (server_factory, oracle) live in tests/e2e/conftest.py.
Server = Any
API_KEY = "test-key-123"
SERVED_NAME = "tiny-llama"
PROMPTS = ["The quick brown fox", "Once upon a time", "def fibonacci(n: int)"]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Japan?"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, server_factory: Any) -> Any:
    with server_factory(tiny_llama_dir, "--served-model-name", SERVED_NAME, api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def greedy(max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def post(server: Server, path: str, body: object | str | bytes, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=30,
                      headers={"Content-Type": "application/json", **server.headers, **(headers or {})})


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


# ---- models, health, tokenizer --------------------------------------------------------------

def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [SERVED_NAME]
    assert models[0].owned_by == "kvloom"
    assert client.models.retrieve(SERVED_NAME).id == SERVED_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_health_version_tokenize_detokenize(server: Server, oracle) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version", headers=server.headers).json()["version"]
    tokenizer = oracle.get_tokenizer()
    body = post(server, "/tokenize", {"prompt": "The quick brown fox"}).json()
    assert body["tokens"] == tokenizer.encode("The quick brown fox")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == oracle.llm_engine.max_model_len
    chat = post(server, "/tokenize", {"messages": CHAT}).json()
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert post(server, "/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": "The quick brown fox"}


# ---- completions ----------------------------------------------------------------------------

def test_completion_greedy_matches_llm(client: openai.OpenAI, oracle) -> None:
    expected = oracle.generate(PROMPTS, greedy(ignore_eos=True), use_tqdm=False)
    response = client.completions.create(model=SERVED_NAME, prompt=PROMPTS, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.object == "text_completion" and response.model == SERVED_NAME
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == [o.outputs[0].text for o in expected]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert response.usage.completion_tokens == 36
    assert response.usage.total_tokens == response.usage.prompt_tokens + 36


def test_completion_token_prompts_and_n(client: openai.OpenAI, oracle) -> None:
    ids = [[5, 6, 7, 8], [9, 10]]
    expected = oracle.generate([{"prompt_token_ids": p} for p in ids], greedy(8, ignore_eos=True),
                               use_tqdm=False)
    response = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=8, temperature=0, n=2,
                                         extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    texts = [c.text for c in response.choices]
    assert texts == [expected[0].outputs[0].text] * 2 + [expected[1].outputs[0].text] * 2
    single = client.completions.create(model=SERVED_NAME, prompt=ids[0], max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert single.choices[0].text == texts[0]


def test_completion_stream_joins_to_the_whole_text(client: openai.OpenAI) -> None:
    kwargs = dict(model=SERVED_NAME, prompt=PROMPTS[:2], max_tokens=20, temperature=0, n=2)
    whole = client.completions.create(**kwargs)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for choice in chunk.choices:
            assert choice.index not in finish, "a chunk arrived after its choice's finish_reason"
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert [texts.get(c.index, "") for c in whole.choices] == [c.text for c in whole.choices]
    assert [finish[c.index] for c in whole.choices] == [c.finish_reason for c in whole.choices]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_completion_stream_is_sse_ending_with_done(server: Server) -> None:
    with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers, timeout=30,
                      json={"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] is not None
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_completion_echo_and_logprobs(client: openai.OpenAI, oracle) -> None:
    prompt = "The quick brown fox"
    expected = oracle.generate(prompt, greedy(6, logprobs=3, ignore_eos=True), use_tqdm=False)[0]
    response = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=6, temperature=0,
                                         logprobs=3, echo=True, extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert choice.text == prompt + expected.outputs[0].text
    logprobs = choice.logprobs
    num_prompt = len(expected.prompt_token_ids)
    assert len(logprobs.tokens) == num_prompt + 6
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in logprobs.token_logprobs[1:])
    assert all(1 <= len(top) <= 4 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for got, entry, token_id in zip(logprobs.token_logprobs[num_prompt:], expected.outputs[0].logprobs,
                                    expected.outputs[0].token_ids, strict=True):
        assert got == pytest.approx(entry[token_id].logprob, abs=1e-4)
    # Without echo: only the generated tokens, and the same numbers streamed.
    plain = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=6, temperature=0,
                                      logprobs=2, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(plain.tokens) == 6
    streamed: list[float] = []
    for chunk in client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=6, temperature=0,
                                           logprobs=2, stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == pytest.approx(plain.token_logprobs, abs=1e-5)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_text(client: openai.OpenAI, oracle, stream: bool) -> None:
    base = oracle.generate(PROMPTS[0], greedy(16, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    cut = next(i for i in range(3, len(base)) if base[i].strip())  # a stop that is not whitespace
    stop = base[cut:cut + 2]
    expected = base[:base.index(stop)]
    kwargs = dict(model=SERVED_NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop],
                  extra_body={"ignore_eos": True})
    if stream:
        text, reasons = "", []
        for chunk in client.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                text += choice.text
                reasons.append(choice.finish_reason)
        assert text == expected and reasons[-1] == "stop"
    else:
        choice = client.completions.create(**kwargs).choices[0]
        assert choice.text == expected and choice.finish_reason == "stop"
        assert choice.model_extra.get("stop_reason") == stop


def test_extra_body_sampling_fields(client: openai.OpenAI, oracle) -> None:
    prompt = PROMPTS[1]
    # top_k=1 makes temperature 1 sampling greedy.
    top1 = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=10, temperature=1.0,
                                     extra_body={"top_k": 1, "ignore_eos": True})
    base = oracle.generate(prompt, greedy(10, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert top1.choices[0].text == base.text
    # repetition_penalty and min_p as the offline API applies them.
    penalized = oracle.generate(prompt, greedy(10, ignore_eos=True, repetition_penalty=1.5, min_p=0.1),
                                use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=10, temperature=0,
                                    extra_body={"repetition_penalty": 1.5, "min_p": 0.1, "ignore_eos": True})
    assert got.choices[0].text == penalized.text
    # min_tokens: generation runs to at least min_tokens even past EOS / stop tokens.
    eos_first = client.completions.create(model=SERVED_NAME, prompt=[2], max_tokens=7, temperature=0,
                                          extra_body={"min_tokens": 7, "stop_token_ids": [2, 3, 4]})
    assert eos_first.usage.completion_tokens == 7
    # seeded sampling repeats.
    a, b = (client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=10, temperature=1.0, seed=7,
                                      extra_body={"ignore_eos": True}).choices[0].text for _ in range(2))
    assert a == b


# ---- chat -----------------------------------------------------------------------------------

def test_chat_greedy_matches_llm_chat(client: openai.OpenAI, oracle) -> None:
    expected = oracle.chat(CHAT, greedy(16, ignore_eos=True), use_tqdm=False)[0]
    response = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_completion_tokens=16,
                                              temperature=0, extra_body={"ignore_eos": True})
    assert response.object == "chat.completion"
    message = response.choices[0].message
    assert message.role == "assistant" and message.content == expected.outputs[0].text
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == 16 and response.choices[0].finish_reason == "length"


def test_chat_stream_n2_logprobs(client: openai.OpenAI) -> None:
    kwargs = dict(model=SERVED_NAME, messages=CHAT, max_tokens=12, temperature=0, n=2, logprobs=True,
                  top_logprobs=2)
    whole = client.chat.completions.create(**kwargs)
    assert len(whole.choices) == 2
    for choice in whole.choices:
        content = choice.logprobs.content
        assert len(content) == whole.usage.completion_tokens // 2
        for entry in content:
            assert len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= -9999
            assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6
    texts = {0: "", 1: ""}
    roles = set()
    usage = None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.delta.role)
            texts[choice.index] += choice.delta.content or ""
    assert roles == {"assistant"}
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert usage is not None and usage.total_tokens == whole.usage.total_tokens


# ---- errors ---------------------------------------------------------------------------------

def _prompt_of(num_tokens: int) -> list[int]:
    return [5] * num_tokens


ERROR_CASES = [
    # (path, body, status, param)
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", "[1, 2, 3]", 400, None),
    ("/v1/completions", "", 400, None),
    ("/v1/completions", {"model": SERVED_NAME}, 400, "prompt"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": [1, 10 ** 6]}, 400, "prompt"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": [[1], [-1]]}, 400, "prompt"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 10 ** 30}, 400, "max_tokens"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1e999}', 400, "max_tokens"),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "n": 10 ** 9}, 400, "n"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "logprobs": 10 ** 6}, 400, "logprobs"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "seed": 2 ** 80}, 400, "seed"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "presence_penalty": 5}, 400,
     "presence_penalty"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "stop": 7}, 400, "stop"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "repetition_penalty": 0}, 400,
     "repetition_penalty"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "min_tokens": 50, "max_tokens": 5}, 400,
     "min_tokens"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "stop_token_ids": [10 ** 7]}, 400,
     "stop_token_ids"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions", {"model": SERVED_NAME}, 400, "messages"),
    ("/v1/chat/completions", {"model": SERVED_NAME, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": SERVED_NAME, "messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"model": SERVED_NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"model": SERVED_NAME, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"model": SERVED_NAME, "messages": [{"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": SERVED_NAME, "messages": CHAT, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"model": SERVED_NAME, "messages": CHAT, "logprobs": True, "top_logprobs": 99},
     400, "top_logprobs"),
    ("/v1/chat/completions", {"model": SERVED_NAME, "messages": CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {"model": SERVED_NAME, "messages": CHAT, "tools": [{"type": "function"}]},
     400, "tools"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": CHAT}, 404, "model"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, 400, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), ERROR_CASES,
                         ids=[f"{p}-{i}" for i, (p, *_rest) in enumerate(ERROR_CASES)])
def test_bad_requests_get_openai_errors(server: Server, path: str, body: object, status: int,
                                        param: str | None) -> None:
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert isinstance(error["message"], str) and error["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_context_length_error_gives_the_numbers(server: Server, client: openai.OpenAI, oracle,
                                                path: str) -> None:
    max_model_len = oracle.llm_engine.max_model_len
    if path == "/v1/completions":
        num_prompt, requested = 100, max_model_len - 50
        call = lambda: client.completions.create(model=SERVED_NAME, prompt=_prompt_of(num_prompt),  # noqa: E731
                                                 max_tokens=requested)
    else:
        rendered = oracle.get_tokenizer().apply_chat_template(CHAT, add_generation_prompt=True)
        num_prompt = len(oracle.get_tokenizer().encode(rendered, add_special_tokens=False))
        requested = max_model_len
        call = lambda: client.chat.completions.create(model=SERVED_NAME, messages=CHAT,  # noqa: E731
                                                      max_completion_tokens=requested)
    with pytest.raises(openai.BadRequestError) as info:
        call()
    error = info.value.body
    assert info.value.status_code == 400
    message = error["message"]
    for number in (max_model_len, num_prompt, requested, num_prompt + requested):
        assert str(number) in message, message
    assert error["code"] == "context_length_exceeded"
    # A prompt that alone is too long, with no max_tokens given.
    response = post(server, "/v1/chat/completions",
                    {"model": SERVED_NAME, "messages": [{"role": "user", "content": "fox " * max_model_len}]})
    assert response.status_code == 400 and str(max_model_len) in response.json()["error"]["message"]


def test_api_key_is_required_on_v1(server: Server) -> None:
    body = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2}
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"},
                    {"Authorization": f"Basic {API_KEY}"}):
        response = httpx.post(server.url + "/v1/completions", json=body, headers=headers)
        assert response.status_code == 401
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/models", headers=server.headers).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    # /health and /metrics stay open (without --metrics-require-key), as vLLM's; the rest needs the
    # key (tests/e2e/test_server_limits.py goes through every route).
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.get(server.url + "/version").status_code == 401


def test_unknown_routes_and_methods_use_the_error_shape(server: Server) -> None:
    response = httpx.get(server.url + "/no/such/route", headers=server.headers)
    assert response.status_code == 404 and "error" in response.json()
    response = httpx.get(server.url + "/v1/completions", headers=server.headers)
    assert response.status_code == 405 and "error" in response.json()


def test_the_server_survives_abuse(server: Server, client: openai.OpenAI) -> None:
    """Garbage and cut-off requests leave it serving."""
    import socket

    for raw in (b"GET / HTTP/1.1\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1000\r\n\r\n{",
                b"\x00\xff garbage\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(raw)
    deep = "[" * 100_000 + "]" * 100_000
    assert post(server, "/v1/completions", deep).status_code == 400
    assert post(server, "/v1/completions", '{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}").status_code == 400
    response = client.completions.create(model=SERVED_NAME, prompt="still alive?", max_tokens=3)
    assert response.choices[0].finish_reason in ("stop", "length")
    assert httpx.get(server.url + "/health").status_code == 200


# ---- the OpenAPI document -------------------------------------------------------------------

# Each route with a JSON body: its request model, a body of the wrong type, and the field it names.
BODY_ROUTES = [("/v1/completions", "CompletionRequest", {"prompt": 5}, "prompt"),
               ("/v1/chat/completions", "ChatCompletionRequest", {"messages": "hi"}, "messages"),
               ("/tokenize", "TokenizeRequest", {"prompt": ["hi"]}, "prompt"),
               ("/detokenize", "DetokenizeRequest", {"tokens": "1 2"}, "tokens")]


@pytest.fixture(scope="module")
def openapi(server: Server) -> dict:
    response = httpx.get(server.url + "/openapi.json", headers=server.headers)
    assert response.status_code == 200, response.text
    return response.json()


def _resolve(document: dict, ref: str) -> dict:
    assert ref.startswith("#/"), ref
    node = document
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def _refs(node: object) -> list[str]:
    if isinstance(node, dict):
        return [ref for key, value in node.items() for ref in ([value] if key == "$ref" else _refs(value))]
    if isinstance(node, list):
        return [ref for item in node for ref in _refs(item)]
    return []


@pytest.mark.parametrize(("path", "model", "bad_body", "param"), BODY_ROUTES, ids=[r[0] for r in BODY_ROUTES])
def test_openapi_documents_each_request_body_as_its_model(openapi: dict, path: str, model: str,
                                                          bad_body: dict, param: str) -> None:
    from kvloom.entrypoints.openai import protocol

    body = openapi["paths"][path]["post"]["requestBody"]
    assert body["required"] is True and list(body["content"]) == ["application/json"]
    ref = body["content"]["application/json"]["schema"]["$ref"]
    assert ref == f"#/components/schemas/{model}"
    schema = _resolve(openapi, ref)
    # The documented fields are those of the model the server validates the body with.
    request_model = getattr(protocol, model)
    assert set(schema["properties"]) == set(request_model.model_fields)
    assert set(schema.get("required", [])) == {name for name, field in request_model.model_fields.items()
                                               if field.is_required()}


def test_openapi_names_the_fields_clients_send(openapi: dict) -> None:
    schemas = openapi["components"]["schemas"]
    completion, chat = schemas["CompletionRequest"], schemas["ChatCompletionRequest"]
    assert {"prompt", "max_tokens", "temperature", "stream", "logprobs"} <= set(completion["properties"])
    assert completion["required"] == ["prompt"]
    assert {"messages", "max_tokens", "max_completion_tokens"} <= set(chat["properties"])
    assert chat["required"] == ["messages"]
    assert {"prompt", "messages"} <= set(schemas["TokenizeRequest"]["properties"])
    assert schemas["DetokenizeRequest"]["required"] == ["tokens"]
    # A nested model is a component of its own, referenced from the request.
    stream_options = completion["properties"]["stream_options"]
    assert "#/components/schemas/StreamOptions" in _refs(stream_options)


def test_openapi_document_is_valid_and_never_promises_a_422(openapi: dict) -> None:
    assert openapi["openapi"].startswith("3.")
    for ref in _refs(openapi):
        _resolve(openapi, ref)  # every reference resolves
    for path, operations in openapi["paths"].items():
        for method, operation in operations.items():
            assert "422" not in operation["responses"], (method, path)
    for path, *_ in BODY_ROUTES:
        responses = openapi["paths"][path]["post"]["responses"]
        assert {"400", "413", "415"} <= set(responses)
    try:
        from openapi_spec_validator import validate
    except ImportError:  # an optional test dependency
        return
    validate(openapi)


@pytest.mark.parametrize(("path", "model", "bad_body", "param"), BODY_ROUTES, ids=[r[0] for r in BODY_ROUTES])
def test_a_body_against_the_documented_schema_is_an_openai_400(server: Server, openapi: dict, path: str,
                                                               model: str, bad_body: dict, param: str) -> None:
    response = post(server, path, bad_body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    # The error is the documented 400 body: ErrorResponse's one field, holding ErrorInfo's fields.
    documented = openapi["paths"][path]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    error_response = _resolve(openapi, documented["$ref"])
    assert set(response.json()) == set(error_response["properties"])
    assert set(error) == set(openapi["components"]["schemas"]["ErrorInfo"]["properties"])


# ---- metrics --------------------------------------------------------------------------------

def test_metrics_parse_and_counters_move(server: Server, client: openai.OpenAI) -> None:
    before = server.wait_idle()
    for name in ("kvloom:num_requests_running", "kvloom:num_requests_waiting", "kvloom:kv_cache_usage_perc",
                 "kvloom:prefix_cache_queries_total", "kvloom:prefix_cache_hits_total",
                 "kvloom:prompt_tokens_total", "kvloom:generation_tokens_total",
                 "kvloom:num_preemptions_total", "kvloom:time_to_first_token_seconds_count",
                 "kvloom:inter_token_latency_seconds_count", "kvloom:e2e_request_latency_seconds_count",
                 "kvloom:request_queue_time_seconds_count"):
        assert name in before, name
    client.completions.create(model=SERVED_NAME, prompt=PROMPTS, max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = server.wait_idle()
    assert after["kvloom:generation_tokens_total"] - before["kvloom:generation_tokens_total"] == 15
    assert after["kvloom:prompt_tokens_total"] > before["kvloom:prompt_tokens_total"] or (
        after["kvloom:prefix_cache_hits_total"] > before["kvloom:prefix_cache_hits_total"])
    assert after["kvloom:prefix_cache_queries_total"] > before["kvloom:prefix_cache_queries_total"]
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert after[f"kvloom:{name}_count"] - before[f"kvloom:{name}_count"] == 3
    assert after["kvloom:inter_token_latency_seconds_count"] - before["kvloom:inter_token_latency_seconds_count"] == 12
    assert after["kvloom:request_success_total[length]"] - before["kvloom:request_success_total[length]"] == 3
    assert after["kvloom:kv_cache_usage_perc"] == 0.0


def test_metrics_name_the_cpu_and_its_isa_level(server: Server) -> None:
    from kvloom.cpu_capability import cpu_capability

    text = httpx.get(server.url + "/metrics").text
    line = next(line for line in text.splitlines() if line.startswith("kvloom:cpu_info{"))
    capability = cpu_capability()
    assert f'isa_level="{capability.level}"' in line and f'isa_detected="{capability.detected}"' in line
    assert line.endswith(" 1.0")


def test_request_log_lines(server: Server, client: openai.OpenAI) -> None:
    client.completions.create(model=SERVED_NAME, prompt="log me", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    server.wait_idle()
    log = server.log()
    assert "Finished request cmpl-" in log and "output 3 tokens" in log and "latency" in log


# ---- a dead engine --------------------------------------------------------------------------

def test_a_dead_engine_fails_requests_and_health(tiny_llama_dir: str) -> None:
    """In process: a step that raises kills the engine; requests get 503 and /health turns 503."""
    import argparse

    from kvloom.config import EngineConfig
    from kvloom.engine.async_engine import AsyncLLM, EngineDeadError
    from kvloom.entrypoints.openai.api_server import build_app

    engine = AsyncLLM.from_config(EngineConfig(model=tiny_llama_dir), stats_interval=0)

    def broken_step():
        raise RuntimeError("simulated device failure")

    engine.engine.step = broken_step  # type: ignore[method-assign]
    args = argparse.Namespace(model=tiny_llama_dir, served_model_name=None, chat_template=None, api_key=None)
    app = build_app(engine, args)

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            assert (await http.get("/health")).status_code == 200
            response = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
            assert (await http.get("/health")).status_code == 503
            response = await http.post("/v1/chat/completions", json={"messages": CHAT})
            assert response.status_code == 503
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("hi", SamplingParams(max_tokens=2), "late"):
                pass

    try:
        asyncio.run(run())
        assert engine.errored
    finally:
        engine.shutdown()


def test_api_key_from_the_environment(tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """KVLOOM_API_KEY works like --api-key (in process, through the ASGI app)."""
    import argparse

    from kvloom.config import EngineConfig
    from kvloom.engine.async_engine import AsyncLLM
    from kvloom.entrypoints.openai.api_server import build_app

    monkeypatch.setenv("KVLOOM_API_KEY", "from-env")
    engine = AsyncLLM.from_config(EngineConfig(model=tiny_llama_dir), stats_interval=0)
    args = argparse.Namespace(model=tiny_llama_dir, served_model_name=None, chat_template=None, api_key=None)
    app = build_app(engine, args)

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            assert (await http.get("/v1/models")).status_code == 401
            assert (await http.get("/v1/models", headers={"Authorization": "Bearer nope"})).status_code == 401
            ok = await http.get("/v1/models", headers={"Authorization": "Bearer from-env"})
            assert ok.status_code == 200 and ok.json()["data"][0]["id"] == tiny_llama_dir

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


def test_async_engine_is_built_on_the_thread_that_steps_it(tiny_llama_dir: str) -> None:
    """One thread loads and steps the model (two OpenMP pools would slow every parallel region),
    and an engine that cannot be built fails the constructor with the build's error."""
    import threading

    from kvloom.config import EngineConfig
    from kvloom.engine.async_engine import AsyncLLM
    from kvloom.engine.llm_engine import LLMEngine

    threads = []

    def build() -> LLMEngine:
        threads.append(threading.current_thread())
        return LLMEngine(EngineConfig(model=tiny_llama_dir))

    engine = AsyncLLM(build, stats_interval=0)
    try:
        assert threads == [engine._thread] and threads[0] is not threading.current_thread()

        async def run() -> list[int]:
            async for output in engine.generate("hi", SamplingParams(max_tokens=3, ignore_eos=True), "r"):
                last = output
            return last.outputs[0].token_ids

        assert len(asyncio.run(run())) == 3
    finally:
        engine.shutdown()
    config = EngineConfig(model=tiny_llama_dir + "-missing")
    with pytest.raises(ValueError, match="is neither a directory"):
        AsyncLLM.from_config(config, stats_interval=0)

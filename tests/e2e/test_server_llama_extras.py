"""llama-server's extras on kvloom's server: fill-in-the-middle (``suffix`` on /v1/completions and ``/infill``),
prompt-cache hits in every API's usage and llama-server's ``timings``, ``prompt_progress`` while a long prompt is
prefilled, and vLLM's CORS flags.

The served model is the tiny Llama with Qwen2.5-Coder's six FIM tokens added to its vocabulary (found by their
spellings, as llama.cpp finds them). The server runs with 32-token steps so a prompt of a hundred tokens is
prefilled in several chunks; block size 16, so a repeated prompt of P tokens hits (P - 1) // 16 * 16 of them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
import tiny_models

from kvloom.entrypoints.openai.fim import FimTokens, format_prompt_infill
from kvloom.loader.tokenizer import load_tokenizer
from kvloom.loader.weights import resolve_model

QWEN_FIM_TOKENS = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
                   "<|file_sep|>"]
STEP_TOKENS = 32
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def fim_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama, its vocabulary six tokens longer: Qwen2.5-Coder's FIM tokens as added special tokens."""
    from tokenizers import Tokenizer

    path = str(tmp_path_factory.mktemp("tiny_fim"))
    base = tiny_models.train_tokenizer().get_vocab_size(with_added_tokens=True)
    tiny_models.build_tiny_checkpoint(path, vocab_size=base + len(QWEN_FIM_TOKENS))
    tokenizer = Tokenizer.from_file(f"{path}/tokenizer.json")
    tokenizer.add_special_tokens(QWEN_FIM_TOKENS)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == base + len(QWEN_FIM_TOKENS)
    tokenizer.save(f"{path}/tokenizer.json")
    return path


@pytest.fixture(scope="module")
def server(fim_model_dir: str, server_factory: Any) -> Iterator[Any]:
    with server_factory(fim_model_dir, "--max-model-len", "512", "--served-model-name", "tiny",
                        "--max-num-batched-tokens", str(STEP_TOKENS)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def unique_text(words: int) -> str:
    """Text no other request shares a block with: a fresh id first."""
    return f"{uuid.uuid4().hex} " + " ".join(f"word{i} and the lazy dog" for i in range(words))


def block_hit(num_prompt_tokens: int) -> int:
    """The prefix cache's hit on a prompt of this many tokens whose every block is cached: whole blocks, the last
    token always computed."""
    return (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


# ---- fill in the middle ----------------------------------------------------------------------------

PREFIX = "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    "
SUFFIX = "\nfor i in range(10):\n    print(i, fibonacci(i))\n"


def expected_prompt(model_dir: str, prefix: str, suffix: str, extra: list[dict[str, str]], prompt: str) -> list[int]:
    """The prompt llama-server would build (fim.format_prompt_infill, pinned against llama.cpp's algorithm by
    tests/unit/test_fim.py) with its defaults and this server's context."""
    tokenizer = load_tokenizer(resolve_model(model_dir))
    return format_prompt_infill(tokenizer, FimTokens.of(tokenizer), prefix, suffix, extra, 2048, -1, 512, False,
                                tokenizer.encode(prompt, add_special_tokens=False))


def fim_stop_ids(model_dir: str) -> list[int]:
    return FimTokens.of(load_tokenizer(resolve_model(model_dir))).end_of_generation_ids


def test_suffix_completes_the_fim_prompt(client: openai.OpenAI, fim_model_dir: str) -> None:
    """OpenAI's suffix: the completion of the prefix-suffix-middle prompt, token for token."""
    ids = expected_prompt(fim_model_dir, PREFIX, SUFFIX, [], "")
    tokenizer = load_tokenizer(resolve_model(fim_model_dir))
    # A 512-token context leaves llama-server's extra budget (n_ctx - n_batch - 2 * n_predict) empty: the prompt
    # starts at the prefix token.
    assert ids[0] == tokenizer.token_to_id("<|fim_prefix|>") and ids[-1] == tokenizer.token_to_id("<|fim_middle|>")
    assert ids.count(tokenizer.token_to_id("<|fim_suffix|>")) == 1
    filled = client.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=12, temperature=0)
    oracle = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0,
                                       extra_body={"stop_token_ids": fim_stop_ids(fim_model_dir)})
    assert filled.choices[0].text == oracle.choices[0].text
    assert filled.usage.prompt_tokens == len(ids) == oracle.usage.prompt_tokens


def test_infill_answers_as_llama_server(server: Any, client: openai.OpenAI, fim_model_dir: str) -> None:
    """/infill: input_extra, prompt, n_predict; llama-server's completion object, whole and streamed."""
    extra = [{"filename": "utils.py", "text": "The quick brown fox jumps over the lazy dog.\n"}]
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": extra, "prompt": "if n",
            "n_predict": 10, "temperature": 0}
    ids = expected_prompt(fim_model_dir, PREFIX, SUFFIX, extra, "if n")
    oracle = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0,
                                       extra_body={"stop_token_ids": fim_stop_ids(fim_model_dir)})
    whole = httpx.post(server.url + "/infill", json=body, timeout=120)
    assert whole.status_code == 200, whole.text
    answer = whole.json()
    assert answer["content"] == oracle.choices[0].text and answer["stop"] is True
    assert answer["tokens_evaluated"] == len(ids) and answer["tokens_predicted"] == len(answer["tokens"])
    assert answer["stop_type"] == {"length": "limit", "stop": "eos"}[oracle.choices[0].finish_reason]
    assert answer["timings"]["predicted_n"] == answer["tokens_predicted"]

    with httpx.stream("POST", server.url + "/infill", json={**body, "stream": True}, timeout=120) as response:
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == answer["content"]
    assert sum((e["tokens"] for e in events), []) == answer["tokens"]
    assert events[-1]["timings"]["predicted_n"] == answer["tokens_predicted"]

    body = {**body, "input_prefix": "x = 1\n" * 20, "stream": True, "return_progress": True}
    with httpx.stream("POST", server.url + "/infill", json=body, timeout=120) as response:
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    total, cache = events[-1]["tokens_evaluated"], progress[0]["cache"]
    assert total > cache + STEP_TOKENS
    assert_chunk_boundaries([p["processed"] for p in progress], cache, total)


def test_infill_bad_bodies_are_400s(server: Any) -> None:
    for body, words in [({"input_suffix": ""}, "input_prefix"),
                        ({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"filename": "x"}]}, '"text"'),
                        ({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"text": "x", "filename": 1}]},
                         '"filename"'),
                        ({"input_prefix": "a", "input_suffix": "b", "n": 2}, "n must be 1")]:
        response = httpx.post(server.url + "/infill", json=body, timeout=30)
        assert response.status_code == 400 and words in response.json()["error"]["message"], response.text


# ---- cached tokens and timings ----------------------------------------------------------------------

def test_cached_tokens_in_completions_and_chat(client: openai.OpenAI) -> None:
    """A repeated prompt: usage.prompt_tokens_details.cached_tokens and timings.cache_n are the block-aligned hit."""
    prompt = unique_text(12)
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    num_prompt = second.usage.prompt_tokens
    assert num_prompt > 2 * BLOCK_SIZE
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == block_hit(num_prompt) > 0
    timings = second.model_extra["timings"]
    assert timings["cache_n"] == block_hit(num_prompt) and timings["prompt_n"] == num_prompt - timings["cache_n"]
    assert timings["predicted_n"] == second.usage.completion_tokens and timings["prompt_ms"] > 0

    messages = [{"role": "user", "content": unique_text(12)}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == block_hit(again.usage.prompt_tokens) > 0
    assert again.model_extra["timings"]["cache_n"] == block_hit(again.usage.prompt_tokens)

    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == block_hit(again.usage.prompt_tokens)
    assert chunks[-1].model_extra["timings"]["predicted_n"] == chunks[-1].usage.completion_tokens
    assert all("timings" not in (c.model_extra or {}) for c in chunks[:-1])


def test_cached_tokens_in_responses_and_messages(server: Any) -> None:
    responses = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    text = unique_text(12)
    responses.responses.create(model="tiny", input=text, max_output_tokens=3, temperature=0, store=False)
    again = responses.responses.create(model="tiny", input=text, max_output_tokens=3, temperature=0, store=False)
    assert again.usage.input_tokens_details.cached_tokens == block_hit(again.usage.input_tokens) > 0

    messages = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    conversation = [{"role": "user", "content": unique_text(12)}]
    first = messages.messages.create(model="tiny", max_tokens=3, messages=conversation,
                                     extra_body={"temperature": 0})
    second = messages.messages.create(model="tiny", max_tokens=3, messages=conversation,
                                     extra_body={"temperature": 0})
    num_prompt = messages.messages.count_tokens(model="tiny", messages=conversation).input_tokens
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == num_prompt
    assert second.usage.cache_read_input_tokens == block_hit(num_prompt) > 0
    assert second.usage.input_tokens == num_prompt - block_hit(num_prompt)
    with messages.messages.stream(model="tiny", max_tokens=3, messages=conversation,
                                     extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message()
    assert streamed.usage.cache_read_input_tokens == block_hit(num_prompt)


# ---- progress during a long prefill -----------------------------------------------------------------

def assert_chunk_boundaries(processed: list[int], cache: int, total: int) -> None:
    """Progress after prefill chunks of STEP_TOKENS from the cached tokens on, ending at the whole prompt. Outputs that
    pile up while the stream's reader is busy are merged (engine_client.py), the newest progress kept: so a chunk's
    event may be folded into a later one, never reordered or invented."""
    boundaries = [*range(cache + STEP_TOKENS, total, STEP_TOKENS), total]
    assert processed and processed[-1] == total and processed == sorted(set(processed)), processed
    assert set(processed) <= set(boundaries), (processed, boundaries)


def test_prompt_progress_after_each_prefill_chunk(client: openai.OpenAI) -> None:
    prompt = unique_text(20)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, stream=True,
                                            extra_body={"return_progress": True, "timings_per_token": True}))
    progress = [c.model_extra["prompt_progress"] for c in chunks if "prompt_progress" in c.model_extra]
    total = progress[0]["total"]
    assert total > 3 * STEP_TOKENS and all(p["total"] == total and p["cache"] == 0 for p in progress)
    assert_chunk_boundaries([p["processed"] for p in progress], 0, total)
    times = [p["time_ms"] for p in progress]
    assert times == sorted(times)
    text_chunks = [c for c in chunks if c.choices and c.choices[0].text]
    assert text_chunks and all("timings" in c.model_extra for c in text_chunks)

    # A repeat: the cached blocks are counted and only the rest is prefilled.
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=2, temperature=0, stream=True,
        extra_body={"return_progress": True}))
    progress = [c.model_extra["prompt_progress"] for c in chunks if "prompt_progress" in c.model_extra]
    assert_chunk_boundaries([p["processed"] for p in progress], progress[0]["cache"], progress[-1]["total"])
    assert all(c.choices[0].delta.role == "assistant" for c in chunks if "prompt_progress" in c.model_extra)
    repeat = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=2, temperature=0, stream=True,
        extra_body={"return_progress": True}))
    again = [c.model_extra["prompt_progress"] for c in repeat if "prompt_progress" in c.model_extra]
    assert again[0]["cache"] == block_hit(again[0]["total"]) > 0
    assert_chunk_boundaries([p["processed"] for p in again], again[0]["cache"], again[0]["total"])

    plain = list(client.completions.create(model="tiny", prompt=unique_text(20), max_tokens=2, stream=True))
    assert all("prompt_progress" not in c.model_extra for c in plain)
    assert "timings" in plain[-1].model_extra and all("timings" not in c.model_extra for c in plain[:-1])


# ---- in process: no FIM tokens, CORS ----------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_engine(tiny_llama_dir: str) -> Iterator[Any]:
    """An engine on the tiny Llama without FIM tokens, for apps built in process."""
    from kvloom.config import EngineConfig
    from kvloom.engine.async_engine import AsyncLLM

    engine = AsyncLLM.from_config(EngineConfig(model=tiny_llama_dir, max_model_len=256), stats_interval=0)
    yield engine
    engine.shutdown()


def _serve(engine: Any, requests: list[tuple[str, str, dict[str, Any]]], *flags: str) -> list[httpx.Response]:
    """Each (method, path, kwargs) against build_app(engine, flags), in process."""
    from kvloom.entrypoints.openai.api_server import build_app
    from kvloom.entrypoints.openai.args import add_server_args

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = parser.parse_args(["--model", "tiny", *flags])

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=build_app(engine, args))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return [await http.request(method, path, **kwargs) for method, path, kwargs in requests]

    return asyncio.run(run())


def test_a_model_without_fim_tokens_is_a_400(plain_engine: Any) -> None:
    infill, suffix = _serve(plain_engine, [
        ("POST", "/infill", {"json": {"input_prefix": "def f(", "input_suffix": "):\n"}}),
        ("POST", "/v1/completions", {"json": {"prompt": "def f(", "suffix": "):\n", "max_tokens": 2}})])
    for response, param in ((infill, "input_prefix"), (suffix, "suffix")):
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["message"].startswith("Infill is not supported by this model: prefix token is missing. "
                                           "suffix token is missing. middle token is missing.")
        assert error["param"] == param and error["code"] == "infill_not_supported"


PREFLIGHT = {"headers": {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                         "Access-Control-Request-Headers": "authorization,content-type"}}
SIMPLE = {"headers": {"Origin": "https://app.example", "Authorization": "Bearer k"}}


def test_no_cors_headers_without_the_flags(plain_engine: Any) -> None:
    preflight, simple = _serve(plain_engine, [("OPTIONS", "/v1/completions", PREFLIGHT), ("GET", "/v1/models", SIMPLE)])
    assert preflight.status_code == 405
    for response in (preflight, simple):
        assert not any(name.startswith("access-control-") for name in response.headers)
    assert simple.status_code == 200


def test_cors_with_vllms_flags(plain_engine: Any) -> None:
    flags = ("--allowed-origins", '["https://app.example"]', "--allowed-methods", '["GET", "POST"]',
             "--allowed-headers", '["authorization", "content-type"]', "--allow-credentials", "--api-key", "k")
    preflight, simple, other, unauthorized = _serve(plain_engine, [
        ("OPTIONS", "/v1/completions", PREFLIGHT), ("GET", "/v1/models", SIMPLE),
        ("OPTIONS", "/v1/completions", {"headers": {**PREFLIGHT["headers"], "Origin": "https://evil.example"}}),
        ("GET", "/v1/models", {"headers": {"Origin": "https://app.example"}})], *flags)
    assert preflight.status_code == 200, preflight.text  # answered before the API key is asked for
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    assert set(preflight.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST"}
    assert preflight.headers["access-control-allow-credentials"] == "true"
    assert simple.status_code == 200 and simple.headers["access-control-allow-origin"] == "https://app.example"
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert unauthorized.status_code == 401  # CORS does not open the API
    assert unauthorized.headers["access-control-allow-origin"] == "https://app.example"

    wildcard, = _serve(plain_engine, [("GET", "/v1/models", SIMPLE)], "--allowed-origins", '["*"]')
    assert wildcard.headers["access-control-allow-origin"] == "*"


def test_cors_flags_take_json_lists() -> None:
    from kvloom.entrypoints.openai.args import add_server_args

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert parser.parse_args(["--model", "m", "--allowed-origins", '["*"]']).allowed_origins == ["*"]
    for bad in ("*", '{"a": 1}', "[1]"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--model", "m", "--allowed-origins", bad])

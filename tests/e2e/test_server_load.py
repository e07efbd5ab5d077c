"""The server under concurrent load, dropped clients and SIGTERM.

One server process for the module (no API key: KVLOOM_API_KEY is unset for it); the SIGTERM test
starts its own.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from kvloom import SamplingParams

NUM_CONCURRENT = 32
SUBJECTS = ["foxes", "robots", "Paris", "libraries", "the sun", "numbers", "Zürich", "emoji",
            "dogs", "stories", "code", "Tokyo"]


def conversation(i: int) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": f"Tell me about {SUBJECTS[i % len(SUBJECTS)]} ({i})."}]
    if i % 3 == 0:
        messages.insert(0, {"role": "system", "content": f"You are assistant number {i}."})
    return messages


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, server_factory: Any) -> Any:
    with server_factory(tiny_llama_dir, "--stats-interval", "1", env={"KVLOOM_API_KEY": ""}) as s:
        yield s


def test_concurrent_streaming_chats_match_llm_greedy(server: Any, oracle: Any) -> None:
    """32 streamed chats at once all complete, each with the text LLM.chat gives under greedy."""
    conversations = [conversation(i) for i in range(NUM_CONCURRENT)]
    max_tokens = [8 + (i * 5) % 17 for i in range(NUM_CONCURRENT)]  # ragged: requests leave mid-batch
    expected = oracle.chat(conversations, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                                           for m in max_tokens], use_tqdm=False)
    before = server.wait_idle()

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
        stream = await client.chat.completions.create(
            model=server.model, messages=conversations[i], max_tokens=max_tokens[i], temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, finish, tokens = "", None, 0
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, finish, tokens

    async def run() -> list[tuple[str, str | None, int]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_CONCURRENT)))

    start = time.perf_counter()
    results = asyncio.run(run())
    elapsed = time.perf_counter() - start
    for i, (text, finish, tokens) in enumerate(results):
        assert text == expected[i].outputs[0].text, f"request {i}"
        assert finish == "length" and tokens == max_tokens[i], f"request {i}"
    after = server.wait_idle()
    assert after["kvloom:kv_cache_usage_perc"] == 0.0
    assert (after["kvloom:time_to_first_token_seconds_count"]
            - before["kvloom:time_to_first_token_seconds_count"]) == NUM_CONCURRENT
    assert (after["kvloom:generation_tokens_total"] - before["kvloom:generation_tokens_total"]
            == sum(max_tokens))
    assert elapsed < 60


def _stream_then_drop(server: Any, path: str, body: dict[str, Any], num_events: int) -> None:
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.url + path, json=body) as response:
            assert response.status_code == 200
            events = 0
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events == num_events:
                        break
        # Leaving the block closes the connection mid-stream.


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_dropped_stream_is_aborted_and_frees_its_blocks(server: Any, path: str) -> None:
    before = server.wait_idle()
    max_tokens = 400
    body: dict[str, Any] = {"model": server.model, "max_tokens": max_tokens, "stream": True,
                            "temperature": 0, "ignore_eos": True}
    if path == "/v1/completions":
        body["prompt"] = ["Once upon a time", "The quick brown fox"]  # two requests behind one stream
    else:
        body["messages"] = conversation(1)
    _stream_then_drop(server, path, body, num_events=4)
    after = server.wait_idle(timeout=10)
    num_requests = 2 if path == "/v1/completions" else 1
    assert after["kvloom:kv_cache_usage_perc"] == 0.0
    assert after["kvloom:request_success_total[abort]"] - before["kvloom:request_success_total[abort]"] == (
        num_requests)
    generated = after["kvloom:generation_tokens_total"] - before["kvloom:generation_tokens_total"]
    assert generated < num_requests * max_tokens  # stopped early, not run to the end
    assert "Aborted request" in server.log()


def test_dropped_non_streaming_request_is_aborted(server: Any) -> None:
    before = server.wait_idle()
    # 32 completions of 480 tokens: far more work than the client's 0.1 s patience, however fast
    # the machine (one completion of the tiny model alone can finish inside 0.3 s).
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", timeout=0.1,
                   json={"model": server.model, "prompt": "Hello", "max_tokens": 480, "n": 32,
                         "ignore_eos": True})
    after = server.wait_idle(timeout=10)
    assert after["kvloom:kv_cache_usage_perc"] == 0.0
    assert after["kvloom:request_success_total[abort]"] - before["kvloom:request_success_total[abort]"] == 1


def test_periodic_engine_log_line(server: Any) -> None:
    deadline = time.monotonic() + 5
    while "Engine: running" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(line for line in server.log().splitlines() if "Engine: running" in line)
    for part in ("waiting", "KV cache usage", "tokens/s"):
        assert part in line


def test_sigterm_finishes_in_flight_requests_then_exits(tiny_llama_dir: str, server_factory: Any) -> None:
    # A drain long enough for 450 tokens on a loaded 2-core CI machine (the default 20 s cut the request short
    # once, with other jobs running beside the suite); the bound itself: test_server_limits.py.
    with server_factory(tiny_llama_dir, "--shutdown-timeout", "120") as server:
        result: dict[str, Any] = {}

        def stream() -> None:
            body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 450, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
            events = []
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        if len(events) == 1:
                            result["started"] = True
            result["events"] = events

        thread = threading.Thread(target=stream)
        thread.start()
        deadline = time.monotonic() + 20
        while "started" not in result and time.monotonic() < deadline:
            time.sleep(0.01)
        server.process.send_signal(signal.SIGTERM)
        thread.join(60)
        assert server.process.wait(30) == 0
        events = result["events"]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 450  # the in-flight request ran to its end
        assert "Waiting for connections to close" in server.log()  # it was in flight at SIGTERM
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/health", timeout=2)
        assert "kvloom server stopped" in server.log()

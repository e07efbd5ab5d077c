"""The server's bounds on what a client may send (issue 11): the API key on every route, JSON
bodies only, a body-size limit, a character cap checked before tokenizing, --max-logprobs, n
within max_num_seqs, and a SIGTERM drain bounded by --shutdown-timeout.

One real server process for the module (an API key, /metrics behind it, max_num_seqs 4,
max_logprobs 5); the shutdown tests start their own.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest

API_KEY = "limits-key"
MAX_NUM_SEQS = 4
MAX_LOGPROBS = 5
BODY_LIMIT = 8 << 20  # the default --max-request-body-bytes


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, server_factory: Any) -> Any:
    with server_factory(tiny_llama_dir, "--max-num-seqs", str(MAX_NUM_SEQS), "--max-logprobs",
                        str(MAX_LOGPROBS), "--metrics-require-key", api_key=API_KEY) as s:
        yield s


def post(server: Any, path: str, body: object, headers: dict | None = None, timeout: float = 30) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=timeout,
                      headers={"Content-Type": "application/json", **server.headers, **(headers or {})})


def assert_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error
    return error


# ---- 1. the API key ------------------------------------------------------------------------------

ROUTES = [("GET", "/v1/models", None), ("GET", "/v1/models/x", None), ("GET", "/version", None),
          ("GET", "/metrics", None), ("GET", "/openapi.json", None), ("GET", "/no/such/route", None),
          ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
          ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
          ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]})]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[r[1] for r in ROUTES])
def test_every_route_but_health_needs_the_key(server: Any, method: str, path: str, body: Any) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.request(method, server.url + path, json=body, headers=headers, timeout=30)
        assert assert_error(response, 401, "API key")["code"] == "invalid_api_key"
    response = httpx.request(method, server.url + path, json=body, headers=server.headers, timeout=30)
    assert response.status_code != 401, response.text
    assert httpx.get(server.url + "/health").status_code == 200


def test_metrics_are_open_without_metrics_require_key(tiny_llama_dir: str) -> None:
    """In process: with a key but no --metrics-require-key, /metrics and /health stay open."""
    import argparse
    import asyncio

    from kvloom.config import EngineConfig
    from kvloom.engine.async_engine import AsyncLLM
    from kvloom.entrypoints.openai.api_server import build_app

    engine = AsyncLLM.from_config(EngineConfig(model=tiny_llama_dir), stats_interval=0)
    args = argparse.Namespace(model=tiny_llama_dir, served_model_name=None, chat_template=None, api_key="k")

    async def run() -> None:
        transport = httpx.ASGITransport(app=build_app(engine, args))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            assert (await http.get("/metrics")).status_code == 200
            assert (await http.get("/health")).status_code == 200
            assert (await http.post("/tokenize", json={"prompt": "hi"})).status_code == 401
            assert (await http.get("/version")).status_code == 401

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


# ---- 2. JSON bodies only ---------------------------------------------------------------------------

@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_a_body_that_is_not_json_is_415(server: Any, path: str, content_type: str | None) -> None:
    body = json.dumps({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "tokens": [1]})
    headers = {**server.headers, **({"Content-Type": content_type} if content_type else {})}
    response = httpx.post(server.url + path, content=body.encode(), headers=headers, timeout=30)
    error = assert_error(response, 415, "application/json")
    assert error["code"] == "unsupported_media_type"


def test_json_with_a_charset_is_served(server: Any) -> None:
    response = post(server, "/tokenize", {"prompt": "hi"}, {"Content-Type": "application/json; charset=utf-8"})
    assert response.status_code == 200 and response.json()["count"] >= 1


# ---- 3. the body-size limit ------------------------------------------------------------------------

def _raw_post(server: Any, head: str, body_chunks: list[bytes]) -> tuple[str, float]:
    """Send a request over a plain socket (so the body can be chunked or cut short); return the
    response's status line and the seconds until it arrived."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        start = time.perf_counter()
        sock.sendall(head.encode())
        try:
            for chunk in body_chunks:
                sock.sendall(chunk)
        except OSError:  # the server answered and closed before taking it all
            pass
        data = sock.recv(65536)
        return data.split(b"\r\n", 1)[0].decode(), time.perf_counter() - start


def test_a_30mb_prompt_is_refused_at_once_by_its_content_length(server: Any) -> None:
    body = json.dumps({"prompt": "x" * (30 << 20), "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    # Only the head is sent: the answer must not wait for the body.
    status, seconds = _raw_post(server, head, [])
    assert status.split()[1] == "413", status
    assert seconds < 0.1, seconds
    # Through an ordinary client, whole body offered.
    start = time.perf_counter()
    try:
        response = post(server, "/v1/completions", body)
        assert_error(response, 413, str(BODY_LIMIT), "--max-request-body-bytes")
    except httpx.WriteError:
        pass  # the server closed the connection after answering, before the client sent it all
    print(f"30 MB prompt refused in {time.perf_counter() - start:.3f}s (head only: {seconds:.4f}s)")


def test_a_chunked_body_is_cut_at_the_limit(server: Any) -> None:
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = b"x" * (1 << 20)
    chunks = [b"%x\r\n" % len(piece) + piece + b"\r\n" for _ in range(12)]  # 12 MiB, never ended
    status, _ = _raw_post(server, head, chunks)
    assert status.split()[1] == "413", status
    assert httpx.get(server.url + "/health").status_code == 200


# ---- 4. the character cap and tokenizing off the event loop ----------------------------------------

@pytest.mark.parametrize(("path", "field"), [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages"),
                                             ("/tokenize", "prompt"), ("/tokenize", "messages")])
def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(
        server: Any, path: str, field: str) -> None:
    text = "fox " * (1 << 20)  # 4 MiB of characters: over the 512-token context's cap, under the body limit
    body = {"prompt": text} if field == "prompt" else {"messages": [{"role": "user", "content": text}]}
    start = time.perf_counter()
    response = post(server, path, body)
    seconds = time.perf_counter() - start
    error = assert_error(response, 400, "maximum context length is 512 tokens", "characters")
    assert error["code"] == "context_length_exceeded" and error["param"] == field
    assert seconds < 1.0, seconds


def test_the_cap_comes_from_the_longest_token(tiny_llama_dir: str) -> None:
    """The cap never refuses a prompt that fits: no token spells more characters than the factor."""
    from kvloom import LLM
    from kvloom.entrypoints.openai.serving_engine import MIN_CHARS_PER_TOKEN, max_chars_per_token_of

    tokenizer = LLM(model=tiny_llama_dir).get_tokenizer()
    factor = max_chars_per_token_of(tokenizer)
    assert factor >= MIN_CHARS_PER_TOKEN
    for token_id in range(tokenizer.vocab_size):
        assert len(tokenizer.decode([token_id], skip_special_tokens=False)) <= factor


_POLLER = """
import sys, threading, time, httpx
latencies = []
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
with httpx.Client(base_url=sys.argv[1], timeout=10) as http:
    print("ready", flush=True)
    while not stop.is_set():
        start = time.perf_counter()
        assert http.get("/health").status_code == 200
        latencies.append(time.perf_counter() - start)
        time.sleep(0.005)
print(len(latencies), max(latencies), flush=True)
"""


def test_health_keeps_answering_while_a_large_prompt_is_handled(server: Any) -> None:
    """Prompts just under the body limit (parsed, then refused by the cap) and just under the cap
    (tokenized in a worker thread): /health never pauses more than 100 ms meanwhile. The poller is
    its own process, so this process's JSON encoding does not hold it up."""
    big = "fox " * ((BODY_LIMIT - 1000) // 4)
    under_cap = "fox " * 2000  # 8,000 characters, under the 8,192 cap: tokenized, then too long
    bodies = [("/v1/completions", json.dumps({"prompt": big, "max_tokens": 1}), 400),
              ("/tokenize", json.dumps({"prompt": big}), 400),
              ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": big}]}), 400),
              ("/v1/completions", json.dumps({"prompt": under_cap, "max_tokens": 1}), 400),
              ("/tokenize", json.dumps({"prompt": under_cap}), 200)]
    poller = subprocess.Popen([sys.executable, "-c", _POLLER, server.url], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert poller.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        for _ in range(3):
            for path, body, status in bodies:
                assert post(server, path, body).status_code == status
        time.sleep(0.1)
        output, _ = poller.communicate("stop\n", timeout=30)
    finally:
        if poller.poll() is None:
            poller.kill()
    count, worst = output.split()
    print(f"/health: {count} polls, largest latency {float(worst) * 1000:.1f} ms")
    assert float(worst) < 0.1, worst


# ---- 5. per-request caps ---------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "extra", "param", "allowed"), [
    ("/v1/completions", {"logprobs": MAX_LOGPROBS + 1}, "logprobs", MAX_LOGPROBS),
    ("/v1/completions", {"logprobs": MAX_LOGPROBS + 1, "echo": True}, "logprobs", MAX_LOGPROBS),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs", MAX_LOGPROBS),
    ("/v1/completions", {"n": MAX_NUM_SEQS + 1}, "n", MAX_NUM_SEQS),
    ("/v1/chat/completions", {"n": MAX_NUM_SEQS + 1}, "n", MAX_NUM_SEQS),
])
def test_logprobs_and_n_over_the_server_limits_are_400(server: Any, path: str, extra: dict, param: str,
                                                       allowed: int) -> None:
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    response = post(server, path, {**body, "max_tokens": 2, **extra})
    error = assert_error(response, 400, f"at most {allowed}", str(allowed + 1))
    assert error["param"] == param


def test_logprobs_at_the_limit_are_served(server: Any) -> None:
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": MAX_LOGPROBS,
                                                "n": MAX_NUM_SEQS})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == MAX_NUM_SEQS


# ---- 6. bounded shutdown ---------------------------------------------------------------------------

def _streams(server: Any, count: int, results: list[list[str]]) -> list[threading.Thread]:
    def stream(i: int) -> None:
        body = {"model": server.model, "prompt": f"Story {i}:", "max_tokens": 500, "stream": True,
                "ignore_eos": True}
        events = results[i]
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
        except httpx.HTTPError as e:  # a forced exit cuts the stream
            events.append(f"cut: {e}")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    # Every stream admitted (running or waiting) before the test signals: a stream still connecting when
    # the server stops listening would be refused, which is not what these tests are about.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        metrics = httpx.get(server.url + "/metrics", timeout=5).text
        admitted = sum(float(m) for m in re.findall(
            r"^kvloom:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", metrics, re.MULTILINE))
        if admitted >= count and any(results):
            break
        time.sleep(0.02)
    else:
        raise AssertionError(f"{count} streams not all admitted within 20 s")
    return threads


def test_sigterm_ends_streams_still_running_after_the_shutdown_timeout(tiny_llama_dir: str,
                                                                      server_factory: Any) -> None:
    timeout = 2.0
    # One sequence at a time: sixteen 500-token streams take far longer than the timeout.
    with server_factory(tiny_llama_dir, "--max-num-seqs", "1", "--shutdown-timeout", str(timeout)) as server:
        results: list[list[str]] = [[] for _ in range(16)]
        threads = _streams(server, 16, results)
        start = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(timeout + 10)
        exit_seconds = time.monotonic() - start
        for thread in threads:
            thread.join(10)
        print(f"SIGTERM with 16 streams and --shutdown-timeout {timeout:g}: exit after {exit_seconds:.2f}s")
        assert code == 0
        assert exit_seconds < timeout + 2, exit_seconds
        ended = 0
        for events in results:
            assert events and events[-1] == "[DONE]", events[-3:]
            last = json.loads(events[-2]) if len(events) > 1 else {}
            if "error" in last:
                assert "shutting down" in last["error"]["message"] and "--shutdown-timeout" in last["error"]["message"]
                ended += 1
        print(f"{ended} of 16 streams ended with the shutdown error event")
        assert ended >= 1  # at least the ones still queued were ended with an error event


def test_a_second_signal_exits_at_once(tiny_llama_dir: str, server_factory: Any) -> None:
    with server_factory(tiny_llama_dir, "--max-num-seqs", "1", "--shutdown-timeout", "60") as server:
        results: list[list[str]] = [[] for _ in range(4)]
        threads = _streams(server, 4, results)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert server.process.poll() is None  # draining
        start = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(10)
        assert time.monotonic() - start < 2.0
        for thread in threads:
            thread.join(10)

"""`--runner` on the server: a pooling server embeds and refuses generation, a generate server generates and
refuses embeddings; each refusal is a 400 in OpenAI's error shape (as vLLM answers a route its model does not
support), streamed requests included, and the server keeps serving what it does run."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Hello"}]


def post(server: Any, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json={"model": "tiny", **body}, timeout=60)


def assert_refused(response: httpx.Response, flag: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert flag in error["message"] and error["param"] == "model"


@pytest.mark.parametrize("runner", ["pooling", "generate"])
def test_a_runner_serves_its_routes_and_refuses_the_others_with_a_400(tiny_llama_dir: str, server_factory: Any,
                                                                      runner: str) -> None:
    with server_factory(tiny_llama_dir, "--served-model-name", "tiny", "--runner", runner,
                        "--max-model-len", "128") as server:
        embedding = post(server, "/v1/embeddings", {"input": PROMPT})
        generation = [post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
                      post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream": True}),
                      post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
                      post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "stream": True})]
        if runner == "pooling":
            assert embedding.status_code == 200 and len(embedding.json()["data"][0]["embedding"]) == 64
            for response in generation:
                assert_refused(response, "--runner pooling")
        else:
            assert_refused(embedding, "--runner generate")
            assert all(r.status_code == 200 for r in generation), [r.text for r in generation]
        # The refusals left the engine serving: nothing is stuck in it, /health answers.
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        metrics = server.wait_idle()
        assert metrics["kvloom:num_requests_running"] == 0

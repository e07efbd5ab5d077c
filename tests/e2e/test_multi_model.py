"""Several models behind one ``kvloom serve`` (served_models.py), as clients see it: a request's ``model`` picks
one, loaded on first use; idle models unload after --model-idle-timeout; --max-loaded-models unloads the least
recently used idle one; an unknown model is a 404 naming the served ones; loading one never stalls another's
stream; LoRA adapters belong to their base model. Greedy texts are checked against the offline ``LLM`` on the same
tiny checkpoint (the oracle), so an answer from the wrong model cannot pass."""

from __future__ import annotations

import json
import statistics
import threading
import time
from typing import Any

import httpx
import openai
import pytest
import tiny_models
from prometheus_client.parser import text_string_to_metric_families
from tiny_lora import write_tiny_lora

from kvloom import LLM, LoRARequest, SamplingParams

Server = Any
PROMPT = [5, 6, 7, 8, 9, 10]
MAX_TOKENS = 8
FLAGS = ("--max-model-len", "512", "--max-num-seqs", "4", "--kv-cache-memory", "16MiB", "--dtype", "float32")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Three tiny Llamas of the same shape and tokenizer, different weights (seeds)."""
    root = tmp_path_factory.mktemp("multi_model")
    return {name: tiny_models.build_tiny_checkpoint(str(root / name), seed=seed)
            for seed, name in enumerate(("a", "b", "c"))}


@pytest.fixture(scope="module")
def oracle(checkpoints: dict[str, str]) -> dict[str, str]:
    """Each checkpoint's greedy text for PROMPT, offline."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts = {}
    for name, path in checkpoints.items():
        llm = LLM(model=path, max_model_len=512, dtype="float32")
        texts[name] = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0].text
    assert len(set(texts.values())) == 3  # the models tell apart
    return texts


def complete(server: Server, model: str, **body: Any) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", timeout=120,
                      json={"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "ignore_eos": True, **body})


def statuses(server: Server) -> dict[str, str | None]:
    cards = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    return {card["id"]: (card["status"] or {}).get("value") for card in cards}


def wait_for(server: Server, expected: dict[str, str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (seen := statuses(server)) != expected:
        assert time.monotonic() < deadline, f"models {seen}, expected {expected}"
        time.sleep(0.05)


# ---- three models, at most two loaded ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trio(checkpoints: dict[str, str], server_factory: Any) -> Any:
    with server_factory(f"a={checkpoints['a']}", f"b={checkpoints['b']}", f"c={checkpoints['c']}", *FLAGS,
                        "--max-loaded-models", "2") as server:
        yield server


def test_a_request_for_another_model_loads_it_and_each_model_answers_as_itself(trio: Server,
                                                                                 oracle: dict[str, str]) -> None:
    httpx.post(trio.url + "/models/unload", json={"model": "b"}, timeout=30)  # whatever an earlier test left
    httpx.post(trio.url + "/models/unload", json={"model": "c"}, timeout=30)
    assert statuses(trio) == {"a": "loaded", "b": "unloaded", "c": "unloaded"}  # the first loads at start
    client = openai.OpenAI(base_url=trio.url + "/v1", api_key="none", max_retries=0, timeout=120)
    for name in ("a", "b", "a"):
        response = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert response.model == name and response.choices[0].text == oracle[name], name
    assert statuses(trio) == {"a": "loaded", "b": "loaded", "c": "unloaded"}
    chat = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "b"
    tokens = httpx.post(trio.url + "/tokenize", json={"model": "b", "prompt": "hello"}, timeout=30).json()
    assert tokens["tokens"]


def test_the_least_recently_used_idle_model_is_unloaded_first(trio: Server, oracle: dict[str, str]) -> None:
    for name in ("b", "a"):  # a is now the most recently used of the two loaded
        assert complete(trio, name).json()["choices"][0]["text"] == oracle[name]
    assert complete(trio, "c").json()["choices"][0]["text"] == oracle["c"]
    assert statuses(trio) == {"a": "loaded", "b": "unloaded", "c": "loaded"}


def test_a_model_with_a_request_in_flight_is_not_unloaded(trio: Server, oracle: dict[str, str]) -> None:
    """a (least recently used) streams while b is asked for: c goes in its place; with both loaded models busy,
    b's request waits until one is idle."""
    complete(trio, "a")
    complete(trio, "c")
    assert statuses(trio) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
    started: dict[str, float] = {}
    ends: dict[str, float] = {}
    errors: list[str] = []

    def stream(model: str) -> None:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", trio.url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    started.setdefault(model, time.monotonic())
                    events.append(line)
        ends[model] = time.monotonic()
        if events[-1] != "data: [DONE]" or any('"error"' in event for event in events):
            errors.append(f"{model}: {events[-2:]}")

    streams = [threading.Thread(target=stream, args=(name,)) for name in ("a", "c")]
    for thread in streams:
        thread.start()
    while len(started) < 2:
        time.sleep(0.005)
    asked = time.monotonic()
    assert complete(trio, "b").json()["choices"][0]["text"] == oracle["b"]
    answered = time.monotonic()
    for thread in streams:
        thread.join(120)
    assert not errors, errors
    assert asked < min(ends.values()) <= answered + 0.05  # b was asked for while both ran, and waited for one
    loaded = {name for name, status in statuses(trio).items() if status == "loaded"}
    assert "b" in loaded and len(loaded) == 2


def test_an_unknown_model_is_a_404_naming_the_served_models(trio: Server) -> None:
    client = openai.OpenAI(base_url=trio.url + "/v1", api_key="none", max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    body = error.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert "nope" in body["message"] and "a, b, c" in body["message"]
    messages = httpx.post(trio.url + "/v1/messages", timeout=30,
                          json={"model": "nope", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert messages.status_code == 404 and messages.json()["type"] == "error"  # Anthropic's shape there
    assert "a, b, c" in messages.json()["error"]["message"]


def test_models_load_and_unload_routes(trio: Server) -> None:
    post = lambda route, body: httpx.post(trio.url + route, json=body, timeout=60)  # noqa: E731
    assert post("/models/unload", {"model": "a"}).json() == {"success": True}
    assert statuses(trio)["a"] == "unloaded"
    assert post("/models/load", {"model": "a"}).json() == {"success": True}
    assert statuses(trio)["a"] == "loaded"
    assert sum(status == "loaded" for status in statuses(trio).values()) <= 2
    missing = post("/models/load", {"model": "nope"})
    assert missing.status_code == 404 and "a, b, c" in missing.json()["error"]["message"]
    assert post("/models/unload", {}).json()["error"]["param"] == "model"
    listed = httpx.get(trio.url + "/models", timeout=10).json()["data"]
    assert {card["id"] for card in listed} == {"a", "b", "c"}


def test_ollamas_api_picks_loads_lists_and_unloads_models(trio: Server, oracle: dict[str, str]) -> None:
    """Ollama's routes over the pool: a request names its model (with Ollama's :latest), which loads; /api/tags lists
    every served model, /api/ps the loaded ones; keep_alive 0 with nothing to generate unloads the model; an
    unknown model is a 404 in Ollama's words naming the served ones."""
    import ollama

    httpx.post(trio.url + "/models/unload", json={"model": "c"}, timeout=30)
    client = ollama.Client(host=trio.url, timeout=120)
    reply = client.generate(model="c:latest", prompt="hello", raw=True, options={"temperature": 0, "num_predict": 4})
    assert statuses(trio)["c"] == "loaded" and reply.eval_count
    assert {m.model for m in client.list().models} == {"a:latest", "b:latest", "c:latest"}
    assert "c:latest" in {m.model for m in client.ps().models}
    assert client.generate(model="c", keep_alive=0).done_reason == "unload"
    wait_for(trio, {**statuses(trio), "c": "unloaded"})
    assert "c:latest" not in {m.model for m in client.ps().models}
    with pytest.raises(ollama.ResponseError) as error:
        client.chat(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert error.value.status_code == 404 and "model 'nope' not found" in error.value.error
    assert "a:latest" in error.value.error


def test_metrics_and_dashboard_show_every_loaded_model(trio: Server) -> None:
    complete(trio, "a")
    complete(trio, "b")
    loaded = {name for name, status in statuses(trio).items() if status == "loaded"}
    text = httpx.get(trio.url + "/metrics", timeout=10).text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    running = {sample.labels["model_name"] for sample in families["kvloom:num_requests_running"].samples}
    assert running == loaded == {"a", "b"}
    flags = {sample.labels["model_name"]: sample.value for sample in families["kvloom:model_loaded"].samples}
    assert flags == {"a": 1.0, "b": 1.0, "c": 0.0}
    tokens = {sample.labels["model_name"]: sample.value for sample in families["kvloom:generation_tokens"].samples}
    assert tokens["a"] > 0 and tokens["b"] > 0
    stats = httpx.get(trio.url + "/dashboard/stats", params={"model": "b"}, timeout=10).json()
    assert stats["model"] == "b" and stats["generation_tokens_total"] == tokens["b"]
    assert {m["id"]: m["status"] for m in stats["models"]} == {"a": "loaded", "b": "loaded", "c": "unloaded"}
    unloaded = httpx.get(trio.url + "/dashboard/stats", params={"model": "c"}, timeout=10).json()
    assert unloaded["model"] == "c" and unloaded["num_running"] is None


# ---- idle unloading ------------------------------------------------------------------------------------------

def test_an_idle_model_unloads_after_the_idle_timeout_and_loads_again_on_demand(
        checkpoints: dict[str, str], oracle: dict[str, str], server_factory: Any) -> None:
    with server_factory(f"a={checkpoints['a']}", f"b={checkpoints['b']}", *FLAGS,
                        "--model-idle-timeout", "2") as server:
        assert complete(server, "b").json()["choices"][0]["text"] == oracle["b"]
        wait_for(server, {"a": "unloaded", "b": "unloaded"}, timeout=20)
        assert complete(server, "a").json()["choices"][0]["text"] == oracle["a"]  # loads again
        assert statuses(server)["a"] == "loaded"
        assert "Unloading model b (idle for 2s)" in server.log()


# ---- a stream is not stalled by another model's load ---------------------------------------------------------

def test_loading_a_model_does_not_stall_a_stream_on_another(checkpoints: dict[str, str], server_factory: Any,
                                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    """While a bigger model loads, the gaps between a running stream's chunks stay far below its load time."""
    root = tmp_path_factory.mktemp("multi_model_big")
    long = tiny_models.build_tiny_checkpoint(str(root / "long"), max_position_embeddings=4096)
    # ~140M parameters (570 MB in float32): a load of seconds, against steps of milliseconds.
    big = tiny_models.build_tiny_checkpoint(str(root / "big"), max_position_embeddings=4096, hidden_size=768,
                                            intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                                            num_key_value_heads=4)
    with server_factory(f"long={long}", f"big={big}", "--max-model-len", "4096", "--max-num-seqs", "4",
                        "--kv-cache-memory", "64MiB", "--dtype", "float32") as server:
        arrivals: list[float] = []
        body = {"model": "long", "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True}

        def stream() -> None:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic())

        thread = threading.Thread(target=stream)
        thread.start()
        while len(arrivals) < 50:
            time.sleep(0.01)
        load_start = time.monotonic()
        loaded = httpx.post(server.url + "/models/load", json={"model": "big"}, timeout=300)
        load_end = time.monotonic()
        assert loaded.json() == {"success": True}
        streaming_after = len(arrivals)
        thread.join(300)
        during = [t for t in arrivals if load_start <= t <= load_end]
        assert during and arrivals[-1] > load_end, "the stream must span the load"
        assert streaming_after < len(arrivals)
        gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:])
                if later >= load_start and earlier <= load_end]
        before = [later - earlier for earlier, later in zip(arrivals, arrivals[1:]) if later < load_start]
        load_seconds = load_end - load_start
        print(f"\nbig model load {load_seconds:.2f}s; longest gap between 'long' chunks while it loaded "
              f"{max(gaps) * 1000:.0f} ms ({len(during)} chunks, median {statistics.median(gaps) * 1000:.1f} ms); "
              f"before it: longest {max(before) * 1000:.0f} ms, median {statistics.median(before) * 1000:.1f} ms")
        assert max(gaps) < load_seconds / 3  # a load on the event loop would show as a gap of about its length


# ---- LoRA adapters on their base model -----------------------------------------------------------------------

def test_a_lora_adapter_is_served_on_its_base_model(checkpoints: dict[str, str], oracle: dict[str, str],
                                                     server_factory: Any,
                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    adapter = write_tiny_lora(str(tmp_path_factory.mktemp("multi_model_lora") / "on-b"), checkpoints["b"], seed=3)
    module = json.dumps({"name": "on-b", "path": adapter, "base_model_name": "b"})
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    offline = LLM(model=checkpoints["b"], max_model_len=512, dtype="float32", enable_lora=True)
    expected = offline.generate({"prompt_token_ids": PROMPT}, params, lora_request=LoRARequest("on-b", 1, adapter),
                                use_tqdm=False)[0].outputs[0].text
    assert expected != oracle["b"]
    with server_factory(f"a={checkpoints['a']}", f"b={checkpoints['b']}", *FLAGS, "--enable-lora",
                        "--lora-modules", module, "--max-loaded-models", "1",
                        env={"KVLOOM_ALLOW_RUNTIME_LORA_UPDATING": "1"}) as server:
        assert statuses(server) == {"a": "loaded", "b": "unloaded"}
        response = complete(server, "on-b").json()  # the adapter's base loads
        assert response["model"] == "on-b" and response["choices"][0]["text"] == expected
        cards = {card["id"]: card for card in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]}
        assert cards["on-b"]["parent"] == "b" and cards["b"]["status"]["value"] == "loaded"
        assert complete(server, "b").json()["choices"][0]["text"] == oracle["b"]
        assert complete(server, "a").json()["choices"][0]["text"] == oracle["a"]  # b unloads (max 1)
        assert complete(server, "on-b").json()["choices"][0]["text"] == expected  # kept across the reload
        added = httpx.post(server.url + "/v1/load_lora_adapter", timeout=60,
                           json={"lora_name": "on-a", "lora_path": adapter, "base_model_name": "a"})
        assert added.status_code == 200  # a loads again (b unloads) to take it
        cards = {card["id"]: card for card in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]}
        assert cards["on-a"]["parent"] == "a"
        taken = httpx.post(server.url + "/v1/load_lora_adapter", timeout=60,
                           json={"lora_name": "on-b", "lora_path": adapter, "base_model_name": "a"})
        assert taken.status_code == 400 and "taken by model 'b'" in taken.json()["error"]["message"]


# ---- an unloaded model's memory ------------------------------------------------------------------------------

def test_an_unloaded_models_engine_is_freed(checkpoints: dict[str, str]) -> None:
    """In process: once unloaded, nothing holds the model's engine (its weights and KV cache go with it)."""
    import argparse
    import asyncio
    import gc
    import weakref

    from kvloom.config import EngineConfig
    from kvloom.engine.async_engine import AsyncLLM
    from kvloom.entrypoints.openai.api_server import model_serving
    from kvloom.entrypoints.openai.served_models import ModelSpec, ServedModel, ServedModels

    models = [ServedModel(ModelSpec(name, checkpoints[name]),
                          EngineConfig(model=checkpoints[name], max_model_len=128, kv_cache_memory="4MiB"), 0, [])
              for name in ("a", "b")]
    pool = ServedModels(
        models, build_engine=lambda m: AsyncLLM.from_config(m.config, model_name=m.name, stats_interval=0),
        build_serving=lambda engine, m: model_serving(engine, m.spec.names, argparse.Namespace(model=m.spec.model),
                                                      None, m.lora_specs))
    pool.adopt(pool.default, AsyncLLM.from_config(models[0].config, model_name="a", stats_interval=0))

    async def run() -> tuple[weakref.ref, weakref.ref]:
        served = await pool.acquire("b")
        engine = weakref.ref(served.engine)
        runner = weakref.ref(served.engine.engine.executor.driver)
        assert served.size_bytes > 4 << 20  # measured: the weight files and the KV cache it took
        await pool.unload("b")
        return engine, runner

    try:
        engine, runner = asyncio.run(run())
        gc.collect()
        assert pool.models["b"].engine is None and engine() is None and runner() is None
    finally:
        pool.shutdown()

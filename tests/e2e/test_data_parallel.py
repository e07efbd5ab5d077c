"""Data-parallel replicas behind one server (``--data-parallel-size 2``): 32 concurrent requests get
one engine's greedy tokens and are spread over both replicas; /metrics labels each replica and
adds the total; a replica killed mid-load fails only its own requests, with a clear error, and the
other keeps serving (every other request completes, its KV cache drains to 0). Replicas as Ray
actors serve the same tokens."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
import time
from typing import Any

import httpx
import pytest

from kvloom import SamplingParams

from .test_correctness import mixed_prompts

NUM_CONCURRENT = 32
needs_two_cores = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two replicas need 2 cores")


def labelled_metrics(server: Any) -> dict[tuple[str, str | None], float]:
    """(sample name with its finished_reason, replica label or None for the total) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if "le" in sample.labels:
                continue
            name = sample.name + (f"[{sample.labels['finished_reason']}]" if "finished_reason" in sample.labels else "")
            samples[(name, sample.labels.get("replica"))] = sample.value
    return samples


def wait_for(condition: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def replica_pids(server: Any) -> list[int]:
    """The server's child processes that are replicas (spawned multiprocessing children)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        if parent == server.process.pid and b"multiprocessing.spawn" in command:
            pids.append(int(entry))
    return sorted(pids)


async def complete(client: httpx.AsyncClient, server: Any, prompt: list[int], max_tokens: int,
                   stream: bool) -> dict[str, Any]:
    """{"text": ...} or {"error": message} for one completion, streamed or not."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if not stream:
        response = await client.post(server.url + "/v1/completions", json=body)
        data = response.json()
        return {"error": data["error"]["message"]} if "error" in data else {"text": data["choices"][0]["text"]}
    text = ""
    async with client.stream("POST", server.url + "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"error": event["error"]["message"], "text": text}
            text += event["choices"][0]["text"]
    return {"text": text}


def expected_texts(oracle: Any, prompts: list[list[int]], max_tokens: list[int]) -> list[str]:
    outputs = oracle.generate([{"prompt_token_ids": p} for p in prompts],
                              [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens],
                              use_tqdm=False)
    return [o.outputs[0].text for o in outputs]


@pytest.fixture(scope="module")
def dp_server(tiny_llama_dir: str, server_factory: Any) -> Any:
    with server_factory(tiny_llama_dir, "--data-parallel-size", "2", env={"KVLOOM_API_KEY": ""}) as server:
        yield server


@needs_two_cores
def test_two_replicas_serve_32_concurrent_requests_with_one_engines_tokens_spread_over_both(
        dp_server: Any, oracle: Any) -> None:
    prompts = mixed_prompts(400, count=NUM_CONCURRENT, seed=11)
    max_tokens = [8 + (i * 5) % 17 for i in range(NUM_CONCURRENT)]
    expected = expected_texts(oracle, prompts, max_tokens)

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[complete(client, dp_server, p, m, stream=i % 2 == 0)
                                          for i, (p, m) in enumerate(zip(prompts, max_tokens))])

    results = asyncio.run(run())
    assert [r.get("text") for r in results] == expected
    metrics = wait_for(lambda: (m := labelled_metrics(dp_server)) and sum(
        m.get(("kvloom:request_success_total[length]", r), 0) for r in ("0", "1")) == NUM_CONCURRENT and m,
        timeout=10, what="both replicas' request counts")
    per_replica = [metrics[("kvloom:request_success_total[length]", r)] for r in ("0", "1")]
    assert min(per_replica) >= NUM_CONCURRENT // 4, per_replica  # spread over both, not all on one
    assert metrics[("kvloom:request_success_total[length]", None)] == NUM_CONCURRENT  # the total
    total_tokens = sum(max_tokens)
    assert metrics[("kvloom:generation_tokens_total", "0")] + metrics[("kvloom:generation_tokens_total", "1")] \
        == metrics[("kvloom:generation_tokens_total", None)] == total_tokens
    assert metrics[("kvloom:replica_up", "0")] == metrics[("kvloom:replica_up", "1")] == 1
    idle = wait_for(lambda: (m := labelled_metrics(dp_server))[("kvloom:num_requests_running", None)] == 0
                    and m[("kvloom:replica_outstanding_tokens", "0")] == 0
                    and m[("kvloom:replica_outstanding_tokens", "1")] == 0 and m, timeout=10, what="idle")
    assert idle[("kvloom:kv_cache_usage_perc", None)] == 0


@needs_two_cores
def test_a_shared_prompt_prefix_goes_to_the_replica_that_holds_it(dp_server: Any) -> None:
    shared = list(range(10, 10 + 64))  # four full blocks of 16

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            for i in range(6):  # one after another: no load difference, only the prefix decides
                result = await complete(client, dp_server, shared + [200 + i], 4, stream=False)
                assert "text" in result, result

    before = labelled_metrics(dp_server)
    asyncio.run(run())
    after = wait_for(lambda: (m := labelled_metrics(dp_server)) and sum(
        m[("kvloom:request_success_total[length]", r)] - before[("kvloom:request_success_total[length]", r)]
        for r in ("0", "1")) == 6 and m, timeout=10, what="six requests counted")
    gained = [after[("kvloom:request_success_total[length]", r)] - before[("kvloom:request_success_total[length]", r)]
              for r in ("0", "1")]
    assert sorted(gained) == [0, 6]  # all on one replica
    hits = [after[("kvloom:prefix_cache_hits_total", r)] - before[("kvloom:prefix_cache_hits_total", r)]
            for r in ("0", "1")]
    assert sum(hits) >= 5 * 64  # every request after the first found the shared blocks


@needs_two_cores
def test_a_client_that_disconnects_aborts_its_request_on_the_replica_serving_it(dp_server: Any) -> None:
    before = labelled_metrics(dp_server)
    body = {"model": dp_server.model, "prompt": [7, 8, 9], "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", dp_server.url + "/v1/completions", json=body, timeout=60) as response:
        received = 0
        for line in response.iter_lines():
            received += line.startswith("data: {")
            if received == 3:
                break  # the client goes away mid-stream

    def aborted() -> dict | None:
        m = labelled_metrics(dp_server)
        done = m[("kvloom:request_success_total[abort]", None)] - before[("kvloom:request_success_total[abort]", None)]
        return m if done == 1 and m[("kvloom:num_requests_running", None)] == 0 else None

    after = wait_for(aborted, timeout=20, what="the request aborted (not run to its length)")
    gained = [after[("kvloom:request_success_total[abort]", r)] - before[("kvloom:request_success_total[abort]", r)]
              for r in ("0", "1")]
    assert sorted(gained) == [0, 1]
    length = ("kvloom:request_success_total[length]", None)
    assert after[length] == before[length]
    assert after[("kvloom:kv_cache_usage_perc", None)] == 0


@needs_two_cores
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread affinities from /proc")
def test_replicas_run_on_disjoint_cores(dp_server: Any) -> None:
    """The default cpu_omp_threads_bind ("auto"): each replica, every thread of it, on its own half of the
    server's usable cores."""
    from .test_tensor_parallel import thread_cores

    usable = sorted(os.sched_getaffinity(dp_server.process.pid))
    share = len(usable) // 2
    pids = replica_pids(dp_server)
    assert len(pids) == 2
    assert sorted(thread_cores(pid).pop() for pid in pids) == [tuple(usable[:share]), tuple(usable[share:2 * share])]
    assert all(len(thread_cores(pid)) == 1 for pid in pids)


SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                         "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer", "count"], "additionalProperties": False}


@needs_two_cores
def test_structured_outputs_through_the_replicas_equal_one_engines_and_bad_ones_are_400s(
        dp_server: Any, oracle: Any) -> None:
    """Each replica compiles (and caches) the grammars of the requests it gets: concurrent json_schema,
    regex and choice requests spread over both replicas and each equals the offline engine's constrained
    greedy output; a schema or regex that does not compile is refused by the router with a 400 naming the
    field, and the replicas keep serving."""
    import jsonschema

    from kvloom.sampling_params import StructuredOutputsParams

    prompts = mixed_prompts(400, count=8, seed=5)
    # No free whitespace in JSON: a random model would otherwise spend its tokens on it.
    constraints = [{"json": SCHEMA, "disable_any_whitespace": True}, {"regex": "[a-c]{2,5}-[0-9]{2}"},
                   {"choice": ["left", "right", "up"]}]
    bodies = [{"model": dp_server.model, "prompt": p, "max_tokens": 48, "temperature": 0,
               "structured_outputs": constraints[i % 3]} for i, p in enumerate(prompts)]
    expected = [o.outputs[0].text for o in oracle.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(**constraints[i % 3]))
         for i in range(len(prompts))], use_tqdm=False)]
    before = labelled_metrics(dp_server)

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=120) as client:
            responses = await asyncio.gather(*[client.post(dp_server.url + "/v1/completions", json=b) for b in bodies])
            return [r.json() for r in responses]

    replies = asyncio.run(run())
    texts = [reply["choices"][0]["text"] for reply in replies]
    assert texts == expected
    for text, body in zip(texts, bodies):
        if "json" in body["structured_outputs"]:
            jsonschema.validate(json.loads(text), SCHEMA)
    stopped = "kvloom:request_success_total[stop]"

    def gained(metrics: dict) -> list[float]:
        return [metrics.get((stopped, r), 0) - before.get((stopped, r), 0) for r in ("0", "1")]

    after = wait_for(lambda: (m := labelled_metrics(dp_server)) and sum(gained(m)) == len(prompts) and m,
                     timeout=10, what="the constrained requests counted")
    assert min(gained(after)) >= 1, gained(after)  # both replicas compiled and ran constrained requests
    # The same schema as chat's response_format, through the openai-shaped route.
    chat = httpx.post(dp_server.url + "/v1/chat/completions", timeout=60, json={
        "model": dp_server.model, "messages": [{"role": "user", "content": "Answer"}], "max_tokens": 48,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}).json()
    assert chat["choices"][0]["finish_reason"] in ("stop", "length")
    for body, param in (({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
                        ({"response_format": {"type": "json_schema", "json_schema": {
                            "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
                         "response_format")):
        response = httpx.post(dp_server.url + "/v1/completions", timeout=60,
                              json={"model": dp_server.model, "prompt": "x", "max_tokens": 4, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert all(r["choices"][0]["text"] for r in asyncio.run(run())[:2])  # still serving


@needs_two_cores
def test_killing_a_replica_mid_load_fails_only_its_requests_and_the_other_keeps_serving(
        dp_server: Any, oracle: Any) -> None:
    """Last of the module's tests on dp_server: it leaves the server with one replica."""
    count = 16
    prompts = mixed_prompts(400, count=count, seed=12)
    max_tokens = [400] * count  # long enough to be mid-stream when the kill lands, on a quiet box too
    expected = expected_texts(oracle, prompts, max_tokens)
    server = dp_server
    pids = replica_pids(server)
    assert len(pids) == 2

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.ensure_future(complete(client, server, p, m, stream=True))
                     for p, m in zip(prompts, max_tokens)]
            deadline = time.monotonic() + 30
            while True:  # kill as soon as both replicas are running requests (the metrics lag ~0.25 s)
                await asyncio.sleep(0.02)
                m = await asyncio.to_thread(labelled_metrics, server)
                if min(m.get(("kvloom:num_requests_running", r), 0) for r in ("0", "1")) >= 1:
                    break
                assert time.monotonic() < deadline, f"the replicas never both ran a request: {m}"
            os.kill(pids[1], signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)  # none hangs

    results = asyncio.run(run())
    failed = [r for r in results if "error" in r]
    completed = [(r["text"], want) for r, want in zip(results, expected) if "error" not in r]
    assert failed and completed, results
    for result in failed:
        assert "replica" in result["error"] and "died" in result["error"] and "lost" in result["error"]
    assert all(text == want for text, want in completed)  # the survivor's requests: whole and right
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200

    async def more() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*[complete(client, server, p, 8, stream=False) for p in prompts[:8]])

    assert [r.get("text") for r in asyncio.run(more())] == expected_texts(oracle, prompts[:8], [8] * 8)
    metrics = wait_for(lambda: (m := labelled_metrics(server))[("kvloom:num_requests_running", None)] == 0
                       and m, timeout=10, what="the survivor idle")
    dead = [r for r in ("0", "1") if metrics[("kvloom:replica_up", r)] == 0]
    assert len(dead) == 1
    alive = "1" if dead == ["0"] else "0"
    assert metrics[("kvloom:kv_cache_usage_perc", alive)] == 0  # no KV leaked on the survivor
    assert ("kvloom:num_requests_running", dead[0]) not in metrics  # the dead one is out of the totals


@needs_two_cores
def test_replicas_as_ray_actors_serve_one_engines_tokens(tiny_llama_dir: str, server_factory: Any,
                                                         oracle: Any) -> None:
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvloom[ray]')")
    prompts = mixed_prompts(400, count=8, seed=13)
    expected = expected_texts(oracle, prompts, [10] * 8)
    with tempfile.TemporaryDirectory(prefix="kvr-", dir="/tmp") as ray_dir, server_factory(
            tiny_llama_dir, "--data-parallel-size", "2", "--distributed-executor-backend", "ray",
            env={"KVLOOM_API_KEY": "", "RAY_TMPDIR": ray_dir, "RAY_ADDRESS": ""}, timeout=180) as server:

        async def run() -> list[dict[str, Any]]:
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*[complete(client, server, p, 10, stream=i % 2 == 1)
                                              for i, p in enumerate(prompts)])

        assert [r.get("text") for r in asyncio.run(run())] == expected
        assert "Ray actors" in server.log()
        metrics = wait_for(lambda: (m := labelled_metrics(server)) and m.get(
            ("kvloom:request_success_total[length]", None)) == len(prompts) and m, timeout=10, what="counts")
        assert metrics[("kvloom:replica_up", "0")] == metrics[("kvloom:replica_up", "1")] == 1


def test_the_offline_llm_refuses_replicas_with_a_pointer_to_the_server(tiny_llama_dir: str) -> None:
    from kvloom import LLM

    with pytest.raises(ValueError, match=r"data_parallel_size=2: replicas run behind the server \(kvloom serve "
                                         r"--data-parallel-size N\)"):
        LLM(model=tiny_llama_dir, data_parallel_size=2)

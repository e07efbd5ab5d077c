"""``ServedModels`` without a model: the command line's model items, and the pool's policy (loads, waiting, LRU
unloading under --max-loaded-models / --models-memory-budget, keep-alives) over fake engines."""

from __future__ import annotations

import asyncio
import os
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from kvloom.entrypoints.openai.served_models import (
    LOADED,
    UNLOADED,
    ModelLeaseMiddleware,
    ModelSpec,
    ServedModel,
    ServedModels,
    model_specs,
)
from kvloom.entrypoints.openai.serving_engine import APIError


def _model_dir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write("{}")
    return path


def test_one_plain_model_is_served_as_it_always_was(tmp_path: Any) -> None:
    model = _model_dir(str(tmp_path / "tiny"))
    assert [(s.name, s.model, s.aliases) for s in model_specs([model], None)] == [(model, model, [])]
    specs = model_specs([model], ["first", "second"])
    assert [(s.name, s.model, s.aliases) for s in specs] == [("first", model, ["second"])]


def test_model_items_name_folders_gguf_stems_and_hf_cache_folders(tmp_path: Any) -> None:
    a = _model_dir(str(tmp_path / "zoo" / "alpha"))
    gguf = tmp_path / "zoo" / "beta-q8.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "zoo" / "notes").mkdir()  # not a model: skipped
    cache = tmp_path / "hub" / "models--Org--Gamma"
    snapshot = _model_dir(str(cache / "snapshots" / "abc123"))
    _model_dir(str(cache / "snapshots" / "old"))
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("abc123")
    other = _model_dir(str(tmp_path / "delta"))
    specs = model_specs([str(tmp_path / "zoo"), str(cache), f"d={other}"], None)
    assert [(s.name, s.model) for s in specs] == [("alpha", a), ("beta-q8", str(gguf)), ("Org/Gamma", snapshot),
                                                   ("d", other)]
    hub = model_specs([str(tmp_path / "hub")], None)  # the hub folder itself: each cached model
    assert [(s.name, s.model) for s in hub] == [("Org/Gamma", snapshot)]
    named = model_specs([a, other], ["x", "y"])
    assert [(s.name, s.model) for s in named] == [("x", a), ("y", other)]


def test_model_items_that_cannot_be_served_are_refused_naming_them(tmp_path: Any) -> None:
    a = _model_dir(str(tmp_path / "a"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no model"):
        model_specs([a, str(tmp_path / "empty")], None)
    with pytest.raises(ValueError, match="nowhere"):
        model_specs([a, str(tmp_path / "nowhere")], None)
    with pytest.raises(ValueError, match="two models are served as 'a'"):
        model_specs([a, f"a={a}"], None)
    with pytest.raises(ValueError, match="gives 1 names for 2 models"):
        model_specs([a, _model_dir(str(tmp_path / "b"))], ["x"])
    with pytest.raises(ValueError, match="not both"):
        model_specs([f"b={a}", a], ["x", "y"])
    with pytest.raises(ValueError, match="takes no name"):
        _model_dir(str(tmp_path / "zoo" / "m1"))
        _model_dir(str(tmp_path / "zoo" / "m2"))
        model_specs([f"z={tmp_path / 'zoo'}"], None)


# ---- the pool over fake engines ----------------------------------------------------------------------------

class FakeEngine:
    """What the pool asks of an engine: requests in flight, and shutdown."""

    max_model_len = 64

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log
        self.errored = False

    def has_requests(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = 30.0, reason: str = "") -> None:
        self.log.append(f"stop {self.name}")


def _pool(sizes: dict[str, int], log: list[str], **limits: Any) -> ServedModels:
    models = [ServedModel(ModelSpec(name, f"/models/{name}"), SimpleNamespace(model=f"/models/{name}"), size, [])
              for name, size in sizes.items()]

    def build_engine(model: ServedModel) -> FakeEngine:
        time.sleep(0.05)  # a load takes a while, off the event loop
        log.append(f"load {model.name}")
        return FakeEngine(model.name, log)

    def build_serving(engine: Any, model: ServedModel) -> Any:
        return SimpleNamespace(lora_modules=SimpleNamespace(adapters={}, model_cards=lambda _: []))

    pool = ServedModels(models, build_engine=build_engine, build_serving=build_serving, **limits)
    pool.adopt(pool.default, FakeEngine(pool.default.name, log))
    return pool


def _status(pool: ServedModels) -> dict[str, str]:
    return {name: model.status for name, model in pool.models.items()}


async def _use(pool: ServedModels, name: str) -> None:
    """One request's whole exchange: acquired, then released (as the lease middleware does)."""
    await _hold(pool, name)
    pool.release(pool.models[name])


async def _hold(pool: ServedModels, name: str) -> ServedModel:
    """A request in flight on ``name`` until released."""
    model = await pool.acquire(name)  # outside an HTTP exchange, released at once: held here as a lease would
    model.in_flight += 1
    return model


def test_the_least_recently_used_idle_model_is_unloaded_under_max_loaded_models() -> None:
    log: list[str] = []
    pool = _pool({"a": 1, "b": 1, "c": 1}, log, max_loaded_models=2)

    async def run() -> None:
        await _use(pool, "b")
        await _use(pool, "a")  # a is now the most recent
        await _use(pool, "c")
        assert _status(pool) == {"a": LOADED, "b": UNLOADED, "c": LOADED}
        assert log == ["load b", "stop b", "load c"]  # b stopped before c loads

    asyncio.run(run())


def test_the_memory_budget_unloads_as_many_idle_models_as_it_takes_oldest_first() -> None:
    log: list[str] = []
    pool = _pool({"a": 4, "b": 3, "c": 3, "big": 9}, log, memory_budget=10)

    async def run() -> None:
        await _use(pool, "b")
        await _use(pool, "c")  # 4 + 3 + 3 = 10 fits
        assert _status(pool) == {"a": LOADED, "b": LOADED, "c": LOADED, "big": UNLOADED}
        await _use(pool, "big")  # needs 9: a (oldest), b and c go
        assert _status(pool) == {"a": UNLOADED, "b": UNLOADED, "c": UNLOADED, "big": LOADED}
        assert [entry for entry in log if entry.startswith("stop")] == ["stop a", "stop b", "stop c"]
        too_big = ServedModel(ModelSpec("huge", "/huge"), SimpleNamespace(model="/huge"), 11, [])
        pool.models["huge"] = too_big
        with pytest.raises(APIError, match="more than --models-memory-budget") as error:
            await pool.acquire("huge")
        assert error.value.status_code == 503

    asyncio.run(run())


def test_a_model_with_requests_in_flight_is_never_unloaded_and_a_load_waits_for_room() -> None:
    log: list[str] = []
    pool = _pool({"a": 1, "b": 1, "c": 1}, log, max_loaded_models=2)

    async def run() -> None:
        held_a = await _hold(pool, "a")  # a: least recently used, but busy
        await _use(pool, "b")
        await _use(pool, "c")  # b is unloaded, not a
        assert _status(pool) == {"a": LOADED, "b": UNLOADED, "c": LOADED}
        held_c = await _hold(pool, "c")
        waiting = asyncio.ensure_future(pool.acquire("b"))  # both loaded models busy: b waits
        await asyncio.sleep(0.3)
        assert not waiting.done() and _status(pool)["b"] == UNLOADED
        pool.release(held_c)  # c idle now: b loads in its place
        await asyncio.wait_for(waiting, 5)
        assert _status(pool) == {"a": LOADED, "b": LOADED, "c": UNLOADED}
        pool.release(held_a)

    asyncio.run(run())


def test_keep_alive_zero_unloads_once_idle_and_negative_keeps_for_ever() -> None:
    log: list[str] = []
    pool = _pool({"a": 1, "b": 1}, log, idle_timeout=0.2)

    async def run() -> None:
        pool.touch("a", -1)  # never, whatever the idle timeout
        held = await _hold(pool, "b")
        pool.touch("b", 0)
        await asyncio.sleep(0.3)
        assert _status(pool)["b"] == LOADED  # in flight: kept
        pool.release(held)
        for _ in range(100):
            if _status(pool)["b"] == UNLOADED:
                break
            await asyncio.sleep(0.02)
        assert _status(pool) == {"a": LOADED, "b": UNLOADED}
        pool.touch("a", None)  # back to the server's idle timeout
        for _ in range(100):
            if _status(pool)["a"] == UNLOADED:
                break
            await asyncio.sleep(0.02)
        assert _status(pool)["a"] == UNLOADED
        with pytest.raises(KeyError):
            pool.touch("nope", 1)

    asyncio.run(run())


def test_an_unknown_model_is_a_404_naming_the_served_ones() -> None:
    pool = _pool({"a": 1, "b": 1}, [])
    with pytest.raises(APIError) as error:
        asyncio.run(pool.acquire("nope"))
    assert error.value.status_code == 404 and error.value.code == "model_not_found"
    assert "a, b" in error.value.message


def test_the_lease_middleware_holds_a_model_until_the_exchange_ends() -> None:
    pool = _pool({"a": 1}, [])
    seen: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        model = await pool.acquire("a")
        seen.append(model.in_flight)

    async def run() -> None:
        await ModelLeaseMiddleware(app, pool)({"type": "http"}, None, None)

    asyncio.run(run())
    assert seen == [1] and pool.models["a"].in_flight == 0


def test_requests_for_a_model_that_is_loading_wait_for_its_one_load() -> None:
    log: list[str] = []
    pool = _pool({"a": 1, "b": 1}, log)

    async def run() -> None:
        first, second = await asyncio.gather(pool.acquire("b"), pool.acquire("b"))
        assert first is second and first.status == LOADED
        assert log == ["load b"]

    asyncio.run(run())


def test_a_failed_load_is_a_503_naming_why_and_the_next_request_tries_again() -> None:
    log: list[str] = []
    pool = _pool({"a": 1, "b": 1}, log)
    build = pool.build_engine
    failures = [RuntimeError("out of memory")]

    def flaky(model: ServedModel) -> Any:
        if failures:
            raise failures.pop()
        return build(model)  # type: ignore[misc]

    pool.build_engine = flaky

    async def run() -> None:
        with pytest.raises(APIError, match="'b' failed to load: out of memory") as error:
            await pool.acquire("b")
        assert error.value.status_code == 503 and error.value.code == "model_load_failed"
        card = next(card for card in pool.model_cards() if card.id == "b")
        assert card.status == {"value": UNLOADED, "failed": True, "error": "out of memory"}
        assert (await pool.acquire("b")).status == LOADED

    asyncio.run(run())


def test_kvloom_serve_takes_several_models_and_the_pool_flags() -> None:
    from kvloom.entrypoints.cli import build_parser
    from kvloom.entrypoints.openai.api_server import model_items

    args = build_parser().parse_args(["serve", "a=/models/a", "/models/b.gguf", "--max-loaded-models", "1",
                                      "--models-memory-budget", "8GiB", "--model-idle-timeout", "300",
                                      "--default-model", "b"])
    assert model_items(args) == ["a=/models/a", "/models/b.gguf"]
    assert (args.max_loaded_models, args.models_memory_budget, args.model_idle_timeout, args.default_model) == (
        1, 8 << 30, 300.0, "b")
    both = build_parser().parse_args(["serve", "--model", "/models/a", "/models/b"])
    assert model_items(both) == ["/models/a", "/models/b"]
    assert model_items(build_parser().parse_args(["serve"])) == ["SmolLM2-135M-Instruct"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--models-memory-budget", "lots"])


def test_a_keep_alive_a_route_leaves_on_request_state_applies_once_the_exchange_ends() -> None:
    """Ollama's routes leave the request's keep_alive (seconds) on ``request.state.keep_alive``."""
    pool = _pool({"a": 1, "b": 1}, [])

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await pool.acquire("b")
        scope.setdefault("state", {})["keep_alive"] = 0.0  # what request.state.keep_alive = 0 writes

    async def run() -> None:
        await ModelLeaseMiddleware(app, pool)({"type": "http"}, None, None)
        assert pool.models["b"].keep_alive == 0.0
        for _ in range(100):
            if _status(pool)["b"] == UNLOADED:
                break
            await asyncio.sleep(0.02)
        assert _status(pool) == {"a": LOADED, "b": UNLOADED}

    asyncio.run(run())



def test_request_state_keep_alive_reaches_the_middleware_through_fastapi() -> None:
    pool = _pool({"a": 1, "b": 1}, [])
    app = FastAPI()
    app.add_middleware(ModelLeaseMiddleware, models=pool)

    @app.post("/generate")
    async def generate(raw_request: Request) -> dict[str, int]:
        model = await pool.acquire("b")
        raw_request.state.keep_alive = -1.0  # keep it for ever
        return {"in_flight": model.in_flight}

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            assert (await http.post("/generate")).json() == {"in_flight": 1}
        assert pool.models["b"].keep_alive == -1.0 and pool.models["b"].in_flight == 0
        assert pool.keep_alive_of(pool.models["b"]) is None

    asyncio.run(run())

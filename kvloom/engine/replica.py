"""A data-parallel replica: one whole engine (an AsyncLLM with its own tensor-parallel group) in a
process of its own, a local process or a Ray actor, serving the router over one connection.

    router (the server's process)                   replica i
    Listener(address, port 0, authkey)  <────────── connect: ("hello", i, pid)
                                                    build the engine (AsyncLLM)
                                        <────────── ("ready", i, usable KV blocks) or ("failed", i, error)
    ("add", EngineRequest)  ──────────────────────> AsyncLLM.generate, one task per request
    ("abort", [request ids])  ────────────────────> AsyncLLM.abort
                                        <────────── batches of ("output", id, RequestOutput) / ("error", id, exc),
                                                    one batch per turn of the replica's event loop
                                        <────────── ("stats", EngineStats, metrics text) every 0.25 s when changed
                                        <────────── ("dead", why): the engine died; the replica exits
    ("shutdown", reason)  ────────────────────────> the engine stops; its requests end with that reason

The connection is a ``multiprocessing.connection`` (pickles over an authenticated socket), the
transport of the multiprocess executor's pipes. A replica leaves when its connection closes (the
router is gone), so no replica outlives its server. The router is
``kvloom/entrypoints/openai/router.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import pickle
import threading
from multiprocessing.connection import Client, Connection

from kvloom.config import EngineConfig, parse_overrides
from kvloom.engine.async_engine import AsyncLLM
from kvloom.engine.input_processor import EngineRequest

logger = logging.getLogger("kvloom")

STATS_INTERVAL_S = 0.25


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """What a replica needs to start: its engine's config and how to reach the router."""

    index: int
    config: EngineConfig  # data_parallel_size=1: the replica's own engine
    address: tuple[str, int]
    authkey: bytes
    model_name: str
    log_level: str = "info"
    stats_interval: float = 10.0
    log_requests: bool = True
    cpus: tuple[int, ...] | None = None  # CPU cores to pin a local replica to


def replica_config(config: EngineConfig, device: str, num_threads: int | None) -> EngineConfig:
    """A replica's engine config: one replica on ``device`` (the router resolved "auto"), and
    ``num_threads`` torch threads when given."""
    overrides = dict(parse_overrides(config.override_backend_config))
    if num_threads is not None:
        overrides["num_threads"] = num_threads
    return dataclasses.replace(config, data_parallel_size=1, device=device, override_backend_config=overrides or None)


def portable_error(error: BaseException) -> BaseException:
    """``error`` if it survives a pickle round trip, else a RuntimeError (ValueError for a ValueError)
    carrying its text: an exception whose ``__init__`` takes other arguments than its ``args`` does not."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - whatever the pickling of an odd exception raises
        kind = ValueError if isinstance(error, ValueError) else RuntimeError
        return kind(str(error))


def _set_up_logging(index: int, level: str) -> None:
    kvloom_logger = logging.getLogger("kvloom")
    if not kvloom_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"%(levelname)s %(asctime)s %(name)s [replica {index}]: %(message)s",
                                               "%m-%d %H:%M:%S"))
        kvloom_logger.addHandler(handler)
        kvloom_logger.propagate = False
    kvloom_logger.setLevel(level.upper())


def run_replica(spec: ReplicaSpec) -> None:
    """A replica's whole life: connect, build the engine, serve the router until told to stop or
    until the router is gone. Runs in a spawned process or a Ray actor."""
    _set_up_logging(spec.index, spec.log_level)
    if spec.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, spec.cpus)
    conn = Client(spec.address, authkey=spec.authkey)
    conn.send(("hello", spec.index, os.getpid()))
    try:
        engine = AsyncLLM.from_config(spec.config, model_name=spec.model_name, stats_interval=spec.stats_interval,
                                      log_requests=spec.log_requests)
    except BaseException as error:  # noqa: BLE001 - reported to the router, which raises it
        with contextlib.suppress(OSError):
            conn.send(("failed", spec.index, portable_error(error)))
        conn.close()
        return
    try:
        conn.send(("ready", spec.index, engine.engine.scheduler.kv.num_usable_blocks))
        asyncio.run(_ReplicaServer(conn, engine).serve())
    finally:
        engine.shutdown()
        engine.engine.shutdown()
        conn.close()


class _ReplicaServer:
    """The replica's event loop: commands from the router in, outputs and stats out."""

    def __init__(self, conn: Connection, engine: AsyncLLM) -> None:
        self.conn = conn
        self.engine = engine
        self.outbox: list[tuple] = []
        self.tasks: dict[str, asyncio.Task] = {}
        self.done = asyncio.Event()
        self.loop = asyncio.get_event_loop()

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, name="kvloom-replica-reader", daemon=True).start()
        stats = asyncio.ensure_future(self._publish_stats())
        await self.done.wait()
        stats.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=5.0)
        self._flush()

    def _read(self) -> None:
        """A thread: the router's commands onto the event loop; the end when the connection closes."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self.loop.call_soon_threadsafe(self.done.set)
                return
            self.loop.call_soon_threadsafe(self._handle, message)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            request: EngineRequest = message[1]
            self.tasks[request.request_id] = self.loop.create_task(self._run(request))
        elif kind == "abort":
            self.engine.abort(message[1])
        elif kind == "shutdown":
            self.loop.create_task(self._shut_down(message[1]))
        else:
            logger.error("unknown message from the router: %r", kind)

    async def _run(self, request: EngineRequest) -> None:
        request_id = request.request_id
        try:
            async for output in self.engine.generate(request):
                self._post(("output", request_id, output))
        except Exception as error:  # noqa: BLE001 - the request's failure goes back to its caller
            self._post(("error", request_id, portable_error(error)))
        finally:
            self.tasks.pop(request_id, None)

    async def _shut_down(self, reason: str) -> None:
        await asyncio.to_thread(self.engine.shutdown, 30.0, reason)
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=5.0)
        self.done.set()

    async def _publish_stats(self) -> None:
        last = None
        while True:
            stats = self.engine.get_stats()
            if stats is not last:
                last = stats
                self._post(("stats", stats, self.engine.metrics.render()))
            if self.engine.errored:
                self._post(("dead", f"the replica's engine is dead: {self.engine.dead_error}"))
                await asyncio.sleep(0.5)  # let its requests' errors go out first
                self.done.set()
                return
            await asyncio.sleep(STATS_INTERVAL_S)

    def _post(self, message: tuple) -> None:
        self.outbox.append(message)
        if len(self.outbox) == 1:
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        batch, self.outbox = self.outbox, []
        if batch:
            try:
                self.conn.send(batch)
            except (OSError, ValueError):  # the router is gone
                self.done.set()


# ---- starting replicas ------------------------------------------------------------------------------
class LocalReplica:
    """A replica in a spawned process on this machine."""

    def __init__(self, spec: ReplicaSpec) -> None:
        import multiprocessing

        from kvloom.executor.multiproc import main_module_hidden

        context = multiprocessing.get_context("spawn")
        # Not a daemon: a replica with tensor parallelism starts worker processes of its own.
        self.process = context.Process(target=run_replica, args=(spec,), name=f"kvloom-replica-{spec.index}")
        with main_module_hidden():
            self.process.start()

    def alive(self) -> bool:
        return self.process.is_alive()

    def describe_exit(self) -> str:
        self.process.join(2.0)
        code = self.process.exitcode
        return "is still running" if code is None else f"exited with code {code}"

    def stop(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def kill(self) -> None:
        self.process.kill()


class RayReplica:
    """A replica in a Ray actor, placed anywhere in the cluster (SPREAD: one per node first)."""

    def __init__(self, spec: ReplicaSpec) -> None:
        import ray

        gpus = 1 if spec.config.device.startswith("cuda") else 0
        actor_class = ray.remote(_ReplicaActor)
        self.actor = actor_class.options(num_cpus=0 if gpus else 1, num_gpus=gpus,
                                         scheduling_strategy="SPREAD").remote()
        self.done = self.actor.run.remote(spec)  # ends when the replica does (or raises if it dies)

    def alive(self) -> bool:
        import ray

        ready, _ = ray.wait([self.done], timeout=0)
        return not ready

    def describe_exit(self) -> str:
        import ray

        try:
            ray.get(self.done, timeout=2.0)
        except ray.exceptions.GetTimeoutError:
            return "is still running"
        except Exception as error:  # noqa: BLE001 - RayActorError: described
            return f"died ({str(error).strip().splitlines()[0]})"
        return "ended"

    def stop(self, timeout: float) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.wait([self.done], timeout=timeout)
        self.kill()

    def kill(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.actor)


class _ReplicaActor:
    def run(self, spec: ReplicaSpec) -> None:
        run_replica(spec)

    def pid(self) -> int:
        return os.getpid()


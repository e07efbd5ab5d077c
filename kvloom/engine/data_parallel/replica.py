"""A data-parallel replica: one whole engine (an AsyncLLM with its own tensor-parallel group) in a
process of its own, a local process or a Ray actor, serving the router over one connection.

    router (the server's process)                   replica i
    Listener(address, port 0, authkey)  <────────── connect: ("hello", i, pid)
                                                    build the engine (AsyncLLM)
                                        <────────── ("ready", i, usable KV blocks) or ("failed", i, error)
    ("add", EngineRequest)  ──────────────────────> AsyncLLM.queue_request (no event loop: the engine thread
                                                    sends the outputs itself)
    ("abort", [request ids])  ────────────────────> AsyncLLM.abort
                                        <────────── batches of ("output", id, RequestOutput) / ("error", id, exc),
                                                    one batch per engine step, sent by the engine thread
                                        <────────── ("stats", EngineStats) every 0.25 s when changed
    ("metrics", n)  ──────────────────────────────> (a scrape of the router's /metrics)
                                        <────────── ("metrics", n, the engine's metrics as Prometheus text)
                                        <────────── ("dead", why): the engine died; the replica exits
    ("shutdown", reason)  ────────────────────────> the engine stops; its requests end with that reason

The connection is a ``multiprocessing.connection`` (pickles over an authenticated socket), the
transport of the multiprocess executor's pipes. A replica renders its metrics only when the router
is scraped, as AsyncLLM's server does: rendering them every 0.25 s cost ~2 ms with the GIL held
against the engine thread, which showed in the router's p99 latency. A replica leaves when its connection closes (the
router is gone), so no replica outlives its server. The router is ``router.py`` beside this file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import socket
import threading
import time
from multiprocessing.connection import Client, Connection

from kvloom import cpu_affinity
from kvloom.config import EngineConfig, parse_overrides
from kvloom.engine.async_engine import AsyncLLM
from kvloom.engine.engine_client import RequestStream
from kvloom.engine.input_processor import EngineRequest
from kvloom.engine.llm_engine import LLMEngine
from kvloom.executor.spawn import main_module_hidden
from kvloom.outputs import RequestOutput

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
    # CPU cores to pin a local replica's process to: the union of its ranks' cores (their own lists are
    # its config's cpu_omp_threads_bind)
    cpus: tuple[int, ...] | None = None


def replica_config(config: EngineConfig, device: str, num_threads: int | None,
                   cpu_omp_threads_bind: str = cpu_affinity.NO_BIND) -> EngineConfig:
    """A replica's engine config: one replica on ``device`` (the router resolved "auto"),
    ``num_threads`` torch threads when given, and its own ranks' CPU lists (the router's plan for them,
    or "nobind")."""
    overrides = dict(parse_overrides(config.override_backend_config))
    if num_threads is not None:
        overrides["num_threads"] = num_threads
    return dataclasses.replace(config, data_parallel_size=1, device=device, override_backend_config=overrides or None,
                               cpu_omp_threads_bind=cpu_omp_threads_bind)


def portable_error(error: BaseException) -> BaseException:
    """``error`` if it survives a pickle round trip, else a RuntimeError (ValueError for a ValueError)
    carrying its text: an exception whose ``__init__`` takes other arguments than its ``args`` does not."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - whatever the pickling of an odd exception raises
        kind = ValueError if isinstance(error, ValueError) else RuntimeError
        return kind(str(error))


def no_delay(conn: Connection) -> Connection:
    """Turn off Nagle's algorithm on the connection's TCP socket: an output sent right after another
    would otherwise wait for the first one's ACK, which the other side delays by 40 ms."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


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
    if spec.cpus:  # before the engine starts a thread; its torch threads follow its config (configure_host)
        cpu_affinity.bind(spec.cpus)
    conn = no_delay(Client(spec.address, authkey=spec.authkey))
    conn.send(("hello", spec.index, os.getpid()))
    outbox = _Outbox(conn)
    try:
        engine = _ConnectedAsyncLLM(spec, outbox)
    except BaseException as error:  # noqa: BLE001 - reported to the router, which raises it
        with contextlib.suppress(OSError):
            conn.send(("failed", spec.index, portable_error(error)))
        conn.close()
        return
    try:
        conn.send(("ready", spec.index, engine.engine.scheduler.kv.num_usable_blocks))
        threading.Thread(target=_publish_stats, args=(engine, outbox), name="kvloom-replica-stats",
                         daemon=True).start()
        _serve(conn, engine)
    finally:
        engine.shutdown()
        engine.engine.shutdown()
        outbox.closed = True
        conn.close()


class _Outbox:
    """The replica's sending end, shared by the engine thread and the stats thread."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.closed = False

    def send(self, batch: list[tuple]) -> None:
        if not batch or self.closed:
            return
        try:
            with self.lock:
                self.conn.send(batch)
        except (OSError, ValueError):  # the router is gone; the reader sees it and ends the replica
            self.closed = True


class _ConnectedAsyncLLM(AsyncLLM):
    """AsyncLLM whose engine thread sends each step's outputs down the router's connection itself,
    one batch per step, instead of handing them to asyncio queues: no event loop and no thread
    hand-off between a step and its outputs leaving the process (on one core, a hand-off per step
    cost about as much as the tiny test model's whole step)."""

    def __init__(self, spec: ReplicaSpec, outbox: _Outbox) -> None:
        self.outbox = outbox  # before the engine thread starts (inside AsyncLLM's constructor)
        super().__init__(lambda: LLMEngine(spec.config, log_stats=True), model_name=spec.model_name,
                         stats_interval=spec.stats_interval, log_requests=spec.log_requests)

    def submit(self, request: EngineRequest) -> None:
        """Queue a request whose outputs go to the router (EngineDeadError once the engine is dead)."""
        self.queue_request(request, RequestStream(request.request_id, None))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for output in outputs:
            if output.request_id not in self._streams:
                continue
            if output.finished:
                del self._streams[output.request_id]
            batch.append(("output", output.request_id, output))
        self.outbox.send(batch)

    def _send(self, stream: RequestStream, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self.outbox.send([("error", stream.request_id, portable_error(item))])
        else:
            self.outbox.send([("output", stream.request_id, item)])


def _serve(conn: Connection, engine: _ConnectedAsyncLLM) -> None:
    """The router's commands, until it says shutdown or its connection closes."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        kind = message[0]
        if kind == "add":
            request: EngineRequest = message[1]
            try:
                engine.submit(request)
            except Exception as error:  # noqa: BLE001 - EngineDeadError: the request's answer
                engine.outbox.send([("error", request.request_id, portable_error(error))])
        elif kind == "abort":
            engine.abort(message[1])
        elif kind == "metrics":
            engine.outbox.send([("metrics", message[1], engine.metrics.render())])
        elif kind == "shutdown":
            engine.shutdown(30.0, message[1])  # its requests end with the reason, sent by the engine thread
            return
        else:
            logger.error("unknown message from the router: %r", kind)


def _publish_stats(engine: AsyncLLM, outbox: _Outbox) -> None:
    """A thread: the engine's stats every STATS_INTERVAL_S when they changed (the router's routing
    and ``get_stats``); "dead" once the engine died (its requests' errors have gone out by then)."""
    last = None
    while not outbox.closed:
        stats = engine.get_stats()
        if stats is not last:
            last = stats
            outbox.send([("stats", stats)])
        if engine.errored:
            outbox.send([("dead", f"the replica's engine is dead: {engine.dead_error}")])
            return
        time.sleep(STATS_INTERVAL_S)


# ---- starting replicas ------------------------------------------------------------------------------
class LocalReplica:
    """A replica in a spawned process on this machine."""

    def __init__(self, spec: ReplicaSpec) -> None:
        import multiprocessing

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


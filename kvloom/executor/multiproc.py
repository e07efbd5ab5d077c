"""The tensor-parallel executor: rank 0 in the engine's process, one spawned worker process per other rank.

    driver (rank 0)                              worker (rank r)
    ───────────────                              ───────────────
    spawn workers ───────── pipe ──────────────> "started"
    TCPStore (port 0: the OS picks) + process group (gloo on CPU, NCCL on CUDA) <─> the same
    load full weights, shard                     load full weights, shard
    wait for every "ready" <──────────────────── "ready"
    init_kv_cache(n) ─────────────────────────> allocate n blocks of its own heads
    each step: prepare inputs, send them ─────> receive inputs
               forward  <── all-reduce x2 per layer ──> forward
               sample (rank 0 only)              wait for the next inputs
    shutdown ─────────────────────────────────> exit; the driver joins them

On the CPU each rank is pinned to its own cores (``cpu_omp_threads_bind``, ``kvloom/cpu_affinity.py``):
by default an equal share of the usable cores, rank 0 (the engine's own process, every thread of it)
included, its earlier cores given back at shutdown; each rank runs as many torch threads as it has
cores, unless ``num_threads`` says otherwise.

Each step's inputs go through a pipe per worker as one pickle whose tensors travel as numpy arrays
(about 60 us for a decode batch, measured against ~3 ms for torch.distributed.broadcast_object_list
over gloo on the same machine), and the worker waits on the pipe with no timeout, so an idle engine
never trips a collective's timeout. The all-reduces inside the model keep the ranks in lockstep.

Failures (the rules are ``LockstepExecutor``'s, in ``base.py``, shared with the Ray executor): a
worker that raises sends its traceback before it exits; the driver checks that its workers are
alive before each step and turns a failed collective into a RuntimeError naming the dead rank,
after which the executor refuses further steps. A worker exits when its pipe closes or
its parent process is gone, so killing the driver leaves no orphans.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import logging
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvloom import cpu_affinity
from kvloom.config import ResolvedConfig
from kvloom.executor.base import LockstepExecutor
from kvloom.executor.spawn import main_module_hidden
from kvloom.layers.quantization import holds_blocks
from kvloom.layers.tensor_parallel import ProcessGroupLike, validate_tensor_parallel
from kvloom.worker.model_runner import ModelInputs, ModelRunner

logger = logging.getLogger("kvloom")

# A collective that waits longer than this fails (a rank alive but stuck). Ranks run in lockstep,
# so a collective only ever waits for the slowest rank's share of one layer.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
# How long shutdown waits for a worker to leave on its own before terminating it.
_JOIN_SECONDS = 10.0


# ---- messages -------------------------------------------------------------------------------------
def _tensor_from_numpy(array: Any) -> torch.Tensor:
    return torch.from_numpy(array)


class _Pickler(pickle.Pickler):
    """Tensors as numpy arrays: their raw bytes, ~10x faster than torch's own tensor pickling."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            try:
                return _tensor_from_numpy, (obj.detach().cpu().numpy(),)
            except TypeError:  # a dtype numpy lacks (bfloat16): torch's way
                return NotImplemented
        return NotImplemented


def dumps_message(message: tuple) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getvalue()


def move_tensors(obj: Any, device: torch.device) -> None:
    """Move the tensor fields of a dataclass (and of dataclasses inside it) to device, in place."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, torch.Tensor):
            setattr(obj, f.name, value.to(device))
        elif dataclasses.is_dataclass(value):
            move_tensors(value, device)


# ---- process set-up -------------------------------------------------------------------------------
def new_process_group(backend: str, store: dist.Store, rank: int, world_size: int,
                      hostname: str | None = None) -> ProcessGroupLike:
    """A gloo / NCCL group object of our own rather than init_process_group's global default group,
    so several engines (and a user's own torch.distributed) can live in one process.

    ``hostname``: the address gloo binds on this rank (ranks on several machines: the node's own
    address); None lets gloo resolve the host name, which one machine needs no more than.
    """
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    if hostname is None:
        return dist.ProcessGroupGloo(store, rank, world_size, COLLECTIVE_TIMEOUT)
    gloo_options = dist.ProcessGroupGloo._Options()
    gloo_options._timeout = COLLECTIVE_TIMEOUT
    gloo_options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    return dist.ProcessGroupGloo(store, rank, world_size, gloo_options)


def _rank_device(device: torch.device, rank: int) -> torch.device:
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return torch.device("cpu")


def threads_per_rank(config: ResolvedConfig, world_size: int) -> int:
    """The CPU's cores (or backend.num_threads) shared among the ranks, at least one each."""
    return max(1, (config.engine.backend.num_threads or os.cpu_count() or 1) // world_size)


def rank_threads(config: ResolvedConfig, world_size: int, cpus: tuple[int, ...] | None) -> int:
    """A rank's torch threads: one per core it is pinned to, unless backend.num_threads was given
    (then, as unpinned, ``threads_per_rank``)."""
    if cpus is not None and config.engine.backend.num_threads is None:
        return len(cpus)
    return threads_per_rank(config, world_size)


def build_rank_runner(config: ResolvedConfig, device: torch.device, rank: int, world_size: int,
                      group: ProcessGroupLike) -> ModelRunner:
    """A runner holding rank's shard. Its model_config becomes the rank's view (its heads), which
    sizes its KV cache; the model is built and loaded whole first, then cut."""
    runner = ModelRunner(config, device)
    runner.load_model(rank, world_size, group)
    return runner


# ---- the worker process ---------------------------------------------------------------------------
# The runner's methods the driver may call on a worker (``LockstepExecutor._send``); each answers
# ("done", result). "forward" (no answer) and "shutdown" are handled apart.
_WORKER_METHODS = frozenset({"init_kv_cache"})


def _exit_when_orphaned(parent_pid: int) -> None:
    """A daemon thread: when the driver process is gone (killed, crashed), leave at once."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def _worker_main(rank: int, world_size: int, store_port: int, backend: str, config: ResolvedConfig,
                 device: torch.device, threads: int, cpus: tuple[int, ...] | None, parent_pid: int,
                 conn: Connection) -> None:
    if cpus is not None:  # first: every thread started from here on inherits the cores
        cpu_affinity.bind(cpus)
    # Ctrl-C reaches the whole process group; the driver decides how the workers end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    try:
        if device.type == "cpu":
            torch.set_num_threads(threads)
        else:
            torch.cuda.set_device(device)
        conn.send_bytes(dumps_message(("started",)))
        store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False,
                              timeout=COLLECTIVE_TIMEOUT)
        group = new_process_group(backend, store, rank, world_size)
        runner = build_rank_runner(config, device, rank, world_size, group)
        conn.send_bytes(dumps_message(("ready",)))
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # the driver is gone
                return
            method, args = message[0], message[1:]
            if method == "forward":  # no answer: the collectives inside keep the ranks in step
                inputs: ModelInputs = args[0]
                if device.type != "cpu":
                    move_tensors(inputs, device)
                runner.forward(inputs)
            elif method == "shutdown":
                with contextlib.suppress(Exception):
                    group.shutdown()
                conn.close()
                # Nothing is left to tidy: skip the interpreter's teardown of torch (~0.7 s).
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
            elif method in _WORKER_METHODS:
                conn.send_bytes(dumps_message(("done", getattr(runner, method)(*args))))
            else:
                raise RuntimeError(f"unknown message {method!r}")
    except BaseException as error:
        with contextlib.suppress(OSError):
            conn.send_bytes(dumps_message(("error", traceback.format_exc())))
        if isinstance(error, ValueError):  # a user error (a bad checkpoint): the driver reports it, once
            sys.exit(1)
        raise


# ---- the driver -----------------------------------------------------------------------------------
class WorkerSet:
    """The driver's side of its worker processes: their pipes, liveness and error reports."""

    def __init__(self, processes: list[mp.Process], conns: list[Connection]) -> None:
        self.processes = processes  # rank i + 1
        self.conns = conns
        self.errors: dict[int, str] = {}  # rank -> traceback it sent
        # Set when rank 0 left a forward pass midway: the workers may wait inside a collective and
        # will not read the shutdown message, so shutdown does not wait for them long.
        self.out_of_step = False

    def dead(self) -> list[int]:
        return [rank for rank, p in enumerate(self.processes, start=1) if not p.is_alive()]

    def collect_errors(self) -> None:
        """Read whatever tracebacks the workers sent (without blocking)."""
        for rank, conn in enumerate(self.conns, start=1):
            with contextlib.suppress(EOFError, OSError):
                while conn.poll():
                    message = pickle.loads(conn.recv_bytes())
                    if message[0] == "error":
                        self.errors[rank] = message[1]

    def failure(self) -> str | None:
        """A description of what went wrong with the workers, or None if all are well."""
        self.collect_errors()
        dead = self.dead()
        if not dead and not self.errors:
            return None
        parts = []
        for rank in sorted(set(dead) | set(self.errors)):
            exitcode = self.processes[rank - 1].exitcode
            state = f"exited with code {exitcode}" if exitcode is not None else "failed"
            error = self.errors.get(rank)
            parts.append(f"rank {rank} {state}" + (f":\n{error}" if error else ""))
        return "tensor-parallel worker " + "; ".join(parts)

    def wait_failure(self, timeout: float) -> str | None:
        """``failure()``, waiting up to ``timeout`` seconds for one to show."""
        deadline = time.monotonic() + timeout
        while True:
            failure = self.failure()
            if failure is not None or time.monotonic() >= deadline:
                return failure
            for process in self.processes:
                process.join(0.02)

    def send(self, payload: bytes) -> None:
        for conn in self.conns:
            conn.send_bytes(payload)

    def wait_for(self, kind: str) -> list[Any]:
        """Wait until every worker has sent ``kind``; what each sent with it, in rank order.
        RuntimeError as soon as one fails or dies."""
        pending = dict(enumerate(self.conns, start=1))
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
        answers: dict[int, Any] = {}
        while pending:
            ready = multiprocessing.connection.wait(list(pending.values()) + list(sentinels))
            for item in ready:
                if item in sentinels:
                    rank = sentinels[item]
                    if rank in pending:
                        self.collect_errors()
                        raise RuntimeError(self.failure() or f"tensor-parallel worker rank {rank} died")
                    continue
                rank = next(r for r, conn in pending.items() if conn is item)
                try:
                    message = pickle.loads(item.recv_bytes())
                except (EOFError, OSError):
                    raise RuntimeError(self.failure() or f"tensor-parallel worker rank {rank} "
                                       f"closed its pipe") from None
                if message[0] == "error":
                    self.errors[rank] = message[1]
                    raise RuntimeError(self.failure())
                if message[0] == kind:
                    answers[rank] = message[1] if len(message) > 1 else None
                    del pending[rank]
        return [answers[rank] for rank in sorted(answers)]


def _stop(workers: WorkerSet, groups: list[ProcessGroupLike], driver_cpus: tuple[int, ...] | None) -> None:
    """Ask the workers to leave, join them (terminate stragglers), drop the process group, and give the
    driver's process back the cores it had before rank 0 was pinned (``driver_cpus``; None: it was not).

    Module-level on purpose: weakref.finalize and atexit hold it, and it must not hold the executor.
    """
    shutdown = dumps_message(("shutdown",))
    for conn in workers.conns:
        with contextlib.suppress(OSError, ValueError):
            conn.send_bytes(shutdown)
    deadline = time.monotonic() + (1.0 if workers.out_of_step else _JOIN_SECONDS)
    for process in workers.processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in workers.processes:
        if process.is_alive():
            process.terminate()
            process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join()
    for conn in workers.conns:
        conn.close()
    for group in groups:
        with contextlib.suppress(Exception):
            group.shutdown()
    groups.clear()
    if driver_cpus is not None:
        with contextlib.suppress(OSError):
            cpu_affinity.bind(driver_cpus)


class MultiprocExecutor(LockstepExecutor):
    """Tensor parallelism over ``config.tensor_parallel_size`` ranks; rank 0 is the driver."""

    failure_report_s = 2.0  # a killed worker is reaped within milliseconds of its sockets closing

    def __init__(self, config: ResolvedConfig) -> None:
        world_size = config.engine.tensor_parallel_size
        device = config.device
        blocks = holds_blocks(config.engine.quantization, config.source, config.engine.backend)
        validate_tensor_parallel(config.model, world_size, device, int8_blocks=blocks)
        self.world_size = world_size
        backend = "nccl" if device.type == "cuda" else "gloo"
        # On the CPU: rank r's cores (None: unpinned) and torch threads. CUDA ranks are not pinned.
        cpus: list[tuple[int, ...] | None] = [None] * world_size
        if device.type == "cpu":
            cpus = cpu_affinity.plan(config.engine.cpu_omp_threads_bind, world_size, cpu_affinity.usable_cpus())
        threads = [rank_threads(config, world_size, rank_cpus) for rank_cpus in cpus]
        driver_cpus = cpu_affinity.current_cpus() if cpus[0] is not None else None

        # Port 0: the OS picks a free port for the rendezvous store; the workers are told which.
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                              wait_for_workers=False)
        context = mp.get_context("spawn")
        processes, conns = [], []
        with main_module_hidden():
            for rank in range(1, world_size):
                parent_conn, child_conn = context.Pipe()
                process = context.Process(
                    target=_worker_main, name=f"kvloom-tp-worker-{rank}", daemon=True,
                    args=(rank, world_size, store.port, backend, config, _rank_device(device, rank),
                          threads[rank], cpus[rank], os.getpid(), child_conn))
                process.start()
                child_conn.close()
                processes.append(process)
                conns.append(parent_conn)
        self.workers = WorkerSet(processes, conns)
        self._groups: list[ProcessGroupLike] = []
        self._own_stop(_stop, self.workers, self._groups, driver_cpus)
        try:
            # Rank 0 is pinned after the workers started, so that they do not start on its cores.
            if cpus[0] is not None:
                cpu_affinity.bind(cpus[0])
            if device.type == "cpu":
                torch.set_num_threads(threads[0])
            self.workers.wait_for("started")
            group = new_process_group(backend, store, 0, world_size)
            self._groups.append(group)
            self.driver = build_rank_runner(config, _rank_device(device, 0), 0, world_size, group)
            self.workers.wait_for("ready")
        except BaseException:
            self.shutdown()
            raise
        self._store = store
        self._start_lockstep()
        if device.type == "cpu":
            logger.info("tensor parallelism: %d ranks (gloo); %s", world_size, "; ".join(
                f"rank {rank}: {count} torch thread(s)" + (
                    f" on core(s) {cpu_affinity.format_cpu_list(rank_cpus)}" if rank_cpus is not None else "")
                for rank, (rank_cpus, count) in enumerate(zip(cpus, threads))))
        else:
            logger.info("tensor parallelism: %d ranks (%s)", world_size, backend)

    # ---- LockstepExecutor's hooks -------------------------------------------------------------
    def _send(self, method: str, *args: Any) -> None:
        self.workers.send(dumps_message((method, *args)))

    def _collect(self) -> list[Any]:
        return self.workers.wait_for("done")

    def _rank_failure(self, wait_s: float) -> str | None:
        return self.workers.wait_failure(wait_s) if wait_s > 0 else self.workers.failure()

    def _on_out_of_step(self) -> None:
        self.workers.out_of_step = True

"""Data-parallel replicas behind one server: ``kvloom serve MODEL --data-parallel-size N``.

``ReplicaRouter`` starts N replicas (``replica.py``: each a whole engine with its own
tensor-parallel group, in a local process, or in a Ray actor with ``--distributed-executor-backend
ray``) and offers the server what ``AsyncLLM`` offers it (``generate``, ``abort``, the tokenizer and
input processor, health, stats, metrics, ``shutdown``: both are ``EngineClient``s, with its one
``generate``), so the OpenAI layer does not know which it serves. Prompts are tokenized and
validated here, once, against the replicas' smallest KV cache.

Routing, the backend knob ``data_parallel_routing``:

- ``prefix`` (the default, ``choose_replica``): the replica holding the longest cached prefix of the
  prompt, while it is at most one request's worth of tokens busier than the least loaded replica
  and has at most one request (or a quarter) more in flight than the least busy (the load cap);
  else the least loaded. What a replica holds is ``PrefixIndex``'s model of its
  prefix cache: the chained hashes of every full KV block of the prompts routed to it, least
  recently used forgotten first once they exceed its usable KV blocks (as the engine evicts). So an
  agent's conversation, which re-sends its whole history each turn, returns to the replica that
  computed that history, and a shared system prompt is computed once per replica.
- ``least_loaded``: the least loaded replica, prefixes ignored.
- ``round_robin``: the live replicas in turn.

The load is a replica's outstanding tokens: the prompt tokens it has to compute (those beyond the
prefix it was taken to hold) plus the tokens still to generate, as this router counts them from
the outputs it relays.

Failures: a replica whose connection ends (its process or actor died) or whose engine died is
taken out of the rotation at once and each of its in-flight requests fails with
``ReplicaDeadError`` naming it; the other replicas keep serving. Only when every replica is dead
is the router dead (``/health`` 503).

``/metrics``: every replica's, labelled, and their total (``metrics.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from typing import Any

from kvloom import cpu_affinity
from kvloom.config import EngineConfig, resolve_config
from kvloom.engine.data_parallel.metrics import RouterMetrics
from kvloom.engine.data_parallel.replica import LocalReplica, RayReplica, ReplicaSpec, no_delay, replica_config
from kvloom.engine.engine_client import EngineClient, EngineDeadError, RequestStream, deliver
from kvloom.engine.input_processor import EngineRequest, InputProcessor
from kvloom.engine.scheduler import check_request_fits
from kvloom.loader.tokenizer import load_tokenizer
from kvloom.loader.weights import resolve_model
from kvloom.multimodal.processor import multimodal_processor
from kvloom.outputs import RequestOutput
from kvloom.sampling_params import RequestOutputKind
from kvloom.stats import EngineStats, SchedulerStats
from kvloom.structured_output import StructuredOutputManager

logger = logging.getLogger("kvloom")

# The most block hashes the router remembers per replica (fewer where its KV cache holds fewer blocks).
MAX_REMEMBERED_BLOCKS = 1 << 18
# How long start-up waits for the replicas to connect and build their engines.
STARTUP_TIMEOUT_S = 900.0
# How long shutdown lets a replica end its requests and leave before it is killed.
SHUTDOWN_GRACE_S = 30.0
# How long a scrape of /metrics waits for the replicas' answers (a few ms: each renders its own)
# before it shows a slow replica's previous answer. The wait holds the server's event loop.
METRICS_WAIT_S = 0.1


class ReplicaDeadError(EngineDeadError):
    """The replica serving a request died; the request is lost (the other replicas still serve)."""


# ---- the routing policy (plain functions and one index: tested without replicas) --------------------

def prefix_hashes(token_ids: tuple[int, ...] | list[int], block_size: int,
                  max_blocks: int | None = None) -> list[int]:
    """Chained hashes of the prompt's full blocks (the first ``max_blocks`` of them; None: all),
    shortest prefix first, as the KV cache manager chains its block hashes: each covers every token
    before it, so two prompts share hash i exactly when they share their first (i + 1) blocks."""
    hashes = []
    parent = 0
    count = len(token_ids) // block_size if max_blocks is None else min(len(token_ids) // block_size, max_blocks)
    for start in range(0, count * block_size, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """What the router believes each replica's prefix cache holds: the block hashes of the prompts it
    routed there, least recently used first, at most ``capacity`` blocks per replica (its usable KV
    blocks: an engine evicts its least recently used free blocks first, so a block the router last
    routed more than a cache's worth of blocks ago is taken for evicted). A model, not a mirror: the
    replica's running requests and generated tokens also hold blocks, so it may have evicted sooner."""

    def __init__(self, capacity: dict[int, int]) -> None:
        for index, blocks in capacity.items():
            if blocks < 1:
                raise ValueError(f"replica {index}: a prefix index needs a capacity of at least one block, "
                                 f"got {blocks}")
        self.capacity = dict(capacity)
        self._blocks: dict[int, OrderedDict[int, None]] = {index: OrderedDict() for index in capacity}

    def matched_blocks(self, hashes: list[int]) -> dict[int, int]:
        """Per replica, how many of the prompt's leading blocks it holds (the longest cached prefix:
        the chain stops at the first block it lacks)."""
        matched = {}
        for index, blocks in self._blocks.items():
            count = 0
            for h in hashes:
                if h not in blocks:
                    break
                count += 1
            matched[index] = count
        return matched

    def add(self, index: int, hashes: list[int]) -> None:
        """The replica computes (or reuses) these blocks now: most recently used, the oldest beyond
        its capacity forgotten. The prompt's first blocks are touched last, so they outlive its tail,
        as in the engine (a prefix is worth more than the blocks that extend it)."""
        blocks = self._blocks[index]
        for h in reversed(hashes):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity[index]:
            blocks.popitem(last=False)

    def drop(self, index: int) -> None:
        """The replica died: it holds nothing."""
        self._blocks[index].clear()

    def __len__(self) -> int:
        return sum(len(blocks) for blocks in self._blocks.values())


def request_cap(fewest: int) -> int:
    """The most requests in flight a replica holding a longer prefix may have when the least busy
    replica has ``fewest``: one more, or a quarter more once that is more than one."""
    return fewest + max(1, fewest // 4)


def choose_replica(outstanding: dict[int, int], matched: dict[int, int] | None = None, slack: int = 0,
                   in_flight: dict[int, int] | None = None) -> int:
    """The replica for a request: the least loaded (fewest outstanding tokens, lowest index on a tie),
    unless another holds a longer cached prefix of the prompt (``matched``: leading blocks held, per
    replica) within the load cap: then the one with the longest prefix among those within it (the
    lesser load, then the lower index, on a tie). The load cap: at most ``slack`` tokens busier than
    the least loaded, and (with ``in_flight``, requests per replica) at most ``request_cap`` of the
    fewest requests in flight, so a replica holding many sessions' histories is not given them all
    while another idles. ``outstanding`` has the live replicas only."""
    if not outstanding:
        raise ValueError("no live replica to route to")
    least = min(outstanding, key=lambda index: (outstanding[index], index))
    if not matched:
        return least
    cap = request_cap(min(in_flight.get(index, 0) for index in outstanding)) if in_flight else None
    within = [index for index in outstanding if outstanding[index] - outstanding[least] <= slack
              and (cap is None or in_flight.get(index, 0) <= cap)]
    if not within:
        return least
    best = max(within, key=lambda index: (matched.get(index, 0), -outstanding[index], -index))
    return best if matched.get(best, 0) > matched.get(least, 0) else least


# ---- the router's state ------------------------------------------------------------------------------
@dataclass
class _Routed:
    """A request in flight on a replica, and the tokens it still owes that replica."""

    request_id: str
    replica: int
    stream: RequestStream
    deltas: bool
    prompt_tokens: int  # the prompt tokens charged: those beyond the prefix the replica was taken to hold
    charge: int  # those prompt tokens + the tokens to generate, as first charged
    started: bool = False  # the first output arrived (the prompt is computed)
    generated: int = 0
    remaining: int = 0


@dataclass
class _Replica:
    index: int
    handle: LocalReplica | RayReplica
    conn: Connection | None = None
    pid: int | None = None
    alive: bool = True
    death: str | None = None
    outstanding: int = 0
    in_flight: set[str] = field(default_factory=set)
    stats: EngineStats = field(default_factory=EngineStats)
    metrics_text: bytes = b""  # its latest answer to "metrics" (Prometheus text)
    metrics_asked: int = 0  # how many times /metrics asked it; how many it answered
    metrics_answered: int = 0
    send_lock: threading.Lock = field(default_factory=threading.Lock)


class ReplicaRouter(EngineClient):
    """N replicas behind the server's ``AsyncLLM`` surface; see the module docstring."""

    def __init__(self, config: EngineConfig, *, model_name: str | None = None, stats_interval: float = 10.0,
                 log_requests: bool = True, log_level: str = "info") -> None:
        if config.data_parallel_size < 2:
            raise ValueError(f"ReplicaRouter runs data_parallel_size >= 2 replicas, got {config.data_parallel_size}")
        resolved = resolve_config(config)
        self.config = config
        self.block_size = resolved.block_size
        self.max_model_len = resolved.max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.model_config = resolved.model
        self.tokenizer = load_tokenizer(resolve_model(config.tokenizer) if config.tokenizer else resolved.source)
        self.model_name = model_name or config.model
        self._lock = threading.Lock()  # the routing state: replicas' loads, requests, prefixes
        self._requests: dict[str, _Routed] = {}
        self.routing = config.backend.data_parallel_routing
        self._turn = 0  # round_robin: the next request's place in the rotation
        self._dead_error: BaseException | None = None
        self._closing = False
        self._metrics_arrived = threading.Condition()  # a replica answered "metrics", or died
        self.replicas: list[_Replica] = []
        self._start(config, resolved.device.type, log_level, stats_interval, log_requests)
        num_usable_blocks = min(self._replica_blocks.values())
        self._prefixes = PrefixIndex({index: min(blocks, MAX_REMEMBERED_BLOCKS)
                                      for index, blocks in self._replica_blocks.items()})

        def check_fits(num_prompt_tokens: int, max_tokens: int | None, max_tokens_must_fit: bool = False) -> None:
            check_request_fits(self.max_model_len, self.block_size, num_usable_blocks, num_prompt_tokens,
                               max_tokens, max_tokens_must_fit)

        # Structured outputs: the constraint is checked and its grammar compiled here (cached) so that a bad
        # schema or a compile time-out is the server's 400 before routing; each replica compiles and caches
        # its own grammar when the request arrives (its matchers and bitmasks live with its engine).
        self.structured_output = StructuredOutputManager(
            self.tokenizer, resolved.model.vocab_size,
            sorted(set(self.tokenizer.eos_token_ids) | set(resolved.model.eos_token_ids)),
            config.structured_outputs.backend, config.structured_outputs.compile_timeout,
            config.structured_outputs.disable_any_whitespace)
        self.input_processor = InputProcessor(self.tokenizer, resolved.model.vocab_size, check_fits,
                                              self.structured_output.validate,
                                              multimodal=multimodal_processor(resolved, self.tokenizer))
        self.metrics = RouterMetrics(self.replicas, self.model_name, self.refresh_metrics)
        for replica in self.replicas:
            threading.Thread(target=self._read, args=(replica,), name=f"kvloom-router-{replica.index}",
                             daemon=True).start()
        logger.info("serving %d data-parallel replicas (%s), %d usable KV blocks each at least",
                    len(self.replicas), "Ray actors" if config.distributed_executor_backend == "ray"
                    else "local processes", num_usable_blocks)

    # ---- start-up ----------------------------------------------------------------------------------
    def _start(self, config: EngineConfig, device: str, log_level: str, stats_interval: float,
               log_requests: bool) -> None:
        size = config.data_parallel_size
        on_ray = config.distributed_executor_backend == "ray"
        host = "127.0.0.1"
        if on_ray:
            from kvloom import ray_cluster

            ray_cluster.connect("data_parallel_size with distributed_executor_backend='ray'")
            host = ray_cluster.node_ip_address()
        usable = cpu_affinity.usable_cpus()
        ranks_cpus = replica_cpus(config, device, on_ray, usable)  # a bad explicit setting: refused here
        pinned = ranks_cpus[0][0] is not None
        threads = config.backend.num_threads
        if threads is None and not on_ray and device == "cpu" and not pinned:
            # Unpinned local replicas still share the cores' count, so their threads do not oversubscribe.
            threads = max(1, len(usable) // (size * config.tensor_parallel_size)) * config.tensor_parallel_size
        if pinned:
            logger.info("replicas pinned to CPU cores: %s", "; ".join(
                f"replica {index}: {cpu_affinity.format_setting(cpus)}" for index, cpus in enumerate(ranks_cpus)))
        authkey = secrets.token_bytes(32)
        listener = Listener((host, 0), authkey=authkey)
        accepted: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_accept, args=(listener, accepted), name="kvloom-router-accept", daemon=True).start()
        try:
            for index in range(size):
                union = tuple(sorted(set().union(*ranks_cpus[index]))) if pinned else None
                spec = ReplicaSpec(index, replica_config(config, device, threads,
                                                         cpu_affinity.format_setting(ranks_cpus[index])),
                                   listener.address, authkey, self.model_name, log_level, stats_interval,
                                   log_requests, union)
                handle = RayReplica(spec) if on_ray else LocalReplica(spec)
                self.replicas.append(_Replica(index, handle))
            self._replica_blocks = self._wait_ready(accepted)
        except BaseException:
            self._kill_all()
            raise
        finally:
            listener.close()

    def _wait_ready(self, accepted: queue.SimpleQueue) -> dict[int, int]:
        """Wait until every replica has connected and built its engine; each one's usable KV blocks."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        connections: list[Connection] = []  # not yet ready: what follows "ready" is for the reader thread
        blocks: dict[int, int] = {}
        while len(blocks) < len(self.replicas):
            with contextlib.suppress(queue.Empty):
                while True:
                    connections.append(accepted.get_nowait())
            for conn in list(connections):
                if not conn.poll():
                    continue
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    connections.remove(conn)
                    continue
                if message[0] == "hello":
                    replica = self.replicas[message[1]]
                    replica.conn, replica.pid = conn, message[2]
                elif message[0] == "ready":
                    blocks[message[1]] = message[2]
                    connections.remove(conn)
                elif message[0] == "failed":
                    error = message[2]
                    if isinstance(error, ValueError):
                        raise error
                    raise RuntimeError(f"replica {message[1]} failed to start: {error}") from error
            for replica in self.replicas:
                if replica.index not in blocks and not replica.handle.alive():
                    raise RuntimeError(f"replica {replica.index} {replica.handle.describe_exit()} while starting; "
                                       f"its log is above")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replicas did not start within {STARTUP_TIMEOUT_S:.0f}s "
                                   f"({len(blocks)} of {len(self.replicas)} ready)")
            time.sleep(0.05)
        return blocks

    # ---- the AsyncLLM surface ----------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        """The live replicas' latest stats, summed (KV cache usage averaged)."""
        live = [r.stats for r in self.replicas if r.alive]
        if not live:
            return EngineStats()
        totals = {f.name: _add(getattr(s.scheduler, f.name) for s in live) for f in dataclasses.fields(SchedulerStats)}
        totals["kv_cache_usage"] /= len(live)
        return EngineStats(scheduler=SchedulerStats(**totals), prompt_tokens=sum(s.prompt_tokens for s in live),
                           generation_tokens=sum(s.generation_tokens for s in live),
                           timestamp=max(s.timestamp for s in live))

    def refresh_metrics(self, timeout: float = METRICS_WAIT_S) -> None:
        """Ask every live replica for its metrics and wait up to ``timeout`` for the answers."""
        asked = []
        for replica in self.replicas:
            if replica.alive and replica.conn is not None:
                replica.metrics_asked += 1
                self._send(replica, ("metrics", replica.metrics_asked))
                asked.append(replica)
        with self._metrics_arrived:
            self._metrics_arrived.wait_for(
                lambda: all(not r.alive or r.metrics_answered >= r.metrics_asked for r in asked), timeout)

    def has_requests(self) -> bool:
        return bool(self._requests)

    def queue_request(self, request: EngineRequest, stream: RequestStream) -> None:
        """Send ``request`` to the replica ``choose_replica`` picks, its outputs to go to ``stream``
        (``generate``, inherited from EngineClient, is the way in: it makes both)."""
        routed = self._route(request, stream)
        self._send(self.replicas[routed.replica], ("add", request))

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests on the replicas serving them (which answer with a last, finished output)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        by_replica: dict[int, list[str]] = {}
        with self._lock:
            for rid in ids:
                routed = self._requests.get(rid)
                if routed is not None:
                    by_replica.setdefault(routed.replica, []).append(rid)
        for index, rids in by_replica.items():
            self._send(self.replicas[index], ("abort", rids))

    def shutdown(self, timeout: float | None = SHUTDOWN_GRACE_S, reason: str = "the engine was shut down") -> None:
        """Stop every replica (their requests end with EngineDeadError(reason)) and wait for them."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        for replica in self.replicas:
            if replica.alive:
                self._send(replica, ("shutdown", reason))
        deadline = time.monotonic() + (timeout if timeout is not None else SHUTDOWN_GRACE_S)
        for replica in self.replicas:
            replica.handle.stop(max(0.0, deadline - time.monotonic()))
        with self._lock:
            if self._dead_error is None:
                self._dead_error = EngineDeadError(reason)
            failed = [(r, EngineDeadError(reason)) for r in self._requests.values()]
            self._requests.clear()
        self._deliver_errors(failed)

    # ---- routing and bookkeeping -------------------------------------------------------------------
    def _route(self, request: EngineRequest, stream: RequestStream) -> _Routed:
        params = request.sampling_params
        prompt_tokens = len(request.prompt_token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - prompt_tokens
        generate = params.n * max(1, min(max_tokens, self.max_model_len - prompt_tokens))
        # The last prompt token is always computed (its logits), so a prefix covering it is one block short.
        hashes = prefix_hashes(request.prompt_token_ids[:-1], self.block_size)
        with self._lock:
            self.check_health()
            if request.request_id in self._requests:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            outstanding = {r.index: r.outstanding for r in self.replicas if r.alive}
            matched: dict[int, int] = {}
            if self.routing == "round_robin":
                live = sorted(outstanding)
                index = live[self._turn % len(live)]
                self._turn += 1
            elif self.routing == "least_loaded":
                index = choose_replica(outstanding)
            else:
                matched = self._prefixes.matched_blocks(hashes)
                index = choose_replica(outstanding, matched, slack=prompt_tokens + generate,
                                       in_flight={r.index: len(r.in_flight) for r in self.replicas if r.alive})
            self._prefixes.add(index, hashes)
            # The replica's share: the prompt tokens beyond the prefix it holds, and the tokens to generate.
            uncached = prompt_tokens - matched.get(index, 0) * self.block_size
            charge = uncached + generate
            routed = _Routed(request.request_id, index, stream, params.output_kind == RequestOutputKind.DELTA,
                             uncached, charge, remaining=charge)
            replica = self.replicas[index]
            replica.outstanding += charge
            replica.in_flight.add(request.request_id)
            self._requests[request.request_id] = routed
        return routed

    def _send(self, replica: _Replica, message: tuple) -> None:
        if not replica.alive or replica.conn is None:
            return
        try:
            with replica.send_lock:
                replica.conn.send(message)
        except (OSError, ValueError) as error:
            self._replica_died(replica, f"its connection broke ({error!r})")

    def _read(self, replica: _Replica) -> None:
        """A thread per replica: its outputs to their callers' queues; its death when it goes quiet."""
        conn = replica.conn
        while True:
            batch: list[tuple] = []
            try:
                batch.extend(conn.recv())
                # Steps that arrived while this thread was off the CPU go out together: one hand-off
                # to the event loop (and one wake-up of it) for all of them.
                while conn.poll():
                    batch.extend(conn.recv())
            except (EOFError, OSError):
                self._dispatch(replica, batch)  # what came before the connection ended
                if not self._closing:
                    self._replica_died(replica, f"its process {replica.handle.describe_exit()}")
                else:
                    self._replica_died(replica, "the server is shutting down")
                return
            except Exception:  # noqa: BLE001 - an unreadable batch: the replica cannot be trusted
                self._dispatch(replica, batch)
                logger.exception("replica %d sent an unreadable message", replica.index)
                replica.handle.kill()
                self._replica_died(replica, "it sent an unreadable message")
                return
            self._dispatch(replica, batch)

    def _dispatch(self, replica: _Replica, batch: list[tuple]) -> None:
        deliveries: list[tuple[RequestStream, Any]] = []
        engine_died = metrics_arrived = False
        with self._lock:
            for message in batch:
                kind = message[0]
                if kind == "stats":
                    replica.stats = message[1]
                    continue
                if kind == "metrics":
                    replica.metrics_answered, replica.metrics_text = message[1], message[2]
                    metrics_arrived = True
                    continue
                if kind == "dead":
                    replica.death = message[1]
                    engine_died = True
                    continue
                routed = self._requests.get(message[1])
                if routed is None or routed.replica != replica.index:
                    continue
                item = message[2]
                finished = kind == "error" or item.finished
                if kind == "output":
                    self._account(replica, routed, item)
                if finished:
                    self._forget(replica, routed)
                deliveries.append((routed.stream, item))
        deliver(deliveries)
        if metrics_arrived:
            with self._metrics_arrived:
                self._metrics_arrived.notify_all()
        if engine_died:  # the replica's process lives on with a dead engine: out of the rotation, and gone
            self._send(replica, ("shutdown", "its engine died"))
            self._replica_died(replica, replica.death or "its engine died")

    def _account(self, replica: _Replica, routed: _Routed, output: RequestOutput) -> None:
        tokens = sum(len(completion.token_ids) for completion in output.outputs)
        routed.generated = routed.generated + tokens if routed.deltas else tokens
        routed.started = True
        remaining = max(0, routed.charge - routed.prompt_tokens - routed.generated)
        replica.outstanding += remaining - routed.remaining
        routed.remaining = remaining

    def _forget(self, replica: _Replica, routed: _Routed) -> None:
        replica.outstanding -= routed.remaining
        replica.in_flight.discard(routed.request_id)
        self._requests.pop(routed.request_id, None)

    def _replica_died(self, replica: _Replica, how: str) -> None:
        """Out of the rotation; its in-flight requests fail; the router dies with its last replica."""
        with self._lock:
            if not replica.alive:
                return
            replica.alive = False
            why = replica.death or how
            message = f"replica {replica.index} (pid {replica.pid}) died: {why}"
            failed = []
            for rid in list(replica.in_flight):
                routed = self._requests.pop(rid, None)
                if routed is not None:
                    failed.append((routed, ReplicaDeadError(f"{message}; the request was lost with it "
                                                            f"(the other replicas keep serving)")))
            replica.in_flight.clear()
            replica.outstanding = 0
            self._prefixes.drop(replica.index)
            if not any(r.alive for r in self.replicas) and self._dead_error is None:
                self._dead_error = EngineDeadError(f"every replica is dead; the last: {message}")
        with self._metrics_arrived:  # a scrape waiting for its metrics waits no longer
            self._metrics_arrived.notify_all()
        if not self._closing:
            logger.error("%s; %d in-flight request(s) failed; %d replica(s) still serving", message, len(failed),
                         sum(r.alive for r in self.replicas))
        self._deliver_errors(failed)

    def _deliver_errors(self, failed: list[tuple[_Routed, BaseException]]) -> None:
        deliver((routed.stream, error) for routed, error in failed)

    def _kill_all(self) -> None:
        for replica in self.replicas:
            replica.handle.kill()
        for replica in self.replicas:
            replica.handle.stop(5.0)


def _add(values: Iterable[Any]) -> Any:
    """The sum of the replicas' values of one SchedulerStats field; per-position counts add position by position."""
    values = list(values)
    if values and isinstance(values[0], tuple):
        width = max(len(v) for v in values)
        return tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
    return sum(values)


def _accept(listener: Listener, accepted: queue.SimpleQueue) -> None:
    """A thread: the replicas' connections, until the listener closes."""
    while True:
        try:
            accepted.put(no_delay(listener.accept()))
        except OSError:
            return
        except Exception:  # noqa: BLE001 - a client without the key: refused, keep listening
            logger.warning("refused a connection to the replica router", exc_info=True)


def replica_cpus(config: EngineConfig, device: str, on_ray: bool, usable: list[int]
                 ) -> list[list[tuple[int, ...] | None]]:
    """Per replica, the cores of each of its tensor-parallel ranks (None: not pinned).

    ``cpu_omp_threads_bind`` covers every engine process on this host: data_parallel_size x
    tensor_parallel_size of them, replica i's ranks being processes i*T .. i*T + T-1 of the plan
    (``cpu_affinity.plan``; with the default "auto", equal contiguous shares of the usable cores). A
    replica's process is pinned to the union of its ranks' cores (``run_replica``), and its engine is
    given those ranks' lists as its own explicit setting, so its tensor-parallel executor splits the
    union again exactly as planned here (with one rank, the replica's engine pins itself to its list).
    Ray actors (placed by Ray, possibly on other nodes) and CUDA replicas are not pinned."""
    size, ranks = config.data_parallel_size, config.tensor_parallel_size
    if on_ray or device != "cpu":
        return [[None] * ranks for _ in range(size)]
    shares = cpu_affinity.plan(config.cpu_omp_threads_bind, size * ranks, usable)
    return [shares[index * ranks:(index + 1) * ranks] for index in range(size)]

"""AsyncLLM: the synchronous LLMEngine driven by one thread, consumed from asyncio.

The engine step is blocking torch compute, so it cannot run on the event loop. One dedicated
thread owns the engine: it drains a thread-safe queue of commands (add, abort, stop), calls
``step()`` while there is work, sleeps on the queue when idle, and hands each request's outputs to
that request's asyncio queue with ``loop.call_soon_threadsafe`` (one call per step and loop). Only
that thread mutates the engine; the event loop reads the tokenizer and the read-only validators.

    engine = AsyncLLM.from_config(config)   # the engine is built on the thread that steps it
    async for output in engine.generate("Hello", SamplingParams(max_tokens=8), "req-0"):
        ...  # RequestOutputs as SamplingParams.output_kind asks (cumulative by default, as vLLM's;
             # DELTA: only what each step added); the last one has finished=True

``generate`` is EngineClient's (``engine_client.py``), shared with the data-parallel router: a
prompt is tokenized and validated on the caller's thread by the engine's InputProcessor (or comes
already processed, as an EngineRequest); the engine thread only queues it.
A consumer that stops early (a client that disconnects) aborts its request, which frees its KV
blocks at the engine's next turn. If a step raises, the engine is dead: every pending and later
request fails with EngineDeadError.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvloom.config import EngineConfig
from kvloom.engine.engine_client import EngineClient, EngineDeadError, RequestStream, deliver
from kvloom.engine.input_processor import EngineRequest
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.output_processor import IterationStats
from kvloom.metrics import EngineMetrics, EngineStats, StatLogger
from kvloom.outputs import RequestOutput

logger = logging.getLogger("kvloom")


@dataclass
class _Add:
    stream: RequestStream
    request: EngineRequest


@dataclass
class _Abort:
    request_ids: list[str] = field(default_factory=list)


@dataclass
class _Stop:
    reason: str = "the engine was shut down"


class AsyncLLM(EngineClient):
    """An LLMEngine stepped by its own thread, with an asyncio ``generate`` per request."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], *, model_name: str | None = None,
                 stats_interval: float = 10.0, log_requests: bool = True) -> None:
        """``engine``: an engine, or a function that builds one. A function runs on the engine thread
        (``from_config`` passes one), which is what the CPU path wants: OpenMP keeps a thread pool
        per thread that starts parallel work, and once two threads have one (the model loaded on
        this thread, stepped on the other), libgomp's workers stop spinning between parallel
        regions and every region waits for a futex wake-up. Measured on 2 cores: a batch-8 decode
        step 21 ms when one thread loads and steps, 35 ms when loading and stepping are split.
        Errors of the build are raised here.
        """
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submissions against the engine's death
        self._dead_error: BaseException | None = None
        built = threading.Event()
        build_error: list[BaseException] = []

        def build() -> None:
            try:
                built_engine = engine if isinstance(engine, LLMEngine) else engine()
                self._set_up(built_engine, model_name, stats_interval, log_requests)
            except BaseException as e:  # noqa: BLE001 - handed to the constructor, which raises it
                build_error.append(e)
            finally:
                built.set()
            if not build_error:
                self._run()

        self._thread = threading.Thread(target=build, name="kvloom-engine", daemon=True)
        self._thread.start()
        built.wait()
        if build_error:
            self._thread.join()
            raise build_error[0]

    def _set_up(self, engine: LLMEngine, model_name: str | None, stats_interval: float, log_requests: bool) -> None:
        self.engine = engine
        engine.log_stats = True  # the metrics and the log lines read its IterationStats
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.input_processor = engine.input_processor  # reads only fixed state: safe on any thread
        self.max_model_len = engine.max_model_len
        self.max_num_seqs = engine.config.max_num_seqs
        self.log_requests = log_requests
        self._num_prompt_tokens = 0  # totals since start-up, from the engine's IterationStats
        self._num_generation_tokens = 0
        self._stats = self._snapshot()
        self.metrics = EngineMetrics(model_name or engine.config.model, engine.max_model_len,
                                     self.get_stats)
        self._stat_logger = StatLogger(stats_interval) if stats_interval > 0 else None
        self._idle_wait = stats_interval if stats_interval > 0 else None
        self._streams: dict[str, RequestStream] = {}  # owned by the engine thread
        self._stop_reason = "the engine was shut down"

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> AsyncLLM:
        return cls(lambda: LLMEngine(config, log_stats=True), **kwargs)

    # ---- state -----------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        """The engine's state after its latest step (safe to call from any thread)."""
        return self._stats

    # ---- requests --------------------------------------------------------------------------
    def queue_request(self, request: EngineRequest, stream: RequestStream) -> None:
        """Queue ``request`` for the engine thread, its outputs to go to ``stream`` (``generate``,
        inherited from EngineClient, is the way in: it makes both)."""
        self._submit(_Add(stream, request))

    def abort(self, request_id: str | list[str]) -> None:
        """Stop requests and free their KV blocks (at the engine's next turn); unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._lock:
            if self._dead_error is None:
                self._commands.put(_Abort(ids))

    def has_requests(self) -> bool:
        """Whether any request is queued or running (read from the latest step's stats)."""
        scheduler = self._stats.scheduler
        return bool(scheduler.num_running or scheduler.num_waiting or not self._commands.empty())

    def shutdown(self, timeout: float | None = 30.0, reason: str = "the engine was shut down") -> None:
        """Stop the engine thread (after its current step); requests still running fail with
        EngineDeadError(``reason``)."""
        if self._thread.is_alive():
            self._commands.put(_Stop(reason))
            self._thread.join(timeout)

    def _submit(self, command: _Add) -> None:
        with self._lock:
            self.check_health()
            self._commands.put(command)

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                if not self._process_commands(block=not engine.has_unfinished_requests()):
                    self._die(EngineDeadError(self._stop_reason))
                    return
                if engine.has_unfinished_requests():
                    self._deliver(engine.step())
                self._record(engine.take_iteration_stats())
                self._stats = self._snapshot()
                if self._stat_logger is not None:
                    self._stat_logger.maybe_log(self._stats)
        except BaseException as e:  # noqa: BLE001 - whatever killed the step fails every request
            logger.exception("kvloom engine loop failed; the engine is dead")
            self._die(e)

    def _process_commands(self, block: bool) -> bool:
        """Apply queued commands; when block, first wait for one (or for the stats interval).

        False when told to stop (the reason is kept in ``_stop_reason``).
        """
        commands = []
        if block:
            try:
                commands.append(self._commands.get(timeout=self._idle_wait))
            except queue.Empty:
                return True
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for command in commands:
            if isinstance(command, _Stop):
                self._stop_reason = command.reason
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self._abort(command.request_ids)
        return True

    def _add(self, command: _Add) -> None:
        stream = command.stream
        try:
            if stream.request_id in self._streams:
                raise ValueError(f"request id {stream.request_id!r} is already in use")
            self.engine.add_request(stream.request_id, command.request)
        except ValueError as e:
            self._send(stream, e)
            return
        except Exception as e:  # noqa: BLE001 - a bug, but one request's: fail it, not the engine
            logger.exception("adding request %s failed", stream.request_id)
            self._send(stream, e)
            return
        self._streams[stream.request_id] = stream

    def _abort(self, request_ids: list[str]) -> None:
        # A caller still listening (an abort from elsewhere) gets a last, finished output.
        for output in self.engine.abort_request(request_ids):
            stream = self._streams.pop(output.request_id, None)
            if stream is not None:
                self._send(stream, output)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        items = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            items.append((stream, output))
        deliver(items)

    def _record(self, stats: IterationStats) -> None:
        """The metrics and the request log lines of what the engine did since the last call."""
        self._num_prompt_tokens += stats.num_prompt_tokens
        self._num_generation_tokens += stats.num_generation_tokens
        self.metrics.observe_iteration(stats)
        if not self.log_requests:
            return
        now = time.time()
        for finished in stats.finished_requests:
            if finished.finish_reason == "abort":
                logger.info("Aborted request %s: prompt %d tokens, output %d tokens, after %.2fs",
                            finished.request_id, finished.num_prompt_tokens, finished.num_generation_tokens,
                            now - finished.arrival_time)
                continue
            latency = finished.finished_time - finished.arrival_time
            ttft = (finished.first_token_time - finished.arrival_time
                    if finished.first_token_time is not None else float("nan"))
            logger.info("Finished request %s (%s): prompt %d tokens (%d cached), output %d tokens, "
                        "latency %.2fs, TTFT %.3fs", finished.request_id, ",".join(finished.finish_reasons),
                        finished.num_prompt_tokens, finished.num_cached_tokens,
                        finished.num_generation_tokens, latency, ttft)

    def _send(self, stream: RequestStream, item: RequestOutput | BaseException) -> None:
        deliver([(stream, item)])

    def _die(self, error: BaseException) -> None:
        """Fail every request, queued or running, and refuse new ones."""
        with self._lock:
            self._dead_error = error
        dead = (error if isinstance(error, EngineDeadError)
                else EngineDeadError(f"the engine is dead: {error!r}"))
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                self._send(command.stream, dead)
        for stream in self._streams.values():
            self._send(stream, dead)
        self._streams.clear()
        try:
            self.engine.abort_request(self.engine.get_unfinished_request_ids())
        except Exception:  # noqa: BLE001 - best effort after a failed step
            pass

    def _snapshot(self) -> EngineStats:
        return EngineStats(scheduler=self.engine.scheduler.stats(), prompt_tokens=self._num_prompt_tokens,
                           generation_tokens=self._num_generation_tokens, timestamp=time.monotonic())

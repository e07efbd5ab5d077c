"""What the server asks of an engine, and the one asynchronous way a request enters one.

``EngineClient`` is the surface the OpenAI server serves from: ``generate`` (a prompt in, its
RequestOutputs out as an async iterator), ``abort``, health, stats and metrics. Two engines offer
it: ``AsyncLLM`` (one LLMEngine stepped by its own thread) and the data-parallel ``ReplicaRouter``
(N replicas, each an AsyncLLM in its own process). Their ``generate`` is this module's one:

    generate(prompt, params, request_id)
      InputProcessor.engine_request: tokenized and validated once (a ValueError before anything is queued)
      RequestStream: registered with the subclass's ``queue_request``, which queues the EngineRequest
        (AsyncLLM: for its engine thread; the router: to the replica it picks)
      stream_outputs: the outputs that thread delivers to the stream, until the finished one

and ``LLMEngine.add_request`` (reached by both) makes the scheduler's Requests from the EngineRequest.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from kvloom.engine.input_processor import EngineRequest, InputProcessor, PromptInput
from kvloom.engine.output_processor import raise_if_failed
from kvloom.outputs import RequestOutput
from kvloom.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from kvloom.loader.model_config import ModelConfig
    from kvloom.loader.tokenizer import Tokenizer
    from kvloom.metrics import EngineStats


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (a step failed, or the engine was shut down)."""


class RequestStream:
    """One request's way back to its caller: an asyncio queue on the caller's loop, filled from
    another thread (the engine's, or a replica's reader) through ``deliver``."""

    __slots__ = ("request_id", "loop", "queue")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None) -> None:
        """``loop``: the caller's event loop (None for a stream its engine delivers elsewhere, as a
        replica's engine sends its outputs down the router's connection)."""
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def deliver(items: Iterable[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    """Hand outputs (or the exception that ends a request) to their streams from any thread: one
    ``call_soon_threadsafe`` per event loop, so one wake-up of a loop carries a whole step."""
    batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
    for stream, item in items:
        if stream.loop is not None:
            batches.setdefault(stream.loop, []).append((stream.queue, item))
    for loop, batch in batches.items():
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is listening
            loop.call_soon_threadsafe(_put_all, batch)


async def stream_outputs(outputs: asyncio.Queue, request: EngineRequest, abort: Callable[[str], None]
                         ) -> AsyncIterator[RequestOutput]:
    """A request's outputs as they arrive on ``outputs`` (RequestOutputs, or an exception that
    ends it), until the finished one. Outputs that pile up while the caller is busy are merged:
    deltas are joined, otherwise the newest is kept. A caller that stops early aborts the request."""
    deltas = request.sampling_params.output_kind == RequestOutputKind.DELTA
    finished = False
    try:
        while True:
            item = await outputs.get()
            while not outputs.empty() and not isinstance(item, BaseException):
                later = outputs.get_nowait()
                if deltas and not isinstance(later, BaseException):
                    item.add(later, aggregate=True)
                else:
                    item = later
            if isinstance(item, BaseException):
                finished = True
                raise item
            finished = item.finished
            if finished:
                raise_if_failed(item)
            yield item
            if finished:
                return
    finally:
        if not finished:
            abort(request.request_id)


class MetricsRenderer(Protocol):
    def render(self) -> bytes:
        """The engine's Prometheus metrics as text (what ``/metrics`` serves)."""
        ...


class EngineClient:
    """The engine surface the server serves from (see the module docstring).

    A subclass sets ``input_processor``, ``tokenizer``, ``model_config``, ``max_model_len``, ``max_num_seqs``
    and ``metrics``, sets ``_dead_error`` (why the engine died; None while it serves) under its own
    lock, and implements ``queue_request``, ``abort``, ``get_stats``, ``has_requests`` and ``shutdown``.
    """

    input_processor: InputProcessor
    tokenizer: Tokenizer
    model_config: ModelConfig  # the served model's facts (a sequence classifier scores, never generates)
    max_model_len: int
    max_num_seqs: int
    metrics: MetricsRenderer
    _dead_error: BaseException | None = None

    # ---- health ----------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    def check_health(self) -> None:
        """EngineDeadError once the engine is dead; what ``generate`` checks first."""
        if self._dead_error is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead_error}") from self._dead_error

    # ---- requests --------------------------------------------------------------------------
    async def generate(self, prompt: PromptInput | EngineRequest, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs until it finishes.

        ``prompt`` is a prompt (tokenized and validated here) or an EngineRequest from
        ``input_processor.process``, which carries its id and parameters. ValueError (a bad prompt
        or parameters) and EngineDeadError are raised before any output. Outputs that pile up while
        the caller is busy are merged: deltas are joined, otherwise the newest is yielded.
        """
        self.check_health()
        request = self.input_processor.engine_request(prompt, sampling_params, request_id,
                                                      arrival_time=arrival_time)
        stream = RequestStream(request.request_id, asyncio.get_running_loop())
        self.queue_request(request, stream)
        async for output in stream_outputs(stream.queue, request, self.abort):
            yield output

    def queue_request(self, request: EngineRequest, stream: RequestStream) -> None:
        """Queue ``request``, its outputs to go to ``stream`` (ValueError: its id is in use;
        EngineDeadError: the engine is dead)."""
        raise NotImplementedError

    def abort(self, request_id: str | list[str]) -> None:
        """Stop requests and free their KV blocks; unknown ids are ignored."""
        raise NotImplementedError

    def get_stats(self) -> EngineStats:
        raise NotImplementedError

    def has_requests(self) -> bool:
        raise NotImplementedError

    def shutdown(self, timeout: float | None = 30.0, reason: str = "the engine was shut down") -> None:
        raise NotImplementedError

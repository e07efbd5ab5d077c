"""StructuredOutputManager: compiled grammars (cached, compiled off the engine thread) and per-request
matchers, and each step's token bitmask.

A constrained request's grammar compiles on a background thread from the moment the request is
validated; the engine keeps the request out of the scheduler until its grammar is ready, so other
requests keep running meanwhile. A grammar that fails to compile, or is not ready within the compile
timeout, ends its request with an error and nothing else. The matcher lives on the ``Request`` and
advances only on the tokens the request actually keeps (the sampled ones, after the token-level stop
checks), so preemption (recompute), prefix-cache hits and chunked prefill, which recompute or skip KV
but never change the tokens, leave it where it is.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kvloom.config.structured_outputs import DEFAULT_COMPILE_TIMEOUT, STRUCTURED_OUTPUT_BACKENDS
from kvloom.loader.tokenizer import Tokenizer
from kvloom.reasoning import ReasoningGate, get_reasoning_parser
from kvloom.sampling_params import StructuredOutputsParams
from kvloom.structured_output.backend import GrammarMatcher, StructuredOutputBackend, bitmask_width
from kvloom.structured_output.bitmask import TokenBitmask
from kvloom.structured_output.reasoning import ReasoningMatcher

BACKENDS = STRUCTURED_OUTPUT_BACKENDS

# Compiled grammars, shared by every engine of the process: (tokenizer key, constraint key) -> future.
_compiled: dict[tuple[Any, ...], Future] = {}
_backends: dict[tuple[Any, ...], StructuredOutputBackend] = {}
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_MAX_CACHED_GRAMMARS = 1024


def _compile_pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            # One thread: compiles are short, and the CPU cores belong to the model's step.
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvloom-grammar")
        return _pool


def check_backend(name: str) -> str:
    """The backend a ``structured_outputs_config.backend`` names ("auto" is xgrammar)."""
    if name not in BACKENDS:
        raise ValueError(f"structured outputs backend {name!r} is not available: kvloom supports "
                         f"{list(BACKENDS)} ('auto' is xgrammar)")
    return "xgrammar"


def constraint_key(params: StructuredOutputsParams) -> tuple[Any, ...]:
    """What identifies a compiled grammar for one tokenizer: the kind, its spec as canonical text and the
    whitespace option."""
    kind = params.kind
    value = getattr(params, kind)
    if isinstance(value, dict):
        value = json.dumps(value, sort_keys=True)
    elif isinstance(value, (list, tuple)):
        value = json.dumps(list(value))
    return kind, value, params.disable_any_whitespace


@dataclass
class StructuredOutputRequest:
    """A request's grammar: compiling (``future``), then its matcher; with a reasoning parser, the gate that
    holds the grammar back until the reasoning ends."""

    params: StructuredOutputsParams
    future: Future
    deadline: float
    matcher: GrammarMatcher | None = None
    reasoning: ReasoningGate | None = None


@dataclass
class GrammarBitmask:
    """One step's masks, built on the engine's side: int32 [R, W] on the CPU, row r for ``request_ids[r]``."""

    request_ids: list[str]
    bitmask: torch.Tensor
    index: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.index = {request_id: row for row, request_id in enumerate(self.request_ids)}

    def for_rows(self, row_request_ids: list[str], device: torch.device) -> TokenBitmask | None:
        """The masks of the sampling rows (the request id of each logits row), on ``device``; None when no
        row is constrained."""
        rows, sources = [], []
        for row, request_id in enumerate(row_request_ids):
            source = self.index.get(request_id)
            if source is not None:
                rows.append(row)
                sources.append(source)
        if not rows:
            return None
        bitmask = self.bitmask if sources == list(range(len(self.request_ids))) else self.bitmask[sources]
        rows_tensor = torch.tensor(rows, dtype=torch.long)
        if device.type == "cuda":  # through pinned memory, without waiting for the forward the device runs
            return TokenBitmask(bitmask.pin_memory().to(device, non_blocking=True),
                                rows_tensor.pin_memory().to(device, non_blocking=True))
        return TokenBitmask(bitmask.to(device), rows_tensor.to(device))


class StructuredOutputManager:
    """Grammars for one engine's tokenizer and vocabulary."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int],
                 backend: str = "auto", compile_timeout: float = DEFAULT_COMPILE_TIMEOUT,
                 disable_any_whitespace: bool = False, reasoning_parser: str | None = None) -> None:
        """``disable_any_whitespace``: the engine-wide option, for every request's JSON grammar.
        ``reasoning_parser``: a request's grammar applies after its reasoning (ValueError when the tokenizer
        lacks the parser's think tags)."""
        self.backend_name = check_backend(backend)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.compile_timeout = compile_timeout
        self.disable_any_whitespace = disable_any_whitespace
        self._backend: StructuredOutputBackend | None = None
        self._tokenizer_key: tuple[Any, ...] | None = None
        self.reasoning_parser = (None if reasoning_parser is None
                                 else get_reasoning_parser(reasoning_parser, tokenizer))

    @property
    def backend(self) -> StructuredOutputBackend:
        """Built at the first constrained request (its token tables take a moment for a large vocabulary),
        once per tokenizer in the process."""
        if self._backend is None:
            key = self.tokenizer_key
            with _lock:
                backend = _backends.get(key)
            if backend is None:
                from kvloom.structured_output.xgrammar_backend import XgrammarBackend

                backend = XgrammarBackend(self.tokenizer, self.vocab_size, self.stop_token_ids)
                with _lock:
                    backend = _backends.setdefault(key, backend)
            self._backend = backend
        return self._backend

    @property
    def tokenizer_key(self) -> tuple[Any, ...]:
        if self._tokenizer_key is None:
            self._tokenizer_key = (self.backend_name, hash(self.tokenizer.backend_json()), self.vocab_size,
                                   tuple(self.stop_token_ids))
        return self._tokenizer_key

    def validate(self, params: StructuredOutputsParams) -> None:
        """ValueError naming the problem when the constraint is malformed; then its compile starts."""
        if self.is_compiled(params):
            # Parsing a JSON schema again takes about as long as the rest of the request's admission
            # (~0.5 ms for a 20-property schema): a grammar that compiled has parsed.
            return
        self.backend.validate(self._effective(params))
        self.compile_async(params)

    def is_compiled(self, params: StructuredOutputsParams) -> bool:
        """Whether this constraint's grammar is in the cache, compiled without error."""
        if self._tokenizer_key is None:
            return False  # nothing compiled yet; hashing the tokenizer is left to the compile's thread
        with _lock:
            future = _compiled.get((self.tokenizer_key, constraint_key(self._effective(params))))
        return future is not None and future.done() and future.exception() is None

    def compile_async(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar, from the cache or compiling on the background thread."""
        params = self._effective(params)
        key = (self.tokenizer_key, constraint_key(params))
        with _lock:
            future = _compiled.get(key)
            if future is not None:
                return future
            if len(_compiled) >= _MAX_CACHED_GRAMMARS:
                _compiled.pop(next(iter(_compiled)))  # the oldest: insertion order
        future = _compile_pool().submit(self.backend.compile, params)
        with _lock:
            return _compiled.setdefault(key, future)

    def compile(self, params: StructuredOutputsParams, timeout: float | None = None) -> Any:
        """Wait for the compiled grammar; ValueError when it does not compile or takes too long."""
        future = self.compile_async(params)
        timeout = self.compile_timeout if timeout is None else timeout
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            raise ValueError(f"the structured_outputs {params.kind} did not compile within {timeout:g} s; "
                             f"simplify it") from None

    def _effective(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        if self.disable_any_whitespace and not params.disable_any_whitespace:
            return dataclasses.replace(params, disable_any_whitespace=True)
        return params

    # ---- per request -------------------------------------------------------------------------------
    def start(self, params: StructuredOutputsParams, prompt_token_ids: Sequence[int] | None = None,
              enable_thinking: bool = True) -> StructuredOutputRequest:
        """A request's grammar state; with a reasoning parser, its reasoning's phase from its prompt and the chat
        template's ``enable_thinking`` (false: no reasoning, the grammar applies from the first token)."""
        gate = None if self.reasoning_parser is None else self.reasoning_parser.gate(prompt_token_ids, enable_thinking)
        return StructuredOutputRequest(params, self.compile_async(params), time.monotonic() + self.compile_timeout,
                                       reasoning=gate)

    def ready(self, state: StructuredOutputRequest) -> bool:
        """Whether the request's matcher exists (made here once its grammar is compiled); ValueError
        when its grammar failed to compile or its wait ran past the timeout."""
        if state.matcher is not None:
            return True
        if not state.future.done():
            if time.monotonic() > state.deadline:
                raise ValueError(f"the structured_outputs {state.params.kind} did not compile within "
                                 f"{self.compile_timeout:g} s; simplify it")
            return False
        matcher = self.backend.new_matcher(state.future.result())  # raises the compile's ValueError
        state.matcher = matcher if state.reasoning is None else ReasoningMatcher(matcher, state.reasoning)
        return True

    def grammar_bitmask_job(self, constrained: list[tuple[str, StructuredOutputRequest]]
                            ) -> Callable[[], GrammarBitmask | None] | None:
        """``grammar_bitmask`` of these requests, to be called by the runner once the step's forward is launched:
        on CUDA the CPU fills the masks while the GPU computes. None when no request is constrained."""
        if not constrained:
            return None
        return functools.partial(self.grammar_bitmask, constrained)

    def grammar_bitmask(self, constrained: list[tuple[str, StructuredOutputRequest]]) -> GrammarBitmask | None:
        """The masks for the constrained requests that sample this step, filled on the CPU."""
        if not constrained:
            return None
        bitmask = torch.full((len(constrained), bitmask_width(self.vocab_size)), -1, dtype=torch.int32)
        for row, (_, state) in enumerate(constrained):
            if not state.matcher.is_terminated():
                state.matcher.fill_bitmask(bitmask, row)
        return GrammarBitmask([request_id for request_id, _ in constrained], bitmask)

"""The waiting room: requests that wait for something before the scheduler may see them.

A request waits on a set of futures: its grammar compiling, its LoRA adapter being read from disk, for an
``n > 1`` sibling the first completion's prompt being computed. It is admitted when they have all resolved,
and failed with the first error as soon as one fails; the requests admitted together keep the order in
which they came. Every resource is one more future, not one more queue (vLLM V1 keeps a status per resource
in its one waiting queue). No torch.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from kvloom.engine.request import Request

# With nothing else to run, how long one admission pass sleeps on the futures rather than spin. Short: the
# async engine's thread also picks up new requests between steps.
IDLE_WAIT_S = 0.01


class Wait(Protocol):
    """What a request waits on: a ``concurrent.futures.Future``, or a ``Polled`` condition."""

    def done(self) -> bool: ...

    def exception(self) -> BaseException | None: ...


class Polled:
    """A condition the engine checks at each admission pass, seen as a future: done once ``check()`` is true,
    failed with the ``ValueError`` it raises. ``future``, when given, is what the condition waits for, so an
    idle pass can sleep on it."""

    def __init__(self, check: Callable[[], bool], future: Future | None = None) -> None:
        self.check = check
        self.future = future
        self._done = False
        self._error: ValueError | None = None

    def done(self) -> bool:
        if not self._done:
            try:
                self._done = self.check()
            except ValueError as error:
                self._done, self._error = True, error
        return self._done

    def exception(self) -> BaseException | None:
        return self._error


@dataclass
class _Waiting:
    request: Request
    waits: list[Wait]


class WaitingRoom:
    def __init__(self) -> None:
        self._waiting: list[_Waiting] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, request: Request, waits: Iterable[Wait]) -> None:
        self._waiting.append(_Waiting(request, list(waits)))

    def remove(self, request_ids: Iterable[str]) -> list[Request]:
        """Take these requests out (an abort); returns those that were waiting."""
        ids = set(request_ids)
        removed = [entry.request for entry in self._waiting if entry.request.request_id in ids]
        self._waiting = [entry for entry in self._waiting if entry.request.request_id not in ids]
        return removed

    def take(self, idle: bool = False) -> tuple[list[Request], list[tuple[Request, BaseException]]]:
        """The requests whose waits have all resolved, in the order they came, and the requests one of whose
        waits failed, each with the first error (in the order its waits were given). ``idle``: nothing else
        runs, so first sleep up to ``IDLE_WAIT_S`` until one of the futures resolves."""
        if idle:
            futures = [wait.future if isinstance(wait, Polled) else wait
                       for entry in self._waiting for wait in entry.waits]
            futures = [future for future in futures if isinstance(future, Future)]
            if futures:
                concurrent.futures.wait(futures, timeout=IDLE_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED)
        admitted: list[Request] = []
        failed: list[tuple[Request, BaseException]] = []
        still: list[_Waiting] = []
        for entry in self._waiting:
            pending: list[Wait] = []
            for wait in entry.waits:
                if not wait.done():
                    pending.append(wait)
                elif (error := wait.exception()) is not None:
                    failed.append((entry.request, error))
                    break
            else:
                if pending:
                    entry.waits = pending  # what has resolved is not asked again
                    still.append(entry)
                else:
                    admitted.append(entry.request)
        self._waiting = still
        return admitted, failed

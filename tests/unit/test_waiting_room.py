"""The waiting room (kvloom/engine/waiting_room.py): a request waits on a set of futures, is admitted when they
all resolve and failed with the first error; requests admitted together keep the order they came in."""

from __future__ import annotations

import time
from concurrent.futures import Future

from kvloom.engine.request import Request
from kvloom.engine.waiting_room import IDLE_WAIT_S, Polled, WaitingRoom
from kvloom.sampling_params import SamplingParams


def make_request(request_id: str) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(max_tokens=4), set(), 64)


def resolved(value: object = None) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def failed_with(error: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future


def ids(requests: list[Request]) -> list[str]:
    return [request.request_id for request in requests]


def test_a_request_is_admitted_only_when_all_its_futures_resolve() -> None:
    room = WaitingRoom()
    grammar, adapter = Future(), Future()
    room.add(make_request("a"), [grammar, adapter])
    assert room.take() == ([], []) and len(room) == 1
    grammar.set_result("compiled")
    assert room.take() == ([], []) and len(room) == 1
    adapter.set_result("in memory")
    admitted, failed = room.take()
    assert ids(admitted) == ["a"] and failed == [] and len(room) == 0


def test_a_request_fails_with_the_first_error_without_waiting_for_the_rest() -> None:
    room = WaitingRoom()
    pending = Future()
    first, second = ValueError("grammar refused"), OSError("adapter unreadable")
    room.add(make_request("a"), [pending, failed_with(first), failed_with(second)])
    admitted, failed = room.take()
    assert admitted == [] and [(r.request_id, e) for r, e in failed] == [("a", first)]
    assert len(room) == 0


def test_requests_are_admitted_in_the_order_they_came() -> None:
    room = WaitingRoom()
    futures = {name: Future() for name in "abcd"}
    for name, future in futures.items():
        room.add(make_request(name), [future])
    for name in "dbc":  # resolved out of order, in one pass
        futures[name].set_result(None)
    admitted, _ = room.take()
    assert ids(admitted) == ["b", "c", "d"]
    futures["a"].set_exception(ValueError("no"))
    admitted, failed = room.take()
    assert admitted == [] and ids([r for r, _ in failed]) == ["a"]


def test_a_polled_condition_waits_like_a_future() -> None:
    """The n > 1 sibling's wait and the grammar's (compiled, and within its deadline) are conditions the engine
    checks at each pass; a ValueError from the check fails the request."""
    room = WaitingRoom()
    first = make_request("first")
    room.add(make_request("sibling"), [Polled(lambda: first.num_computed_tokens >= first.num_prompt_tokens)])

    def deadline_passed() -> bool:
        raise ValueError("the structured_outputs json did not compile within 1 s")

    room.add(make_request("constrained"), [Polled(deadline_passed)])
    admitted, failed = room.take()
    assert admitted == [] and [(r.request_id, str(e)) for r, e in failed] == [
        ("constrained", "the structured_outputs json did not compile within 1 s")]
    first.num_computed_tokens = first.num_prompt_tokens
    assert ids(room.take()[0]) == ["sibling"]


def test_an_aborted_request_leaves_the_room() -> None:
    room = WaitingRoom()
    room.add(make_request("a"), [Future()])
    room.add(make_request("b"), [resolved()])
    assert ids(room.remove(["a", "unknown"])) == ["a"]
    assert ids(room.take()[0]) == ["b"] and len(room) == 0


def test_an_idle_pass_sleeps_a_little_on_the_futures() -> None:
    room = WaitingRoom()
    compiling: Future = Future()
    room.add(make_request("a"), [Polled(lambda: compiling.done(), compiling)])
    start = time.perf_counter()
    assert room.take(idle=True) == ([], [])
    assert IDLE_WAIT_S <= time.perf_counter() - start < IDLE_WAIT_S + 0.5
    compiling.set_result(None)
    assert ids(room.take(idle=True)[0]) == ["a"]

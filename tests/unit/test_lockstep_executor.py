"""LockstepExecutor's failure rules, with fake ranks (no processes): an error outside the forward
pass leaves the executor usable, one inside it (a dead rank, or rank 0 interrupted) fails this and
every later step, a dead rank is named, and only an error inside the forward waits for the report."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvloom.executor.base import LockstepExecutor


class FakeModel:
    def __init__(self) -> None:
        self.hooks: list[Callable[..., None]] = []

    def register_forward_hook(self, hook: Callable[..., None]) -> None:
        self.hooks.append(hook)


class FakeDriver:
    """A runner whose step sends its inputs, runs the forward, then samples; ``fail_at`` names the
    stage that raises ``error``."""

    def __init__(self) -> None:
        self.model = FakeModel()
        self.broadcast_inputs: Callable[[Any], None] | None = None
        self.fail_at: str | None = None
        self.error: BaseException = RuntimeError("boom")
        self.num_blocks: int | None = None

    def init_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def execute(self, scheduler_output: Any) -> str:
        if self.fail_at == "prepare":
            raise self.error
        self.broadcast_inputs("inputs")
        if self.fail_at == "forward":
            raise self.error
        for hook in self.model.hooks:
            hook()
        if self.fail_at == "sample":
            raise self.error
        return "output"


class FakeExecutor(LockstepExecutor):
    failure_report_s = 0.5

    def __init__(self) -> None:
        self.driver = FakeDriver()
        self.sent: list[tuple] = []
        self.dead_rank: int | None = None  # the rank that is dead, as _rank_failure reports it
        self.reported_after_wait = False  # the death only shows to a waiting _rank_failure
        self.waits: list[float] = []
        self.out_of_step = False
        self.stopped: list[bool] = []
        self._own_stop(self.stopped.append, True)
        self._start_lockstep()

    def _send(self, method: str, *args: Any) -> None:
        self.sent.append((method, *args))

    def _collect(self) -> list[Any]:
        return []

    def _rank_failure(self, wait_s: float) -> str | None:
        if wait_s > 0:
            self.waits.append(wait_s)
        if self.dead_rank is None or (self.reported_after_wait and wait_s == 0):
            return None
        return f"tensor-parallel rank {self.dead_rank} exited with code -9"

    def _on_out_of_step(self) -> None:
        self.out_of_step = True


def test_a_step_sends_its_inputs_to_the_ranks() -> None:
    executor = FakeExecutor()
    assert executor.execute(None) == "output"
    assert executor.sent == [("forward", "inputs")]
    executor.init_kv_cache(7)
    assert executor.sent[-1] == ("init_kv_cache", 7) and executor.driver.num_blocks == 7


@pytest.mark.parametrize("stage", ["prepare", "sample"])
def test_an_error_outside_the_forward_is_raised_as_is_and_the_executor_goes_on(stage: str) -> None:
    executor = FakeExecutor()
    executor.driver.fail_at = stage
    with pytest.raises(RuntimeError, match="boom"):
        executor.execute(None)
    assert executor.waits == []  # the ranks are in step: nothing to wait for
    executor.driver.fail_at = None
    assert executor.execute(None) == "output"


def test_a_dead_rank_fails_the_step_naming_it_and_every_later_call() -> None:
    executor = FakeExecutor()
    executor.driver.fail_at = "forward"
    executor.dead_rank, executor.reported_after_wait = 1, True  # reaped a moment after the collective failed
    with pytest.raises(RuntimeError, match="rank 1 exited with code -9") as caught:
        executor.execute(None)
    assert isinstance(caught.value.__cause__, RuntimeError) and str(caught.value.__cause__) == "boom"
    assert executor.waits == [0.5] and executor.out_of_step
    executor.driver.fail_at = None
    with pytest.raises(RuntimeError, match="(?s)rank 1 exited.*cannot continue"):
        executor.execute(None)
    with pytest.raises(RuntimeError, match="cannot continue"):
        executor.init_kv_cache(3)


def test_a_dead_rank_is_found_before_a_step_starts() -> None:
    executor = FakeExecutor()
    executor.dead_rank = 1
    with pytest.raises(RuntimeError, match="(?s)rank 1 exited.*cannot continue"):
        executor.execute(None)
    assert executor.sent == []


def test_rank_0_interrupted_inside_the_forward_leaves_the_ranks_out_of_step() -> None:
    executor = FakeExecutor()
    executor.driver.fail_at, executor.driver.error = "forward", KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        executor.execute(None)
    assert executor.waits == []  # Ctrl-C does not wait for a rank's death report
    assert executor.out_of_step
    executor.driver.fail_at = None
    with pytest.raises(RuntimeError, match="(?s)interrupted inside the forward pass.*out of step"):
        executor.execute(None)


def test_shutdown_runs_the_stop_once_and_refuses_later_calls() -> None:
    executor = FakeExecutor()
    executor.shutdown()
    executor.shutdown()
    assert executor.stopped == [True]
    with pytest.raises(RuntimeError, match="shut down"):
        executor.execute(None)

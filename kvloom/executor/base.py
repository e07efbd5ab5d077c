"""The executor interface: what the engine needs from whatever runs the model (one process, or one
process per tensor-parallel rank). ``driver`` is rank 0's runner: it prepares inputs and samples.

``LockstepExecutor`` is the part the tensor-parallel executors share (the multiprocess one and the
Ray one): rank 0 runs in the engine's process and sends each step's inputs to the other ranks, the
all-reduces inside the model keep the ranks in lockstep, and a rank that fails fails the step with
an error naming it, after which every later call fails. An executor says only how to reach its
ranks: ``_send`` (ask every other rank to run a method), ``_collect`` (wait for their answers),
``_rank_failure`` (whether a rank is dead or failed, named) and the stop function it owns.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvloom.step_io import ModelRunnerOutput, SchedulerOutput
from kvloom.worker.model_runner import ModelInputs, ModelRunner


class Executor:
    driver: ModelRunner

    def determine_num_kv_blocks(self) -> int:
        """KV blocks (the null block included) that fit every rank's memory budget."""
        return self.driver.determine_num_kv_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.driver.init_kv_cache(num_blocks)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver.execute(scheduler_output)

    def execute_async(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Launch a step; the returned function waits for it (the host may work in between)."""
        return self.driver.execute_async(scheduler_output)

    def release_requests(self, request_ids: list[str]) -> None:
        """Forget finished requests' state (their seeded generators, the tokens they sampled)."""
        self.driver.release_requests(request_ids)

    def prefetch_lora(self, lora_request: Any) -> Future | None:
        """Start reading a LoRA adapter (a LoRARequest) into host memory off the engine's thread: the future of
        its host copy (done at once when cached), or None without LoRA."""
        return self.driver.prefetch_lora(lora_request)

    def shutdown(self) -> None:
        pass


class LockstepExecutor(Executor):
    """Rank 0 (``driver``) here, ranks 1..N-1 elsewhere, every step run by all of them in lockstep.

    A subclass builds its ranks and the driver, calls ``_own_stop`` as soon as it holds anything to
    tidy (its stop function must not hold the executor: a finalizer and atexit keep it) and
    ``_start_lockstep`` once the driver's model is loaded, and implements the three hooks below.

    Failures. A step is out of step with the ranks from the moment its inputs go out until rank 0's
    forward pass returns (``_in_forward``): an error there (a rank died and a collective failed,
    or rank 0 itself was interrupted between two all-reduces) leaves the next collectives paired
    wrongly, so the executor refuses every later call. An error outside that window (preparing
    inputs, sampling) leaves the ranks in step and is raised as it is, unless a rank is found dead.
    """

    # How long a step that failed inside its forward pass waits for the rank that caused it to show
    # as dead: a collective fails as soon as a peer's socket closes, which can be a moment before the
    # dying rank is reaped (or, on Ray, before its death reaches the driver). Set per executor.
    failure_report_s: float = 2.0

    _failed: str | None = None  # why the executor refuses every call; None while all is well
    _in_forward: bool = False  # True from sending a step's inputs until rank 0's forward returns
    _finalizer: weakref.finalize | None = None

    # ---- the hooks ------------------------------------------------------------------------------
    def _send(self, method: str, *args: Any) -> None:
        """Ask every other rank to run ``method(*args)`` (on its ModelRunner); do not wait."""
        raise NotImplementedError

    def _collect(self) -> list[Any]:
        """Wait for every other rank's answer to the last ``_send`` (rank order); a RuntimeError
        (or the transport's own error) as soon as one fails or dies."""
        raise NotImplementedError

    def _rank_failure(self, wait_s: float) -> str | None:
        """What went wrong with the other ranks (which rank died or failed, and how), or None if all
        are well; ``wait_s`` > 0 waits up to that long for a failure to show."""
        raise NotImplementedError

    def _on_out_of_step(self) -> None:
        """Called when rank 0 left a forward pass midway: the others may be stuck in a collective."""

    # ---- set-up ---------------------------------------------------------------------------------
    def _own_stop(self, stop: Callable[..., None], *args: Any) -> None:
        """``stop(*args)`` runs once: on shutdown(), when the executor is collected, or at interpreter
        exit (registered after multiprocessing's own exit hook, so it runs first)."""
        self._finalizer = weakref.finalize(self, stop, *args)
        self._finalizer.atexit = False
        atexit.register(self._finalizer)

    def _start_lockstep(self) -> None:
        """Route the driver's inputs to the other ranks and watch the forward pass's window."""
        self._in_forward = False
        self.driver.broadcast_inputs = self._broadcast_inputs
        self.driver.model.register_forward_hook(self._forward_done)

    # ---- the Executor interface -----------------------------------------------------------------
    def init_kv_cache(self, num_blocks: int) -> None:
        self._check_ranks()
        self._send("init_kv_cache", num_blocks)
        self.driver.init_kv_cache(num_blocks)
        self._collect()

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._check_ranks()
        try:
            return self.driver.execute(scheduler_output)
        except BaseException as error:
            in_forward = self._in_forward
            failure = self._rank_failure(0.0)
            if failure is None and in_forward and isinstance(error, Exception):
                failure = self._rank_failure(self.failure_report_s)
            if failure is None and not in_forward:
                raise  # before the inputs went out or after the forward: the ranks are still in step
            # A rank is gone, or rank 0 left the forward pass between two all-reduces (Ctrl-C, an
            # error): the next collectives would pair up wrongly, so no further step runs.
            if in_forward:
                self._on_out_of_step()
            self._failed = failure or (f"a step was interrupted inside the forward pass ({error!r}); "
                                       f"the ranks are out of step")
            if failure is not None and isinstance(error, Exception):
                raise RuntimeError(failure) from error
            raise

    def execute_async(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """The ranks run in lockstep with their failures checked around the step: it runs whole here."""
        output = self.execute(scheduler_output)
        return lambda: output

    def shutdown(self) -> None:
        if self._finalizer is not None:
            atexit.unregister(self._finalizer)
            self._finalizer()

    # ---- internals ------------------------------------------------------------------------------
    def _check_ranks(self) -> None:
        if self._finalizer is None or not self._finalizer.alive:
            raise RuntimeError("the tensor-parallel executor was shut down")
        if self._failed is None:
            self._failed = self._rank_failure(0.0)
        if self._failed is not None:
            raise RuntimeError(f"{self._failed}\nthe tensor-parallel engine cannot continue; start a new one")

    def _forward_done(self, *_: Any) -> None:
        self._in_forward = False

    def _broadcast_inputs(self, inputs: ModelInputs) -> None:
        self._in_forward = True
        try:
            self._send("forward", inputs)
        except OSError as error:  # a rank's connection broke
            self._failed = self._rank_failure(0.0) or f"a rank's connection broke: {error!r}"
            raise RuntimeError(self._failed) from error

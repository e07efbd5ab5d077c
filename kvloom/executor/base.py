"""The executor interface: what the engine needs from whatever runs the model (one process, or one
process per tensor-parallel rank). ``driver`` is rank 0's runner: it prepares inputs and samples."""

from __future__ import annotations

from collections.abc import Callable

from kvloom.step_io import ModelRunnerOutput, SchedulerOutput
from kvloom.worker.model_runner import ModelRunner


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

    def shutdown(self) -> None:
        pass

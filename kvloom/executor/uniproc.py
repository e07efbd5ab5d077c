"""The single-process executor: the driver's ModelRunner does everything."""

from __future__ import annotations

import torch

from kvloom.config import EngineConfig
from kvloom.engine.scheduler import SchedulerOutput
from kvloom.loader.model_config import ModelConfig
from kvloom.loader.weights import ModelSource
from kvloom.worker.model_runner import ModelRunner, ModelRunnerOutput


class Executor:
    """What the engine needs from an executor. ``driver`` is rank 0's runner (it samples)."""

    driver: ModelRunner

    def kv_bytes_per_block(self) -> int:
        return self.driver.kv_bytes_per_block()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.driver.init_kv_cache(num_blocks)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver.execute(scheduler_output)

    def release_requests(self, request_ids: list[str]) -> None:
        self.driver.release_requests(request_ids)

    def shutdown(self) -> None:
        pass


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig, model_config: ModelConfig, source: ModelSource,
                 device: torch.device, dtype: torch.dtype, block_size: int, max_model_len: int) -> None:
        self.driver = ModelRunner(config, model_config, device, dtype, block_size, max_model_len)
        self.driver.load_model(source)

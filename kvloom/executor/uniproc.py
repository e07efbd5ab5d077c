"""The single-process executor: the driver's ModelRunner does everything."""

from __future__ import annotations

from kvloom.config import ResolvedConfig
from kvloom.executor.base import Executor
from kvloom.worker.model_runner import ModelRunner


class UniprocExecutor(Executor):
    def __init__(self, config: ResolvedConfig) -> None:
        self.driver = ModelRunner(config)
        self.driver.load_model()

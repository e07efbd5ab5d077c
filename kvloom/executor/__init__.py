"""Executors run the model runner(s): one process, or one process per tensor-parallel rank."""

from __future__ import annotations

from kvloom.config import ResolvedConfig
from kvloom.executor.base import Executor


def build_executor(config: ResolvedConfig) -> Executor:
    if config.engine.tensor_parallel_size > 1:
        from kvloom.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from kvloom.executor.uniproc import UniprocExecutor

    return UniprocExecutor(config)

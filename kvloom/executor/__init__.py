"""Executors run the model runner(s): one process, one process per tensor-parallel rank ("mp"),
or one Ray actor per rank but the driver's ("ray"). With one rank there is nothing to distribute:
the one-process executor runs whatever the backend."""

from __future__ import annotations

from kvloom.config import ResolvedConfig
from kvloom.executor.base import Executor


def build_executor(config: ResolvedConfig) -> Executor:
    if config.engine.tensor_parallel_size > 1 and config.engine.distributed_executor_backend == "ray":
        from kvloom.executor.ray import RayExecutor

        return RayExecutor(config)
    if config.engine.tensor_parallel_size > 1:
        from kvloom.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from kvloom.executor.uniproc import UniprocExecutor

    return UniprocExecutor(config)

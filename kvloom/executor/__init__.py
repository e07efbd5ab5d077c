"""Executors run the model runner(s): one process, or one process per tensor-parallel rank."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvloom.executor.uniproc import Executor


def build_executor(config, model_config, source, device, dtype, block_size: int, max_model_len: int
                   ) -> Executor:
    if config.tensor_parallel_size > 1:
        from kvloom.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, model_config, source, device, dtype, block_size, max_model_len)
    from kvloom.executor.uniproc import UniprocExecutor

    return UniprocExecutor(config, model_config, source, device, dtype, block_size, max_model_len)

"""Which device runs the model, and how the host is set up for it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvloom.config import EngineConfig


def resolve_device(requested: str) -> torch.device:
    """'auto' picks CUDA when torch sees a GPU, else the CPU; a device that is absent is a ValueError."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {requested!r} was requested but torch sees no CUDA GPU here; "
                             f"use device='cpu' or 'auto'")
        device = torch.device(requested)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {requested!r} does not exist: torch sees "
                             f"{torch.cuda.device_count()} GPU(s)")
        return device
    return torch.device("cpu")


def resolve_dtype(requested: str, stored: str | None, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 for checkpoints stored in 16 bits or quantized, float32 for float32 ones."""
    if requested != "auto":
        dtype = getattr(torch, requested)
    elif stored == "float32":
        dtype = torch.float32
    elif stored == "float16" and device.type == "cuda":
        dtype = torch.float16
    else:
        dtype = torch.bfloat16
    if dtype == torch.float16 and device.type == "cpu":
        raise ValueError("dtype float16 is slow and inexact on the CPU; use bfloat16 or float32")
    return dtype


def configure_host(config: EngineConfig, device: torch.device) -> None:
    if device.type == "cpu":
        threads = config.backend.num_threads or os.cpu_count() or 1
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build modules whose parameters are created in ``dtype`` (torch's default dtype, restored after)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)

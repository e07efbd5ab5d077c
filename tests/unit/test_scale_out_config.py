"""The scale-out settings refuse clearly: the Ray backend without Ray installed (this test runs
whether or not it is), an unknown backend."""

from __future__ import annotations

import pytest

import kvloom.ray_cluster
from kvloom.config import EngineConfig


def test_ray_backend_without_ray_installed_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvloom.ray_cluster, "ray_installed", lambda: False)
    with pytest.raises(ValueError, match=r"distributed_executor_backend='ray' needs Ray, which is not installed; "
                                         r"install it with: pip install 'kvloom\[ray\]'"):
        EngineConfig(tensor_parallel_size=2, distributed_executor_backend="ray")


def test_require_ray_names_what_needed_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_ray(name: str, *args: object, **kwargs: object) -> object:
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ValueError, match="--data-parallel-size on Ray needs Ray, which is not installed"):
        kvloom.ray_cluster.require_ray("--data-parallel-size on Ray")


def test_unknown_executor_backend_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"distributed_executor_backend must be one of \['mp', 'ray'\], got 'mpi'"):
        EngineConfig(distributed_executor_backend="mpi")

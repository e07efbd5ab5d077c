"""``kvloom env``: what this machine offers and what kvloom runs on it, for bug reports (vLLM's collect-env).

Versions, the CPU and its ISA level, torch's own CPU capability and oneDNN, the C++ kernels built for the level
in force, the ops a model gets per dtype, threads, CUDA, and the KVLOOM_* variables that are set.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from typing import Any

from kvloom import envs
from kvloom.cpu_capability import cpu_capability
from kvloom.version import __version__

PACKAGES = ("torch", "triton", "transformers", "tokenizers", "safetensors", "gguf", "numpy", "fastapi", "uvicorn",
            "pydantic", "ray")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _ops_summary(dtype: Any) -> dict[str, Any]:
    """What a model in ``dtype`` on this CPU gets from the op table."""
    import torch

    from kvloom.ops import cpu
    from kvloom.ops.table import select_ops

    ops = select_ops(torch.device("cpu"), dtype)
    int8 = getattr(ops.pack_linear_int8, "func", ops.pack_linear_int8)
    return {"table": ops.name, "linear": cpu.linear_format(dtype) or "F.linear (torch)",
            "int8_linear": getattr(int8, "__name__", str(int8)),
            "layer_stack": ops.llama_layer_stack is not None and cpu.linear_format(dtype) in ("kvloom", "hybrid")}


def collect() -> dict[str, Any]:
    """The report as plain data (``kvloom env --json``)."""
    import torch

    from kvloom.ops import cpu
    from kvloom.platform import cpu_has_fast_bf16, torch_level_mismatch

    capability = cpu_capability()
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        affinity = list(range(os.cpu_count() or 1))
    report: dict[str, Any] = {
        "kvloom": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "cpu": {
            "model": capability.model_name, "architecture": capability.architecture,
            "isa_detected": capability.detected, "isa_level": capability.level,
            "features": capability.features, "logical_cpus": os.cpu_count(), "affinity": affinity,
        },
        "torch_cpu": {
            "aten_capability": torch.backends.cpu.get_cpu_capability(),
            "mkldnn": torch.backends.mkldnn.is_available(), "onednn_bf16": capability.onednn_bf16,
            "mkl": torch.backends.mkl.is_available(), "threads": torch.get_num_threads(),
            "level_mismatch": torch_level_mismatch(),
        },
        "kernels": {
            "built": cpu.cpu_kernel_available(), "variant": cpu.loaded_variant, "compiled_isa": cpu.compiled_isa(),
            "directory": str(cpu.extension_dir()),
        },
        "dtype_auto_on_cpu": "bfloat16" if cpu_has_fast_bf16() else "float32",
        "ops": {name: _ops_summary(dtype) for name, dtype in (("bfloat16", torch.bfloat16),
                                                              ("float32", torch.float32))},
        "cuda": {"available": torch.cuda.is_available(),
                 "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]},
        "environment": {name: os.environ[name] for name in envs.ENVIRONMENT_VARIABLES if os.environ.get(name)},
    }
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = []

    def section(title: str, values: dict[str, Any]) -> None:
        lines.append(title)
        for key, value in values.items():
            if isinstance(value, list):
                value = " ".join(str(v) for v in value) or "-"
            lines.append(f"  {key:<20} {value}")

    section("kvloom", {"version": report["kvloom"], "python": report["python"], "platform": report["platform"]})
    section("packages", {k: v or "not installed" for k, v in report["packages"].items()})
    section("cpu", report["cpu"])
    section("torch on the cpu", report["torch_cpu"])
    section("kvloom's cpu kernels", report["kernels"])
    lines.append(f"dtype='auto' on the cpu: {report['dtype_auto_on_cpu']}")
    for dtype, ops in report["ops"].items():
        section(f"ops for {dtype}", ops)
    section("cuda", report["cuda"])
    section("KVLOOM_* set", report["environment"] or {"(none)": ""})
    return "\n".join(lines)


def main(as_json: bool = False) -> int:
    report = collect()
    print(json.dumps(report, indent=2) if as_json else format_report(report))
    return 0

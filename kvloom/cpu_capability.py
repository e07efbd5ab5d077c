"""What this CPU can run, detected once: its SIMD level, the features kvloom's kernels use, and the level
in force.

Levels, lowest first (``LEVELS``):

    generic   no SIMD kernels of our own: the C++ ops built without -march (scalar loops the compiler
              vectorizes for the baseline ISA); torch's own ops at ATen's DEFAULT capability
    avx2      AVX2 + FMA + F16C (x86-64-v3): kvloom's AVX2 kernels, bf16 values widened to fp32 in registers
    avx512    AVX-512 F/BW/VL/DQ, with AVX512-BF16 (vdpbf16ps) and AVX512-VNNI (vpdpbusd) where present

An aarch64 CPU reports NEON / SVE among its features and runs the generic level's kernels built for it
(-march=native). ``KVLOOM_CPU_ISA=avx512|avx2|generic`` caps the level: the engine then behaves exactly as
on a CPU that has no more than that. The cap reaches torch too (``ATEN_CPU_CAPABILITY`` and oneDNN's
``ONEDNN_MAX_CPU_ISA``, both read by torch at its first CPU op: ``apply_to_torch`` sets them as kvloom
is imported), and the C++ kernels are compiled for it. A level the CPU lacks is a ValueError.

This module imports no torch: it reads /proc/cpuinfo (or asks the OS where there is none).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

from kvloom import envs

LEVELS = ("generic", "avx2", "avx512")
# What each level needs of the CPU (x86 /proc/cpuinfo flag names).
LEVEL_REQUIRES = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
}
# The features this project's kernels, torch and oneDNN choose by, as /proc/cpuinfo names them.
FEATURES = ("avx2", "fma", "f16c", "avx_vnni", "avx_ne_convert", "avx512f", "avx512bw", "avx512vl", "avx512dq",
            "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2")
# torch's names for the level (ATEN_CPU_CAPABILITY) and oneDNN's cap (ONEDNN_MAX_CPU_ISA).
ATEN_CAPABILITY = {"generic": "default", "avx2": "avx2", "avx512": "avx512"}
ONEDNN_MAX_ISA = {"generic": "SSE41", "avx2": "AVX2", "avx512": "ALL"}


def _level_of(flag: str) -> str:
    """The lowest level at which a feature is usable (features of a higher level are hidden by a cap)."""
    if flag.startswith(("avx512", "amx")):
        return "avx512"
    if flag in ("avx2", "fma", "f16c", "avx_vnni", "avx_ne_convert"):
        return "avx2"
    return "generic"


@dataclass(frozen=True)
class CpuCapability:
    architecture: str       # platform.machine(): x86_64, aarch64, ...
    model_name: str
    cpu_flags: frozenset[str]  # everything the CPU reports
    detected: str           # the highest level the CPU supports
    level: str              # the level in force: ``detected``, or KVLOOM_CPU_ISA's lower one

    @property
    def capped(self) -> bool:
        return self.level != self.detected

    def has(self, feature: str) -> bool:
        """Whether the feature is on this CPU and allowed at the level in force."""
        return feature in self.cpu_flags and LEVELS.index(_level_of(feature)) <= LEVELS.index(self.level)

    @property
    def features(self) -> list[str]:
        """The features kvloom knows of that are usable at the level in force."""
        return [f for f in FEATURES if self.has(f)]

    @property
    def onednn_bf16(self) -> bool:
        """Whether oneDNN computes bf16 products here (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
        return self.level == "avx512" or self.has("avx_ne_convert")

    def compiler_flags(self) -> list[str]:
        """The C++ kernels' -march for this level: this CPU's own at its detected level (the library then only
        loads on this CPU model: cpu.py keys it so), the x86-64-v3 baseline (tuned for this CPU) when capped to
        avx2, the baseline ISA when capped to generic."""
        if not self.capped:
            return ["-march=native"]
        if self.level == "avx2":
            return ["-march=x86-64-v3", "-mtune=native"]
        return ["-mtune=native"]

    def describe(self) -> str:
        """One line for the log: the CPU, the level in force (and the detected one if capped), its features."""
        capped = f" (capped by KVLOOM_CPU_ISA; the CPU has {self.detected})" if self.capped else ""
        return (f"{self.model_name or 'unknown CPU'} [{self.architecture}], ISA level {self.level}{capped}; "
                f"features: {' '.join(self.features) or 'none'}")


def _read_cpuinfo() -> tuple[str, frozenset[str]]:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return platform.processor(), frozenset()
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model, frozenset(flags)


def detect_level(architecture: str, flags: frozenset[str]) -> str:
    """The highest level these CPU flags support."""
    if architecture not in ("x86_64", "AMD64", "amd64"):
        return "generic"
    for level in ("avx512", "avx2"):
        if all(flag in flags for flag in LEVEL_REQUIRES[level]):
            return level
    return "generic"


def requested_level() -> str | None:
    """KVLOOM_CPU_ISA, checked to be a known level; None when unset."""
    raw = envs.get("KVLOOM_CPU_ISA")
    if raw is None:
        return None
    level = raw.lower()
    if level not in LEVELS:
        raise ValueError(f"KVLOOM_CPU_ISA={raw!r} is not a level kvloom knows; use one of {', '.join(LEVELS)}")
    return level


def make_capability(architecture: str, model_name: str, flags: frozenset[str], requested: str | None
                    ) -> CpuCapability:
    """The capability of a CPU with these flags, capped at ``requested``; ValueError when it asks for more
    than the CPU has."""
    detected = detect_level(architecture, flags)
    level = detected if requested is None else requested
    if LEVELS.index(level) > LEVELS.index(detected):
        raise ValueError(f"KVLOOM_CPU_ISA={requested} asks for more than this CPU has ({model_name or architecture} "
                         f"supports up to {detected}); use one of "
                         f"{', '.join(LEVELS[:LEVELS.index(detected) + 1])}")
    return CpuCapability(architecture=architecture, model_name=model_name, cpu_flags=flags, detected=detected,
                         level=level)


@functools.cache
def cpu_capability() -> CpuCapability:
    """This CPU's capability with KVLOOM_CPU_ISA applied, detected once per process."""
    model, flags = _read_cpuinfo()
    return make_capability(platform.machine(), model, flags, requested_level())


def apply_to_torch() -> None:
    """Cap torch's own CPU kernels at the level in force (ATen's dispatch and oneDNN), unless the user set
    those variables. They are read at torch's first CPU op, so this runs as kvloom is imported."""
    if envs.get("KVLOOM_CPU_ISA") is None:
        return
    capability = cpu_capability()
    if capability.capped:
        os.environ.setdefault("ATEN_CPU_CAPABILITY", ATEN_CAPABILITY[capability.level])
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", ONEDNN_MAX_ISA[capability.level])


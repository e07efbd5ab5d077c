"""The CPU's capability: levels detected from the CPU's flags, KVLOOM_CPU_ISA's cap (on kvloom's features, its
kernels' compiler flags, torch's ATen and oneDNN), the clear error for a level the CPU lacks, and kvloom env."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvloom.cpu_capability import LEVELS, cpu_capability, make_capability

ZEN4 = frozenset("fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni".split())
EPYC_AVX2 = frozenset("fpu sse2 avx avx2 fma f16c bmi2".split())
OLD_X86 = frozenset("fpu sse2 sse4_2 avx".split())
GRAVITON = frozenset("fp asimd sve sve2".split())


@pytest.mark.parametrize(("arch", "flags", "level"), [("x86_64", ZEN4, "avx512"), ("x86_64", EPYC_AVX2, "avx2"),
                                                      ("x86_64", OLD_X86, "generic"), ("aarch64", GRAVITON, "generic")])
def test_the_level_is_the_highest_the_flags_support(arch: str, flags: frozenset[str], level: str) -> None:
    capability = make_capability(arch, "cpu", flags, None)
    assert capability.detected == capability.level == level and not capability.capped
    assert capability.compiler_flags() == ["-march=native"]


def test_a_cap_hides_the_features_above_it_and_builds_for_the_baseline() -> None:
    capability = make_capability("x86_64", "Zen 4", ZEN4, "avx2")
    assert capability.capped and capability.level == "avx2" and capability.detected == "avx512"
    assert capability.features == ["avx2", "fma", "f16c"]
    assert not capability.has("avx512_bf16") and not capability.onednn_bf16
    assert capability.compiler_flags() == ["-march=x86-64-v3", "-mtune=native"]
    generic = make_capability("x86_64", "Zen 4", ZEN4, "generic")
    assert generic.features == [] and "-march=native" not in generic.compiler_flags()
    full = make_capability("x86_64", "Zen 4", ZEN4, None)
    assert full.has("avx512_bf16") and full.onednn_bf16 and "avx512_vnni" in full.features
    assert make_capability("aarch64", "Graviton", GRAVITON, None).features == ["asimd", "sve", "sve2"]


def test_asking_for_a_level_the_cpu_lacks_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="KVLOOM_CPU_ISA=avx512 asks for more than this CPU has .*up to avx2.*"
                                         "generic, avx2"):
        make_capability("x86_64", "AMD EPYC", EPYC_AVX2, "avx512")
    with pytest.raises(ValueError, match="asks for more than this CPU has"):
        make_capability("aarch64", "Graviton", GRAVITON, "avx2")


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    """code in a fresh interpreter, with this process's level unless env sets another."""
    environment = dict(os.environ)
    if "KVLOOM_CPU_ISA" in env:  # torch's caps follow the new level
        environment.pop("ATEN_CPU_CAPABILITY", None)
        environment.pop("ONEDNN_MAX_CPU_ISA", None)
    environment.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=300)


def test_an_unknown_level_names_the_known_ones() -> None:
    result = _run("from kvloom.cpu_capability import cpu_capability; cpu_capability()", KVLOOM_CPU_ISA="sse9")
    assert result.returncode != 0
    assert "KVLOOM_CPU_ISA='sse9' is not a level kvloom knows; use one of generic, avx2, avx512" in result.stderr


def test_the_cap_reaches_torch_when_kvloom_is_imported_first() -> None:
    code = "import kvloom, torch, os; print(torch.backends.cpu.get_cpu_capability(), os.environ['ONEDNN_MAX_CPU_ISA'])"
    result = _run(code, KVLOOM_CPU_ISA="generic")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["DEFAULT", "SSE41"]


def test_kvloom_env_reports_the_level_and_the_kernels_built_for_it() -> None:
    level = cpu_capability().level
    result = _run("from kvloom.entrypoints.cli import main; main(['env', '--json'])")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["cpu"]["isa_level"] == level and report["cpu"]["isa_detected"] == cpu_capability().detected
    assert report["torch_cpu"]["level_mismatch"] is None
    assert report["kernels"]["built"] and report["kernels"]["compiled_isa"].split()[0] == level
    # kvloom's GEMM (on AMX tiles where the CPU has them): oneDNN's packing beside it ("hybrid") only with
    # KVLOOM_CPU_ONEDNN=force.
    expected_linear = "kvloom" if level in ("avx2", "avx512") else "F.linear (torch)"
    assert report["ops"]["bfloat16"]["linear"] in (expected_linear, "onednn")
    assert report["dtype_auto_on_cpu"] == ("bfloat16" if level in ("avx2", "avx512") else "float32")
    text = _run("from kvloom.entrypoints.cli import main; main(['env'])")
    assert f"isa_level            {level}" in text.stdout


def test_levels_are_ordered_lowest_first() -> None:
    assert LEVELS == ("generic", "avx2", "avx512")

"""oneDNN's packed bf16 product inside ``PackedWeight`` (kvloom/ops/cpu.py), taken under KVLOOM_CPU_ONEDNN=force on
any CPU (oneDNN's AVX-512 kernels, AMX ones on an AMX CPU, or fp32 ones where oneDNN has no bf16 product, as on
AVX2). The packing is made inside the product and never held as an attribute:
the weight pickles, maps and moves as plain tensors."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

from kvloom.ops import cpu, huge_pages
from kvloom.worker import packed_cache


@pytest.fixture(autouse=True)
def forced(monkeypatch: pytest.MonkeyPatch) -> None:
    if cpu.linear_format(torch.bfloat16) is None or not torch.backends.mkldnn.is_available():
        pytest.skip("no packed bf16 GEMM or no oneDNN in this torch")
    monkeypatch.setenv("KVLOOM_CPU_ONEDNN", "force")


def _weights(n: int = 96, k: int = 160) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16(), torch.randn(n, generator=g).bfloat16()


def _saved_and_mapped(obj: object, tmp_path) -> object:
    path = tmp_path / "w.pt"
    torch.save(obj, path, pickle_module=packed_cache._PickleModule)
    return torch.load(path, mmap=True, weights_only=False)


def test_the_knob_gives_the_hybrid_format_on_any_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    if not cpu.cpu_kernel_available():
        pytest.skip("kvloom's GEMM is not built here")
    assert cpu.linear_format(torch.bfloat16) == "hybrid"
    monkeypatch.setenv("KVLOOM_CPU_ONEDNN", "0")
    assert cpu.linear_format(torch.bfloat16) == "kvloom"
    monkeypatch.setenv("KVLOOM_CPU_ONEDNN", "sometimes")
    with pytest.raises(ValueError, match="KVLOOM_CPU_ONEDNN='sometimes': expected auto, force or 0"):
        cpu.linear_format(torch.bfloat16)


@pytest.mark.parametrize("fmt", ["hybrid", "onednn"])
def test_packed_weight_holds_plain_tensors_and_round_trips(fmt: str, tmp_path) -> None:
    if fmt == "hybrid" and not cpu.cpu_kernel_available():
        pytest.skip("kvloom's GEMM is not built here")
    weight, bias = _weights()
    packed = cpu.PackedWeight(weight, bias, fmt)
    held = [v for v in vars(packed).values() if isinstance(v, torch.Tensor)]
    assert held and not any(t.is_mkldnn for t in held)
    assert not any(t.is_mkldnn for t in packed_cache.held_tensors(packed, every_view=True))
    x1, x8 = torch.randn(1, 160).bfloat16(), torch.randn(8, 160).bfloat16()
    expected8 = F.linear(x8.float(), weight.float(), bias.float())
    torch.testing.assert_close(packed(x8).float(), expected8, atol=2e-2, rtol=2e-2)  # oneDNN's product (4+ rows)
    if fmt == "hybrid":  # one row: kvloom's GEMM, as the plain "kvloom" format computes it
        assert torch.equal(packed(x1), cpu.PackedWeight(weight, bias, "kvloom")(x1))
    pickle.dumps(packed)  # an opaque oneDNN tensor would raise here
    for copy in (_saved_and_mapped(packed, tmp_path), pickle.loads(pickle.dumps(packed))):
        assert torch.equal(copy(x8), packed(x8)) and torch.equal(copy(x1), packed(x1))
        if fmt == "onednn":  # read back from oneDNN's packing to pickle: the weight as given
            state = copy.__getstate__()
            assert torch.equal(state["weight"], weight)


def test_a_mapped_hybrid_weight_moves_onto_huge_pages(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not cpu.cpu_kernel_available():
        pytest.skip("kvloom's GEMM is not built here")
    weight, bias = _weights(256, 512)
    x = torch.randn(6, 512).bfloat16()
    mapped = _saved_and_mapped(cpu.PackedWeight(weight, bias, "hybrid"), tmp_path)
    expected = mapped(x)
    monkeypatch.setattr(huge_pages, "available", lambda: True)
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 4096)
    rehome = huge_pages.StepwiseRehome.start(packed_cache.held_tensors(mapped, every_view=True))
    assert rehome is not None
    rehome.finish()
    assert mapped.data.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert torch.equal(mapped(x), expected)

"""The packed bf16 linears (csrc/gemm.cpp and oneDNN's) against F.linear."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kvloom.layers.embedding import LMHead
from kvloom.layers.linear import Linear
from kvloom.ops.cpu import PackedWeight, gemm_panel, linear_format, pack_gemm_weight
from kvloom.ops.table import NATIVE_OPS


def _exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The fp32 sums of the bf16 products, rounded once: what every bf16 GEMM aims for."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)


def _assert_rounding_close(actual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None) -> None:
    # Sums in another order may round to the neighbouring bf16 value: one ulp is 2^-7 relative.
    torch.testing.assert_close(actual.float(), _exact(x, weight, bias).float(), rtol=8e-3, atol=1e-3)


@pytest.fixture(scope="module")
def gemm_kernel() -> None:
    if linear_format(torch.bfloat16) not in ("kvloom", "hybrid"):
        pytest.skip("the kvloom GEMM needs AVX512-BF16 or AVX2 and the built CPU kernels")


def test_pack_layout() -> None:
    weight = torch.arange(50 * 5, dtype=torch.float32).view(50, 5).to(torch.bfloat16)
    packed = pack_gemm_weight(weight)
    assert packed.shape == (2, 3, 48, 2)
    assert packed[0, 1, 7].tolist() == weight[7, 2:4].tolist()
    assert packed[1, 2, 1].tolist() == [weight[49, 4].item(), 0.0]  # odd K: the pad half is zero
    assert packed[1, :, 2:].abs().sum().item() == 0  # columns past N are zero


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64, 300])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (95, 50), (1536, 7), (64, 3072)])
def test_gemm_matches_f_linear(gemm_kernel: None, rows: int, k: int, n: int) -> None:
    torch.manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    weight = torch.randn(n, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16)
    # A tail of sentinels after y shows that the masked stores of the last panel stay inside it.
    buffer = torch.full((rows * n + 64,), 7.0, dtype=torch.bfloat16)
    out = buffer[:rows * n].view(rows, n)
    torch.ops.kvloom.gemm_bf16(out, x, pack_gemm_weight(weight, gemm_panel()), bias.float())
    _assert_rounding_close(out, x, weight, bias)
    assert (buffer[rows * n:] == 7.0).all()
    torch.ops.kvloom.gemm_bf16(out, x, pack_gemm_weight(weight, gemm_panel()), None)
    _assert_rounding_close(out, x, weight, None)


@pytest.mark.parametrize(("k", "n"), [(576, 960), (95, 50), (1536, 7), (64, 3072)])
def test_gemm_gives_each_row_what_it_gives_the_row_alone(gemm_kernel: None, k: int, n: int) -> None:
    """One formula per row whatever the batch: on an AMX-BF16 CPU every row count takes the tiles (K a multiple of
    32), which round otherwise than the dot-product kernel, so a weight must never mix the two."""
    torch.manual_seed(k + n)
    x = torch.randn(45, k, dtype=torch.bfloat16)
    packed = pack_gemm_weight(torch.randn(n, k, dtype=torch.bfloat16), gemm_panel())
    bias = torch.randn(n)
    together = torch.empty(45, n, dtype=torch.bfloat16)
    torch.ops.kvloom.gemm_bf16(together, x, packed, bias)
    for rows in (range(i, i + 1) for i in range(45)):
        alone = torch.empty(1, n, dtype=torch.bfloat16)
        torch.ops.kvloom.gemm_bf16(alone, x[rows], packed, bias)
        assert torch.equal(alone, together[rows]), rows


def test_gemm_reads_strided_rows_and_ignores_what_follows_an_odd_k(gemm_kernel: None) -> None:
    torch.manual_seed(1)
    wide = torch.randn(10, 40, dtype=torch.bfloat16)
    wide[:, 33:] = float("inf")  # past K = 33: must not reach the sums (0 * inf would be NaN)
    x = wide[:, :33]
    weight = torch.randn(20, 33, dtype=torch.bfloat16)
    out = torch.empty(10, 20, dtype=torch.bfloat16)
    torch.ops.kvloom.gemm_bf16(out, x, pack_gemm_weight(weight, gemm_panel()), None)
    _assert_rounding_close(out, x, weight, None)


def test_gemm_rejects_a_weight_of_another_shape(gemm_kernel: None) -> None:
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    packed = pack_gemm_weight(torch.randn(96, 32, dtype=torch.bfloat16), gemm_panel())
    with pytest.raises(RuntimeError, match="packed weight does not match"):
        torch.ops.kvloom.gemm_bf16(torch.empty(4, 96, dtype=torch.bfloat16), x, packed, None)


@pytest.mark.parametrize("fmt", ["kvloom", "onednn", "hybrid"])
def test_packed_linear_and_lm_head_match_f_linear(fmt: str) -> None:
    """Each packing (hybrid: kvloom's below AMX_MIN_ROWS rows, oneDNN's from there) against F.linear's sums; made
    where the CPU can run it, AMX or not (hybrid is the default only with AMX)."""
    available = linear_format(torch.bfloat16)
    if available is None or (fmt in ("kvloom", "hybrid") and available not in ("kvloom", "hybrid")):
        pytest.skip(f"the {fmt} GEMM is not available here")
    if fmt in ("onednn", "hybrid") and not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch")  # without a bf16 product (AVX2), oneDNN's runs in fp32
    torch.manual_seed(0)
    layer = Linear(96, [64, 32], bias=True).to(torch.bfloat16)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    weight, bias = layer.weight.data.clone(), layer.bias.data.clone()
    ops = dataclasses.replace(NATIVE_OPS, pack_linear=lambda w, b: PackedWeight(w, b, fmt))
    layer.process_weights_after_loading(ops)
    head = LMHead(200, 96).to(torch.bfloat16)
    head.weight.data.normal_()
    head.process_weights_after_loading(ops)
    for rows in (1, 3, 4, 16, 333):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        _assert_rounding_close(layer(x), x, weight, bias)
        _assert_rounding_close(head(x), x, head.weight.data, None)
    assert layer.weight.numel() == 0  # the plain copy is released once packed
    assert head.weight.numel() == 200 * 96  # the head's may be the embedding's too
    # Leading dimensions pass through.
    x = torch.randn(2, 5, 96, dtype=torch.bfloat16)
    assert layer(x).shape == (2, 5, 96)


@pytest.mark.parametrize("fmt", ["kvloom", "hybrid", "onednn"])
def test_a_tied_bf16_table_is_read_from_the_heads_panels(fmt: str) -> None:
    """share_tied_table: with kvloom's panels (odd K, rows of the last part-filled panel) the embedding looks its
    rows up there, bit for bit, and neither module keeps the plain table; oneDNN's packing is opaque, so a head packed
    only that way leaves the embedding its table."""
    from torch import nn

    from kvloom.layers.embedding import VocabEmbedding, share_tied_table

    available = linear_format(torch.bfloat16)
    if available not in ("kvloom", "hybrid") or (fmt != "kvloom" and not torch.backends.mkldnn.is_available()):
        pytest.skip(f"the {fmt} GEMM is not available here")
    model = nn.Module()
    model.embed_tokens, model.lm_head = VocabEmbedding(201, 95).to(torch.bfloat16), LMHead(201, 95)
    model.lm_head.weight = model.embed_tokens.weight
    model.embed_tokens.dtype = torch.bfloat16
    model.embed_tokens.weight.data.normal_()
    table = model.embed_tokens.weight.data.clone()
    model.lm_head.process_weights_after_loading(
        dataclasses.replace(NATIVE_OPS, pack_linear=lambda w, b: PackedWeight(w, b, fmt)))
    share_tied_table(model)
    ids = torch.tensor([[200, 0], [47, 48]])
    assert torch.equal(model.embed_tokens(ids), table[ids])
    assert (model.embed_tokens.table is None) == (fmt == "onednn")
    assert model.embed_tokens.weight.numel() == (201 * 95 if fmt == "onednn" else 0)
    x = torch.randn(3, 95, dtype=torch.bfloat16)
    _assert_rounding_close(model.lm_head(x), x, table, None)


def test_packed_weight_names_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="unknown packed weight format 'amx'"):
        PackedWeight(torch.zeros(4, 4, dtype=torch.bfloat16), None, "amx", 1)


def test_hybrid_weights_take_onednns_product_from_amx_min_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """An AMX CPU's bf16 weights with batch-dependent products allowed ("hybrid"): kvloom's GEMM below AMX_MIN_ROWS
    rows, oneDNN's from there, each the very product its own format gives; a weight of AMX_ONLY_ELEMENTS values or
    more holds oneDNN's alone."""
    from kvloom.ops import cpu

    if linear_format(torch.bfloat16) not in ("kvloom", "hybrid") or not torch.backends.mkldnn.is_available():
        pytest.skip("needs kvloom's GEMM and oneDNN's linear (bf16, or fp32 where oneDNN has no bf16 product)")
    torch.manual_seed(1)
    weight, bias = torch.randn(80, 96, dtype=torch.bfloat16), torch.randn(80, dtype=torch.bfloat16)
    hybrid = PackedWeight(weight, bias, "hybrid", 8)
    alone = {fmt: PackedWeight(weight, bias, fmt, 8) for fmt in ("kvloom", "onednn")}
    assert hybrid.stack_args()[1][0] is hybrid.data and alone["onednn"].stack_args() is None
    calls = []
    onednn = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[0].shape[0]) or onednn(*a))
    for rows in (1, cpu.AMX_MIN_ROWS - 1, cpu.AMX_MIN_ROWS, 40):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        torch.testing.assert_close(hybrid(x), alone["kvloom"](x), rtol=8e-3, atol=1e-2)
    assert calls == [cpu.AMX_MIN_ROWS, 40]  # the rows of the calls that took oneDNN's product
    assert cpu.weight_format("hybrid", torch.empty(cpu.AMX_ONLY_ELEMENTS // 1024, 1024)) == "onednn"
    assert cpu.weight_format("hybrid", weight) == "hybrid" and cpu.weight_format("kvloom", weight) == "kvloom"

"""int8 experts (quantization="int8" on a mixture of experts): codes and per-row scales in the dense layers'
format, the grouped products against the plain-torch reference, and the reference against the float experts."""

from __future__ import annotations

import pytest
import torch

from kvloom.layers.moe import FusedMoE, route
from kvloom.ops import native
from kvloom.ops.int8 import Int8Rows, dequantize, quantize_per_channel
from kvloom.ops.reference import fused_experts_int8_reference, fused_experts_reference
from kvloom.ops.table import NATIVE_OPS, REFERENCE_OPS, select_ops

from .test_moe import random_moe


def quantized_stacks(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each expert's weights per row: (w13 codes [E, 2I, H], scales [E, 2I], w2 codes [E, H, I], scales [E, H])."""
    q13, s13 = zip(*(quantize_per_channel(w) for w in w13))
    q2, s2 = zip(*(quantize_per_channel(w) for w in w2))
    return torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2)


def test_int8_reference_equals_the_float_experts_on_the_dequantized_weights() -> None:
    hidden, w13, w2, logits = random_moe(17, 6, 2)
    weights, ids = route(logits, 2, renormalize=True)
    q13, s13, q2, s2 = quantized_stacks(w13, w2)
    dequantized = [torch.stack([dequantize(q, s) for q, s in zip(codes, scales)]) for codes, scales in
                   ((q13, s13), (q2, s2))]
    got = fused_experts_int8_reference(hidden, q13, s13, q2, s2, weights, ids)
    torch.testing.assert_close(got, fused_experts_reference(hidden, *dequantized, weights, ids),
                               rtol=1e-5, atol=1e-5)
    # and per-row int8 stays close to the float experts themselves
    exact = fused_experts_reference(hidden, w13, w2, weights, ids)
    assert (got - exact).norm() / exact.norm() < 0.02


@pytest.mark.parametrize(("dtype", "int8_activations"), [(torch.float32, False), (torch.float32, True),
                                                          (torch.bfloat16, True)])
def test_packed_int8_experts_equal_the_reference(dtype: torch.dtype, int8_activations: bool) -> None:
    """The platform's int8 product per expert (the CPU's C++ GEMM, weight-only or W8A8), grouped by expert."""
    ops = select_ops(torch.device("cpu"), dtype, int8_activations=int8_activations)
    hidden, w13, w2, logits = random_moe(33, 8, 2, seed=3)
    hidden = hidden.to(dtype)
    weights, ids = route(logits, 2, renormalize=False)
    stacks = quantized_stacks(w13, w2)
    packed = native.PackedInt8Experts(*stacks, ops.pack_linear_int8)
    expected = fused_experts_int8_reference(hidden.float(), *stacks, weights, ids)
    got = packed(hidden, weights, ids).float()
    # weight-only fp32: the same sums in another order; W8A8 rounds the activations to int8 per token too.
    tolerance = 1e-4 if dtype == torch.float32 and not int8_activations else 3e-2
    assert (got - expected).norm() / expected.norm() < tolerance, ops.name


def test_experts_quantized_as_read_and_after_loading_are_the_same() -> None:
    """Int8 rows loaded expert by expert (Qwen-MoE's names, quantized as read) and float tensors quantized by
    quantize_experts (Mixtral's, or a stacked layout) hold the same codes; packed, both run int8 and the float
    stacks are released."""
    hidden, w13, w2, logits = random_moe(9, 4, 2, seed=1)
    size = w2.shape[2]
    as_read = FusedMoE(4, 2, 32, size, True, REFERENCE_OPS)
    after = FusedMoE(4, 2, 32, size, True, REFERENCE_OPS)
    for e in range(4):
        for part, tensor in (("w1", w13[e, :size]), ("w3", w13[e, size:]), ("w2", w2[e])):
            as_read.load_expert(e, part, Int8Rows.quantize(tensor))
            after.load_expert(e, part, tensor)
    after.quantize_experts()
    assert after.w13.numel() == 0 and after.w2.numel() == 0
    for name in ("w13", "w2"):
        for a, b in zip(as_read.int8[name], after.int8[name]):
            assert torch.equal(a, b)
    expected = as_read(hidden, logits)  # not packed yet: the int8 reference
    weights, ids = route(logits, 2, renormalize=True)
    torch.testing.assert_close(expected, fused_experts_int8_reference(hidden, *after.int8["w13"], *after.int8["w2"],
                                                                      weights, ids))
    for experts in (as_read, after):
        experts.process_weights_after_loading(NATIVE_OPS)
        assert isinstance(experts.packed, native.PackedInt8Experts) and experts.int8 is None
        torch.testing.assert_close(experts(hidden, logits), expected, rtol=1e-5, atol=1e-5)


def test_a_mixture_partly_loaded_in_int8_quantizes_the_rest_when_packed() -> None:
    hidden, w13, w2, logits = random_moe(5, 2, 1, seed=2)
    size = w2.shape[2]
    experts = FusedMoE(2, 1, 32, size, True, REFERENCE_OPS)
    experts.load_expert(0, "gate_proj", Int8Rows.quantize(w13[0, :size]))
    for e, part, tensor in ((0, "up_proj", w13[0, size:]), (0, "down_proj", w2[0]), (1, "gate_proj", w13[1, :size]),
                            (1, "up_proj", w13[1, size:]), (1, "down_proj", w2[1])):
        experts.load_expert(e, part, tensor)
    experts.process_weights_after_loading(REFERENCE_OPS)
    weights, ids = route(logits, 1, renormalize=True)
    expected = fused_experts_int8_reference(hidden, *quantized_stacks(w13, w2), weights, ids)
    torch.testing.assert_close(experts(hidden, logits), expected, rtol=1e-5, atol=1e-5)

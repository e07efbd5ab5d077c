"""The mixture-of-experts computation against a token-by-token oracle, and the experts' two checkpoint
layouts (per expert, as the Hub stores them; stacked, as transformers 5 holds them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvloom.layers.moe import FusedMoE, load_experts_as_read, route
from kvloom.ops.reference import fused_experts_reference
from kvloom.ops.table import NATIVE_OPS


def experts_token_by_token(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                           ids: torch.Tensor) -> torch.Tensor:
    """The oracle: every (token, chosen expert) pair on its own, in fp64."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    size = w2.shape[2]
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e].double() @ hidden[t].double()
            out[t] += weights[t, j].double() * (w2[e].double() @ (F.silu(gate_up[:size]) * gate_up[size:]))
    return out


def random_moe(tokens: int, experts: int, top_k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 32, generator=generator)
    w13 = torch.randn(experts, 2 * 24, 32, generator=generator) * 0.2
    w2 = torch.randn(experts, 32, 24, generator=generator) * 0.2
    logits = torch.randn(tokens, experts, generator=generator)
    return hidden, w13, w2, logits


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 4, 2), (7, 8, 2), (33, 6, 3), (5, 16, 1)])
def test_fused_experts_equal_the_token_by_token_oracle(tokens: int, experts: int, top_k: int) -> None:
    """Any batch: one token (a decode), experts left without tokens (16 experts, 5 tokens), top-3."""
    hidden, w13, w2, logits = random_moe(tokens, experts, top_k)
    weights, ids = route(logits, top_k, renormalize=True)
    got = fused_experts_reference(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(got.double(), experts_token_by_token(hidden, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_route_is_softmax_then_top_k_with_or_without_renormalizing() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    probs = torch.softmax(logits, dim=-1)[0]
    weights, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights[0], probs[[1, 2]])
    weights, _ = route(logits, 2, renormalize=True)  # Mixtral: a softmax over the chosen
    torch.testing.assert_close(weights[0], torch.softmax(logits[0, [1, 2]], dim=-1))


def test_experts_load_alike_from_per_expert_and_stacked_tensors() -> None:
    hidden, w13, w2, logits = random_moe(9, 4, 2)
    size = w2.shape[2]
    per_expert = FusedMoE(4, 2, 32, size, True, NATIVE_OPS)
    root = torch.nn.Module()
    root.add_module("mlp", torch.nn.Module())
    root.mlp.add_module("experts", per_expert)
    hub = []
    for e in range(4):
        hub += [(f"model.mlp.experts.{e}.w1.weight", w13[e, :size]),
                (f"model.mlp.experts.{e}.w3.weight", w13[e, size:]), (f"model.mlp.experts.{e}.w2.weight", w2[e])]
    others = list(load_experts_as_read(root, hub + [("model.mlp.gate.weight", torch.zeros(4, 32))]))
    assert [name for name, _ in others] == ["model.mlp.gate.weight"] and per_expert.missing() == []
    root.mlp.experts = stacked = FusedMoE(4, 2, 32, size, True, NATIVE_OPS)
    assert list(load_experts_as_read(root, [("model.mlp.experts.gate_up_proj", w13)])) == []
    assert stacked.missing() == [f"w2[{e}][0]" for e in range(4)]
    list(load_experts_as_read(root, [("model.mlp.experts.down_proj", w2)]))
    torch.testing.assert_close(stacked(hidden, logits), per_expert(hidden, logits))


def test_cpu_bf16_experts_run_packed_and_equal_the_reference() -> None:
    """On the CPU in bf16 the op table packs each expert for the linears' GEMM (native.PackedExperts); fp32 and
    the reference backend keep the stacks (ReferenceExperts)."""
    from kvloom.ops import native, reference
    from kvloom.ops.table import select_ops

    cpu_bf16 = select_ops(torch.device("cpu"), torch.bfloat16)
    if cpu_bf16.pack_linear is None:
        pytest.skip("no packed bf16 GEMM on this CPU")
    assert select_ops(torch.device("cpu"), torch.float32).pack_experts is reference.ReferenceExperts
    hidden, w13, w2, logits = random_moe(21, 8, 2)
    hidden, w13, w2 = hidden.bfloat16(), w13.bfloat16(), w2.bfloat16()
    experts = FusedMoE(8, 2, 32, 24, True, cpu_bf16)
    experts.w13.data, experts.w2.data = w13.clone(), w2.clone()
    expected = experts(hidden, logits)  # not prepared yet: the reference on the stacks
    experts.process_weights_after_loading(cpu_bf16)
    assert isinstance(experts.packed, native.PackedExperts)
    assert experts.w13.numel() == 0  # the stacks are released once packed
    torch.testing.assert_close(experts(hidden, logits).float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("int8", [False, True])
def test_tensor_parallel_experts_sum_to_the_whole_mixture(int8: bool) -> None:
    """Each of two ranks keeps half of every expert's intermediate dimension (float, or int8 codes with their
    scales); the ranks' outputs (all-reduced over a one-process group here, so summed by hand) equal the whole."""
    import copy

    import torch.distributed as dist

    from kvloom.layers.tensor_parallel import _shard_experts
    from kvloom.ops.int8 import Int8Rows

    hidden, w13, w2, logits = random_moe(11, 4, 2, seed=5)
    size = w2.shape[2]
    whole = FusedMoE(4, 2, 32, size, True, NATIVE_OPS)
    for e in range(4):
        for part, tensor in (("w1", w13[e, :size]), ("w3", w13[e, size:]), ("w2", w2[e])):
            whole.load_expert(e, part, Int8Rows.quantize(tensor) if int8 else tensor)
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    ranks = []
    for rank in range(2):
        shard = copy.deepcopy(whole)
        _shard_experts(shard, rank, 2, group)
        assert shard.intermediate_size == size // 2
        shard.process_weights_after_loading(NATIVE_OPS)
        ranks.append(shard(hidden, logits))
    whole.process_weights_after_loading(NATIVE_OPS)
    torch.testing.assert_close(ranks[0] + ranks[1], whole(hidden, logits), rtol=1e-5, atol=1e-5)


def test_4bit_experts_run_their_blocks_and_float_where_a_projection_is_not_all_4bit() -> None:
    """A GGUF's 4-bit experts (quantization="gguf"): an expert whose gate and up are both 4-bit runs the 4-bit
    product on [gate | up]; one with a float part runs float on its dequantized values; the mixture equals the
    float experts on the blocks' exact values, up to the product's per-block activation rounding."""
    from kvloom.ops import native
    from kvloom.ops.q4 import NativeQ4Linear, Q4Blocks
    from kvloom.ops.table import REFERENCE_OPS

    generator = torch.Generator().manual_seed(7)
    size = 32  # blocks of 32 along every input: H and I
    hidden, logits = torch.randn(13, 32, generator=generator), torch.randn(13, 3, generator=generator)
    w13 = torch.randn(3, 2 * size, 32, generator=generator) * 0.2
    w2 = torch.randn(3, 32, size, generator=generator) * 0.2
    experts = FusedMoE(3, 2, 32, size, True, REFERENCE_OPS)
    exact13, exact2 = w13.clone(), w2.clone()
    for e in range(3):
        for part, stack, rows in (("gate_proj", exact13, slice(0, size)), ("up_proj", exact13, slice(size, None)),
                                  ("down_proj", exact2, slice(None))):
            tensor = stack[e, rows]
            if (e, part) == (1, "up_proj"):  # expert 1's up stays float: its gate/up runs float
                experts.load_expert(e, part, tensor)
                continue
            blocks = Q4Blocks.quantize(tensor)
            stack[e, rows] = blocks.dequantize()
            experts.load_expert(e, part, blocks)
    experts.process_weights_after_loading(REFERENCE_OPS)
    assert isinstance(experts.packed, native.ExpertProducts) and experts.q4 == {} and experts.w13.numel() == 0
    assert [type(p) is NativeQ4Linear for p in experts.packed.gate_up] == [True, False, True]
    assert all(type(p) is NativeQ4Linear for p in experts.packed.down)
    # The oracle: the 4-bit weights' exact values, the activations rounded per block of 32 where 4-bit runs.
    weights, ids = route(logits, 2, renormalize=True)
    got = experts(hidden, logits)
    expected = fused_experts_reference(hidden, exact13, exact2, weights, ids)
    assert (got - expected).norm() / expected.norm() < 0.02

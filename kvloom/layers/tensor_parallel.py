"""Tensor parallelism applied to a built, loaded model (gpt-fast's way: the model file knows nothing).

Megatron's split, per decoder layer, with one all-reduce after attention and one after the MLP:

    qkv_proj   column-parallel: rank r keeps its q heads, k heads and v heads (rows of each block)
    o_proj     row-parallel:    rank r keeps the input columns of its q heads; output all-reduced
    gate_up    column-parallel: rank r keeps its rows of gate and its rows of up
    down_proj  row-parallel:    rank r keeps the matching input columns; output all-reduced

A GQA group stays whole on one rank: q head h reads kv head h // (heads / kv_heads), and rank r
holds q heads [r * heads/N, (r+1) * heads/N) and kv heads [r * kv/N, (r+1) * kv/N), which is the
same group range. The embedding, the final norm and the LM head stay replicated (every rank holds
the whole vocabulary: fine for small models; a vocab-parallel embedding is the next step for big
ones), so every rank ends a step with the same hidden states and only rank 0 samples.

int8 weights (quantized before sharding) are cut the same way: a column-parallel layer keeps its rows'
scales, a row-parallel one keeps every scale, since each is per output row and applies to every
rank's partial sum. Block scales (GGUF Q8_0, one per row and block of 32 inputs) follow their rows in a
column-parallel layer and their blocks in a row-parallel one, whose input share must then be whole blocks.

A mixture of experts (layers/moe.py FusedMoE) is cut the same way inside every expert: rank r keeps rows
[r I/N, (r+1) I/N) of each expert's gate and of its up (w13 [E, 2I/N, H]) and the matching input columns of its
down (w2 [E, H, I/N]); each rank runs every expert on its share and the experts' summed output is all-reduced
once. The router stays replicated, so every rank routes every token alike; Qwen2-MoE's shared expert is a dense
MLP and is cut as one, its one-row gate replicated.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kvloom.layers.linear import Linear
from kvloom.layers.moe import FusedMoE
from kvloom.loader.model_config import ModelConfig
from kvloom.ops.int8 import BLOCK
from kvloom.ops.q4 import Q4Blocks
from kvloom.ops.q4k import SUPER

# A torch.distributed process group, or a c10d backend object such as dist.ProcessGroupGloo(...)
# (anything dist.all_reduce accepts as its group).
ProcessGroupLike = Any


def validate_tensor_parallel(model_config: ModelConfig, world_size: int, device: torch.device,
                             int8_blocks: bool = False) -> None:
    """ValueError, before any process starts, when the model or the machine cannot be split N ways.
    ``int8_blocks``: the projections hold Q8_0 blocks of 32 inputs, which a row-parallel split must keep whole."""
    if device.type == "cuda":
        first = device.index or 0
        available = torch.cuda.device_count() - first
        if world_size > available:
            raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} GPUs from "
                             f"cuda:{first} on, but torch sees {available} there")
    else:
        cores = os.cpu_count() or 1
        if world_size > cores:
            raise ValueError(f"tensor_parallel_size={world_size} is larger than this machine's "
                             f"{cores} CPU cores; one rank per core at most")

    counts = {"attention heads": model_config.num_attention_heads,
              "key-value heads": model_config.num_key_value_heads,
              "MLP intermediate size": model_config.intermediate_size}
    if model_config.num_experts:
        counts["experts' intermediate size"] = model_config.moe_intermediate_size
        if model_config.shared_expert_intermediate_size:
            counts["shared expert's intermediate size"] = model_config.shared_expert_intermediate_size
    for name, count in counts.items():
        if count % world_size:
            valid = [n for n in range(1, model_config.num_key_value_heads + 1)
                     if all(c % n == 0 for c in counts.values())]
            raise ValueError(f"the model's {name} ({count}) must be divisible by tensor_parallel_size "
                             f"({world_size}): each rank takes a whole share; tensor_parallel_size "
                             f"can be one of {valid} for this model")
    if int8_blocks:
        row_parallel_inputs = {
            "attention output (o_proj) inputs": model_config.num_attention_heads * model_config.head_dim,
            "MLP intermediate size (down_proj inputs)": model_config.intermediate_size}
        for name, count in row_parallel_inputs.items():
            if (count // world_size) % BLOCK:
                raise ValueError(_cuts_blocks(name, count, world_size))


def sharded_model_config(model_config: ModelConfig, world_size: int) -> ModelConfig:
    """One rank's view: its share of the heads (what its KV cache holds) and of the MLP."""
    return dataclasses.replace(
        model_config,
        num_attention_heads=model_config.num_attention_heads // world_size,
        num_key_value_heads=model_config.num_key_value_heads // world_size,
        intermediate_size=model_config.intermediate_size // world_size,
        moe_intermediate_size=model_config.moe_intermediate_size // world_size,
        shared_expert_intermediate_size=model_config.shared_expert_intermediate_size // world_size)


def shard_model_for_tensor_parallel(model: nn.Module, rank: int, world_size: int,
                                    group: ProcessGroupLike | None = None) -> nn.Module:
    """Keep rank's share of every decoder layer's projections; all-reduce the row-parallel outputs.

    ``model`` is a loaded LlamaForCausalLM-like model (layers[i].self_attn / .mlp); ``group`` is the
    tensor-parallel process group (None: the default group). Returns the model, changed in place.
    """
    if world_size == 1:
        return model
    for layer in model.layers:
        attention = layer.self_attn
        experts = getattr(layer.mlp, "experts", None)
        mlp = getattr(layer.mlp, "shared_expert", None) if isinstance(experts, FusedMoE) else layer.mlp
        if mlp is not None and not hasattr(mlp, "gate_up_proj"):
            raise ValueError(f"tensor parallelism does not shard {type(mlp).__name__} of {type(model).__name__}; "
                             f"use tensor_parallel_size=1")
        mlp_linears = () if mlp is None else (mlp.gate_up_proj, mlp.down_proj)
        for linear in (attention.qkv_proj, attention.o_proj, *mlp_linears):
            if type(linear) is not Linear:
                raise ValueError(f"tensor parallelism supports kvloom's Linear layers, not "
                                 f"{type(linear).__name__}; use tensor_parallel_size=1")
        heads, kv_heads = attention.num_heads // world_size, attention.num_kv_heads // world_size
        head_dim = attention.head_dim
        # [q | k | v] rows, each block cut into world_size equal slices of whole heads.
        _shard_columns_out(attention.qkv_proj, rank, world_size)
        attention.num_heads, attention.num_kv_heads = heads, kv_heads
        attention.q_size, attention.kv_size = heads * head_dim, kv_heads * head_dim
        _shard_rows_in(attention.o_proj, rank, world_size, group)
        if isinstance(experts, FusedMoE):
            _shard_experts(experts, rank, world_size, group)
        if mlp is not None:
            # [gate | up] rows: silu_and_mul pairs gate column j with up column j, so both keep the same j's.
            _shard_columns_out(mlp.gate_up_proj, rank, world_size)
            _shard_rows_in(mlp.down_proj, rank, world_size, group)
    return model


def _shard_experts(experts: FusedMoE, rank: int, world_size: int, group: ProcessGroupLike | None) -> None:
    """Every expert's intermediate dimension cut N ways, before packing: w13 [E, 2I, H] keeps rows [rI/N, (r+1)I/N)
    of gate and of up, w2 [E, H, I] the matching columns; int8 codes alike, w13's per-row scales with their
    rows and all of w2's (per output row, they scale every rank's partial sum). The output is all-reduced."""
    if experts.packed is not None:
        raise ValueError("the experts were packed before tensor parallelism could cut them")
    if experts.q4:
        raise ValueError("tensor parallelism does not cut a GGUF's 4-bit experts; load the file with "
                         "quantization='none' (dequantized) or 'int8', or use tensor_parallel_size=1")
    size = experts.intermediate_size // world_size
    gate = slice(rank * size, (rank + 1) * size)
    up = slice(experts.intermediate_size + rank * size, experts.intermediate_size + (rank + 1) * size)

    def cut_w13(t: torch.Tensor) -> torch.Tensor:  # [E, 2I, ...] -> [E, 2I/N, ...]
        return torch.cat((t[:, gate], t[:, up]), dim=1).contiguous()

    if experts.int8 is not None:
        (w13, w13_scale), (w2, w2_scale) = experts.int8["w13"], experts.int8["w2"]
        experts.int8 = {"w13": (cut_w13(w13), cut_w13(w13_scale)), "w2": (w2[:, :, gate].contiguous(), w2_scale)}
    if experts.w13.numel():
        experts.w13 = nn.Parameter(cut_w13(experts.w13.data), requires_grad=False)
        experts.w2 = nn.Parameter(experts.w2.data[:, :, gate].contiguous(), requires_grad=False)
    else:  # released after int8 quantization: keep the empty stacks' shapes consistent
        experts.w13.data = experts.w13.data.new_empty(0, 2 * size, experts.w13.shape[2])
        experts.w2.data = experts.w2.data.new_empty(0, experts.w2.shape[1], size)
    experts.intermediate_size = size
    _sum_outputs_over_ranks(experts, group)


def _shard_columns_out(linear: Linear, rank: int, world_size: int) -> None:
    """Column-parallel: keep slice ``rank`` of each row block (output_sizes); biases sliced alike."""
    sizes = [size // world_size for size in linear.output_sizes]
    starts = [sum(linear.output_sizes[:i]) + rank * size for i, size in enumerate(sizes)]
    linear.q8_0_to_int8()  # the file's Q8_0 bytes cut as int8 blocks

    def keep(tensor: torch.Tensor) -> nn.Parameter:
        parts = [tensor[start:start + size] for start, size in zip(starts, sizes)]
        return nn.Parameter(torch.cat(parts).contiguous(), requires_grad=False)

    if linear.quantized:  # int8 rows and their scales are cut like float rows
        linear.qweight, linear.weight_scale = keep(linear.qweight).data, keep(linear.weight_scale).data
    elif linear.weight.numel():
        linear.weight = keep(linear.weight.data)
    if linear.q4 is not None:  # 4-bit rows too, with their scales and offsets
        linear.q4 = Q4Blocks(*(keep(t).data for t in linear.q4))
    for shard, tensor in linear.super_blocks.items():  # a shard's super-block rows: its own slice
        linear.super_blocks[shard] = tensor.take(torch.arange(rank * sizes[shard], (rank + 1) * sizes[shard]))
    if linear.bias is not None:
        linear.bias = keep(linear.bias.data)
    linear.output_sizes = sizes


def _shard_rows_in(linear: Linear, rank: int, world_size: int, group: ProcessGroupLike | None) -> None:
    """Row-parallel: keep input columns ``rank``; the partial outputs are summed over the ranks.

    The bias is added once: rank 0 keeps it, the others drop it.
    """
    size = linear.in_features // world_size
    linear.q8_0_to_int8()  # the file's Q8_0 bytes cut as int8 blocks
    if linear.super_blocks:  # whole super-blocks a rank, else the code blocks below
        if size % SUPER:
            linear.super_blocks_to_q4()
        else:
            linear.super_blocks = {shard: t.columns(rank * size, size) for shard, t in linear.super_blocks.items()}
    if linear.quantized and linear.blocks:  # a rank keeps the scales of its own blocks
        if size % BLOCK:
            raise ValueError(_cuts_blocks("layer's inputs", linear.in_features, world_size))
        blocks = size // BLOCK
        linear.weight_scale = linear.weight_scale[:, rank * blocks:(rank + 1) * blocks].contiguous()
    if linear.q4 is not None:  # a rank keeps its inputs' codes and their blocks' scales and offsets
        if size % BLOCK:
            raise ValueError(_cuts_blocks("layer's inputs", linear.in_features, world_size))
        groups = size // linear.q4.group  # blocks of 32, or Q6_K's groups of 16
        codes, d, m = linear.q4
        linear.q4 = Q4Blocks(codes[:, rank * size:(rank + 1) * size].contiguous(),
                             d[:, rank * groups:(rank + 1) * groups].contiguous(),
                             m[:, rank * groups:(rank + 1) * groups].contiguous())
    if linear.quantized:  # per-row scales apply to every rank's partial sum: every rank keeps all of them
        linear.qweight = linear.qweight[:, rank * size:(rank + 1) * size].contiguous()
        linear.weight.data = linear.weight.data.new_empty(0, size)
    else:
        linear.weight = nn.Parameter(linear.weight.data[:, rank * size:(rank + 1) * size].contiguous(),
                                     requires_grad=False)
    linear.in_features = size
    if linear.bias is not None and rank != 0:
        linear.bias = None
    _sum_outputs_over_ranks(linear, group)


def _sum_outputs_over_ranks(module: nn.Module, group: ProcessGroupLike | None) -> None:
    """Each rank's output of ``module`` is a partial sum: an all-reduce after its forward makes it whole."""

    def all_reduce(_module: nn.Module, _inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, op=dist.ReduceOp.SUM, group=group)
        return output

    module.register_forward_hook(all_reduce)


def _cuts_blocks(name: str, count: int, world_size: int) -> str:
    return (f"tensor_parallel_size={world_size} gives each rank {count // world_size} of the {name} ({count}), "
            f"which cuts the GGUF's blocks of {BLOCK} kept as stored (4-bit, or Q8_0 as int8): use a "
            f"tensor_parallel_size that leaves each rank a multiple of {BLOCK}, quantization='none' (dequantized), "
            f"or for Q8_0 override_backend_config {{\"int8_gguf_blocks\": false}} (per-row int8)")

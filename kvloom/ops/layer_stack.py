"""What a layer stack (the whole decoder run by one op: ``Ops.llama_layer_stack``) takes: each layer's
weights and the layers' shape. The model builds them and the platform's op reads them, so they live below
both (ops/table.py names the op; ops/cpu.py implements it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class LayerWeights:
    """One Llama decoder layer's weights as a layer stack takes them: the norms' weights and the projections'
    prepared products (what ``pack_linear`` returned for each Linear)."""

    input_norm: torch.Tensor  # empty: none, the layer reads its input as is (only the first; EAGLE-1's)
    qkv: object
    o: object
    post_norm: torch.Tensor
    gate_up: object
    down: object


@dataclass(frozen=True)
class LayerShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float
    scale: float


class StackArgs(NamedTuple):
    """How a layer stack calls one prepared product (its ``stack_args()``): the kind (csrc/decoder.cpp's
    Projection::Kind), its tensors in the plan's slot order, from how many rows an int8-rows weight takes W8A8, and
    whether bf16 activations may take the dequantizing AMX-BF16 tiles (the weight's own ``bf16_tiles``: the stack
    then multiplies exactly as the module would)."""

    kind: int
    tensors: list[torch.Tensor | None]
    w8a8_min_rows: int = 0
    bf16_tiles: bool = False

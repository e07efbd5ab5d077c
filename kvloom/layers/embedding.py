"""Token embedding and the LM head (which may share the embedding's weight).

With int8 weights and ``quantize_lm_head``, the embedding table is stored as int8 rows with one scale
per token (a lookup dequantizes the rows it reads) and the LM head multiplies by the same int8 table,
so a tied model keeps one int8 copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.ops import int8
from kvloom.ops.table import Ops


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.qweight: torch.Tensor | None = None  # int8 [vocab, hidden] after quantize
        self.weight_scale: torch.Tensor | None = None  # fp32 [vocab]
        self.dtype = self.weight.dtype

    def quantize(self) -> None:
        qweight, scale = int8.quantize_per_channel(self.weight.data)
        self.set_int8(qweight, scale)

    def set_int8(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        expected = tuple(self.weight.shape)
        if qweight.dtype != torch.int8 or tuple(qweight.shape) != expected or tuple(scale.shape) != expected[:1]:
            raise ValueError(f"int8 embedding must be int8 {expected} with scales {expected[:1]}, got "
                             f"{qweight.dtype} {tuple(qweight.shape)} and {tuple(scale.shape)}")
        self.dtype = self.weight.dtype
        self.qweight, self.weight_scale = qweight, scale.float()
        self.weight.data = self.weight.data.new_empty(0, expected[1])

    def load_shard(self, name: str, shard: int, tensor: int8.Int8Rows) -> None:
        """int8 rows read from a checkpoint (the only thing the loader hands this way)."""
        self.set_int8(tensor.qweight, tensor.scale)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            rows = F.embedding(input_ids, self.qweight).to(self.dtype)
            return rows * self.weight_scale[input_ids].to(self.dtype)[:, None]
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.qweight: torch.Tensor | None = None
        self.weight_scale: torch.Tensor | None = None
        self.packed: Callable[[torch.Tensor], torch.Tensor] | None = None

    def quantize(self, tied_to: VocabEmbedding | None = None) -> None:
        """int8 weights; a head tied to the embedding uses the embedding's int8 table (quantized first)."""
        if tied_to is not None:
            if tied_to.qweight is None:
                tied_to.quantize()
            self.qweight, self.weight_scale = tied_to.qweight, tied_to.weight_scale
        else:
            self.qweight, self.weight_scale = int8.quantize_per_channel(self.weight.data)
            self.weight.data = self.weight.data.new_empty(0, self.weight.shape[1])

    def load_shard(self, name: str, shard: int, tensor: int8.Int8Rows) -> None:
        """int8 rows of an untied head read from a checkpoint."""
        expected = tuple(self.weight.shape)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"lm_head int8 weight has shape {tuple(tensor.shape)}, expected {expected}")
        self.qweight, self.weight_scale = tensor.qweight, tensor.scale.float()
        self.weight.data = self.weight.data.new_empty(0, expected[1])

    def process_weights_after_loading(self, ops: Ops) -> None:
        """As Linear's, but the plain (or int8) weight stays: it may be the embedding's too."""
        if self.packed is not None:
            return
        if self.qweight is not None:
            self.packed = ops.pack_linear_int8(self.qweight, self.weight_scale, None)
        elif ops.pack_linear is not None:
            self.packed = ops.pack_linear(self.weight.data, None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, V] in the model's dtype (the sampler upcasts what needs it)."""
        if self.packed is not None:
            return self.packed(hidden)
        if self.qweight is not None:
            return int8.int8_linear_reference(hidden, self.qweight, self.weight_scale)
        return F.linear(hidden, self.weight)

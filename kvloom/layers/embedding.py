"""Token embedding and the LM head (which may share the embedding's weight).

With int8 weights and ``quantize_lm_head``, the embedding table is stored as int8 rows with one scale
per token (a lookup dequantizes the rows it reads) and the LM head multiplies by the same int8 table,
so a tied model keeps one int8 copy. A GGUF's Q8_0 table kept as stored (``quantization="gguf"``) holds a scale
per token and block of 32 instead (``weight_scale`` [vocab, hidden / 32]); the head then multiplies by the blocks
with activations quantized per block, as llama.cpp does.
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
        self.weight_scale: torch.Tensor | None = None  # fp32 [vocab], or [vocab, hidden / 32] for Q8_0 blocks
        self.dtype = self.weight.dtype

    def quantize(self) -> None:
        qweight, scale = int8.quantize_per_channel(self.weight.data)
        self.set_int8(qweight, scale)

    def set_int8(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        expected = tuple(self.weight.shape)
        scales = (expected[:1], (expected[0], expected[1] // int8.BLOCK))
        if qweight.dtype != torch.int8 or tuple(qweight.shape) != expected or tuple(scale.shape) not in scales:
            raise ValueError(f"int8 embedding must be int8 {expected} with scales {scales[0]} (per token) or "
                             f"{scales[1]} (per block), got {qweight.dtype} {tuple(qweight.shape)} and "
                             f"{tuple(scale.shape)}")
        self.dtype = self.weight.dtype
        device = self.weight.device  # a checkpoint's blocks are read on the CPU; the model may sit on a GPU
        self.qweight, self.weight_scale = qweight.to(device), scale.float().to(device)
        self.weight.data = self.weight.data.new_empty(0, expected[1])

    def load_shard(self, name: str, shard: int, tensor: int8.Int8Rows | int8.Int8Blocks) -> None:
        """int8 rows or Q8_0 blocks read from a checkpoint (the only things the loader hands this way)."""
        self.set_int8(tensor.qweight, tensor.scale)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            rows = F.embedding(input_ids, self.qweight).to(self.dtype)
            scale = self.weight_scale[input_ids].to(self.dtype)
            if scale.dim() == 1:
                return rows * scale[:, None]
            return (rows.view(*scale.shape, int8.BLOCK) * scale[..., None]).view(rows.shape)
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

    def load_shard(self, name: str, shard: int, tensor: int8.Int8Rows | int8.Int8Blocks) -> None:
        """int8 rows (or Q8_0 blocks) of an untied head read from a checkpoint."""
        expected = tuple(self.weight.shape)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"lm_head int8 weight has shape {tuple(tensor.shape)}, expected {expected}")
        device = self.weight.device
        self.qweight, self.weight_scale = tensor.qweight.to(device), tensor.scale.float().to(device)
        self.weight.data = self.weight.data.new_empty(0, expected[1])

    def process_weights_after_loading(self, ops: Ops) -> None:
        """As Linear's, but the plain (or int8) weight stays: it may be the embedding's too."""
        if self.packed is not None:
            return
        if self.qweight is not None:
            pack = ops.pack_linear_int8_blocks if self.weight_scale.dim() == 2 else ops.pack_linear_int8
            self.packed = pack(self.qweight, self.weight_scale, None)
        elif ops.pack_linear is not None:
            self.packed = ops.pack_linear(self.weight.data, None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, V] in the model's dtype (the sampler upcasts what needs it)."""
        if self.packed is not None:
            return self.packed(hidden)
        if self.qweight is not None:
            if self.weight_scale.dim() == 2:
                return int8.w8a8_blocks_linear_reference(hidden, self.qweight, self.weight_scale, None)
            return int8.int8_linear_reference(hidden, self.qweight, self.weight_scale)
        return F.linear(hidden, self.weight)

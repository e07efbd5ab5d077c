"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.ops.table import Ops


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.packed: Callable[[torch.Tensor], torch.Tensor] | None = None

    def process_weights_after_loading(self, ops: Ops) -> None:
        """As Linear's, but the plain weight stays (it may be the embedding's too)."""
        if ops.pack_linear is not None and self.packed is None:
            self.packed = ops.pack_linear(self.weight.data, None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, V] in the model's dtype (the sampler upcasts what needs it)."""
        if self.packed is not None:
            return self.packed(hidden)
        return F.linear(hidden, self.weight)

"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.layers.linear import pack_weight, packed_linear


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
        # As in Linear; the plain weight stays (it may be the embedding's too).
        self.pack_batch_hint: int | None = None
        self.packed_weight: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, V] in the model's dtype (the sampler upcasts what needs it)."""
        if self.pack_batch_hint is not None:
            if self.packed_weight is None:
                self.packed_weight = pack_weight(self.weight.data, self.pack_batch_hint)
            return packed_linear(hidden, self.packed_weight, None)
        return F.linear(hidden, self.weight)

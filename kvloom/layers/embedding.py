"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.layers.linear import PackedWeight


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
        self.fast_format: str | None = None
        self.batch_hint = 64
        self.packed: PackedWeight | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, V] in the model's dtype (the sampler upcasts what needs it)."""
        if self.fast_format is not None:
            if self.packed is None:
                self.packed = PackedWeight(self.weight.data, None, self.fast_format, self.batch_hint)
            return self.packed(hidden)
        return F.linear(hidden, self.weight)

"""Pooling a prompt's final hidden states into one embedding (or, through a sequence classifier's ``score``
head, label scores), as the model runner does it chunk by chunk (``PoolingState``), and its plain-torch
reference (``pool_reference``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvloom.pooling_params import PoolingParams
from kvloom.sampling_params import RequestOutputKind, SamplingParams


def embedding_sampling_params(pooling: PoolingParams) -> SamplingParams:
    """An embedding request as the engine runs it: its prompt's prefill, then one greedy token (dropped) that
    ends it; the runner pools the prompt's hidden states as its chunks run (``SamplingParams.pooling``)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    params.pooling = pooling
    return params


class PoolingState:
    """One pooling request's running pool across its prefill chunks (a long prompt's hidden states come in
    several steps). Rows are accumulated in fp32; a chunk that starts at position 0 (the first, or a
    recomputation after preemption) starts afresh."""

    def __init__(self, params: PoolingParams) -> None:
        self.params = params
        self.pooled: torch.Tensor | None = None  # [H] fp32: the sum (MEAN), the first row (CLS), the last (LAST)
        self.count = 0

    def add(self, hidden: torch.Tensor, start: int) -> None:
        """hidden: [n, H], the rows of prompt positions start .. start + n - 1."""
        if start == 0:
            self.pooled, self.count = None, 0
        kind = self.params.pooling_type
        if kind == "MEAN":
            rows = hidden.float().sum(dim=0)
            self.pooled = rows if self.pooled is None else self.pooled + rows
        elif kind == "CLS":
            if start == 0:
                self.pooled = hidden[0].float()
        else:
            self.pooled = hidden[-1].float()
        self.count = start + hidden.shape[0]

    def result(self, classify: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """The embedding [D]: pooled, truncated to ``dimensions``, normalized where asked; for a classification
        request the label scores [num_labels] of ``classify`` (the model's head: [N, H] -> [N, num_labels])."""
        vector = self.pooled / self.count if self.params.pooling_type == "MEAN" else self.pooled
        if self.params.task == "classify":
            if classify is None:
                raise ValueError("a classification request reached a model without a classifier head")
            return finish_classification(classify(vector[None])[0], self.params)
        return finish_embedding(vector, self.params)


def finish_embedding(vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Matryoshka truncation, then L2 normalization. vector: [H] -> [D]."""
    if params.dimensions is not None:
        vector = vector[:params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector


def finish_classification(logits: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Label logits [L] -> scores: with the activation on (``normalize`` / ``use_activation``), a sigmoid for one
    label (a reranker's relevance), a softmax over several (vLLM's classify and score activations)."""
    logits = logits.float()
    if not params.normalize:
        return logits
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)


def pool_reference(hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """The whole prompt's hidden states [T, H] pooled at once: what PoolingState must equal."""
    hidden = hidden.float()
    kind = params.pooling_type
    vector = hidden.mean(dim=0) if kind == "MEAN" else hidden[0] if kind == "CLS" else hidden[-1]
    return finish_embedding(vector, params)

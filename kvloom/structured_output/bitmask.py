"""Applying a packed token bitmask to the logits, in place, as one batched op.

The bitmask is int32 [R, ceil(V / 32)]: bit ``j % 32`` of word ``j // 32`` of row ``r`` is set when
token ``j`` may be sampled by the request in logits row ``rows[r]``; every other token's logit becomes
-inf. On CUDA a Triton kernel unpacks the bits on the fly; elsewhere torch unpacks them for the rows
that are constrained only (unconstrained rows are not touched).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenBitmask:
    """What the sampler masks: ``bitmask`` int32 [R, W] and the logits rows it belongs to, ``rows`` [R]
    int64, both on the logits' device."""

    bitmask: torch.Tensor
    rows: torch.Tensor


def apply_token_bitmask_(logits: torch.Tensor, mask: TokenBitmask) -> None:
    """Set logits[rows[r], j] = -inf wherever bit j of bitmask[r] is 0. logits: [B, V], any float dtype."""
    if logits.is_cuda:
        from kvloom.structured_output.triton_bitmask import apply_token_bitmask_triton

        apply_token_bitmask_triton(logits, mask.bitmask, mask.rows)
        return
    apply_token_bitmask_torch(logits, mask.bitmask, mask.rows)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, W] -> bool [R, vocab_size]: True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # arithmetic shift: bit 31 of a negative word still reads 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """The plain-torch op (the reference, and the CPU path)."""
    vocab = logits.shape[-1]
    allowed = unpack_bitmask(bitmask, vocab)
    if allowed.shape[1] < vocab:  # a bitmask narrower than the logits allows nothing past its end
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    selected = logits.index_select(0, rows)
    selected.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, selected)

"""Applying a packed token bitmask to the logits, in place, as one batched op.

The bitmask is int32 [R, ceil(V / 32)]: bit ``j % 32`` of word ``j // 32`` of row ``r`` is set when
token ``j`` may be sampled by the request in logits row ``rows[r]``; every other token's logit becomes
-inf. On CUDA a Triton kernel unpacks the bits on the fly; on the CPU kvloom's C++ kernel (csrc/fused_ops.cpp
``apply_token_bitmask``: a word at a time, a word of zeros one run of -inf stores), else xgrammar's (fp32 / bf16),
and plain torch is the reference and the last fallback. Unconstrained rows are not touched.
"""

from __future__ import annotations

import sys
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
    if logits.is_contiguous() and logits.dtype in (torch.float32, torch.bfloat16, torch.float16):
        from kvloom.ops import cpu

        if cpu.cpu_kernel_available():
            cpu.apply_token_bitmask(logits, mask.bitmask, mask.rows)
            return
        if logits.dtype != torch.float16:
            apply_token_bitmask_cpu(logits, mask.bitmask, mask.rows)
            return
    apply_token_bitmask_torch(logits, mask.bitmask, mask.rows)


def apply_token_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """xgrammar's C++ CPU kernel (fp32 / bf16 logits), which reads the bits in place: ~7x faster than the
    torch op at 32 rows x 49152 tokens (tests/unit/test_structured_output.py checks they agree). It takes
    one bitmask row per logits row it masks, so constrained rows are scattered into a full-width mask."""
    from xgrammar.kernels.apply_token_bitmask_inplace_cpu import apply_token_bitmask_inplace_cpu

    batch, vocab = logits.shape
    if rows.shape[0] != batch or not bool((rows == torch.arange(batch)).all()):
        full = torch.full((batch, bitmask.shape[1]), -1, dtype=torch.int32)
        full[rows] = bitmask
        bitmask = full
    width = bitmask.shape[1] * 32
    if width < vocab:  # a bitmask narrower than the logits allows nothing past its end
        logits[rows, width:] = float("-inf")
    apply_token_bitmask_inplace_cpu(logits, bitmask.contiguous(), min(vocab, width), rows.tolist())


# Byte value -> its 8 bits, lowest first: a little-endian int32 word is 4 such bytes, token j % 32 of the
# word sitting in byte (j % 32) // 8, bit j % 8. A table lookup per byte unpacks ~1.5x faster than
# shifting every word 32 times (32 x 49152 tokens on the CPU).
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, W] -> bool [R, vocab_size]: True where the token is allowed."""
    if bitmask.device.type == "cpu" and sys.byteorder == "little":
        table = _BYTE_BITS
        return table[bitmask.view(torch.uint8).long()].view(bitmask.shape[0], -1)[:, :vocab_size]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # arithmetic shift: bit 31 of a negative word still reads 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """The plain-torch op (the reference, and the CPU path)."""
    vocab = logits.shape[-1]
    allowed = unpack_bitmask(bitmask, vocab)
    if allowed.shape[1] < vocab:  # a bitmask narrower than the logits allows nothing past its end
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    if rows.shape[0] == logits.shape[0] and bool((rows == torch.arange(rows.shape[0], device=rows.device)).all()):
        logits.masked_fill_(~allowed, float("-inf"))  # every row constrained, in order: in place at once
        return
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))

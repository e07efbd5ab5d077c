"""The token bitmask as a Triton kernel (CUDA): one program per (constrained row, block of tokens),
reading each token's bit from its packed word, so no unpacked [R, V] mask is ever materialized.
Tested against the torch op under TRITON_INTERPRET=1 (tests/unit/test_structured_output.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab_size, logits_stride, bitmask_stride,
                          num_words, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    block = tl.program_id(1)
    row = tl.load(rows_ptr + r)
    tokens = block * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab_size
    words = tokens // 32
    packed = tl.load(bitmask_ptr + r * bitmask_stride + words, mask=in_vocab & (words < num_words), other=0)
    allowed = ((packed >> (tokens % 32)) & 1) != 0
    pointers = logits_ptr + row * logits_stride + tokens
    # Only the banned positions are written: an allowed logit is never read or rewritten.
    tl.store(pointers, tl.full((BLOCK,), float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
             mask=in_vocab & ~allowed)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits: [B, V] (contiguous rows); bitmask: int32 [R, W]; rows: int64 [R], on the logits' device."""
    num_rows = rows.shape[0]
    if num_rows == 0:
        return
    vocab = logits.shape[-1]
    grid = (num_rows, triton.cdiv(vocab, _BLOCK))
    _apply_bitmask_kernel[grid](logits, bitmask.contiguous(), rows, vocab, logits.stride(0),
                                bitmask.shape[1], bitmask.shape[1], BLOCK=_BLOCK)

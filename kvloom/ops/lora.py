"""The LoRA delta of a batch that mixes adapters: y[t] += B[s_t] (A[s_t] x[t]) for each token t whose
request runs the adapter in compute slot s_t (s_t = -1: the base model, no delta).

    x:           [T, in]          the projection's input
    lora_a:      [S, R, in]       the shrink of each slot (R = shards x max_lora_rank, zero-padded)
    lora_b:      [S, out, R]      the expand, the scaling folded in; a fused projection's (q|k|v, gate|up) is
                                  block-diagonal: output rows of shard j read columns j*rank..(j+1)*rank
    token_slots: [T] int64        the slot of each token, -1 for none
    y:           [T, out]         the base projection's output, added to in place

This is the shape of Punica's / S-LoRA's gathered matmuls: shrink to rank R, expand back. Three
implementations, one answer:
- ``add_lora_reference``: one token at a time in fp32 (the oracle);
- ``add_lora_grouped`` (CPU, and every device without Triton): SGMV's grouping in torch, tokens gathered
  by slot (``LoRAGroups``, built once a step), one shrink and one expand GEMM per slot in the batch, so a
  token costs only its own adapter's product;
- ``add_lora_cpu`` (CPU with kvloom's C++ library): csrc/lora.cpp, the tokens grouped by slot in chunks of a few
  (each chunk reads its slot's A and B once), shrink then expand on kvloom's parallel loop (not torch's BLAS
  threads, which wait for descheduled threads on a busy machine); B stored transposed (``lora_b_t`` [S, R, out]:
  the expand adds whole rows, no horizontal sums) and read only in each shard's own outputs. The C++ layer
  stack (csrc/decoder.cpp) calls the same code after each projection, the tokens grouped once a step;
- ``kvloom.ops.triton.lora.add_lora_triton`` (CUDA): BGMV, a program per token and block of outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def add_lora_reference(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       token_slots: torch.Tensor) -> None:
    """The oracle: each token's delta in fp32, rounded once into y's dtype."""
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        shrunk = lora_a[slot].float() @ x[t].float()                   # [R]
        y[t] = (y[t].float() + lora_b[slot].float() @ shrunk).to(y.dtype)  # [out]


@dataclass(frozen=True)
class LoRAGroups:
    """A step's tokens grouped by compute slot, built once and used by every layer:
    ``groups``: (slot, the rows of its tokens [n] int64, or a slice when they are contiguous)."""

    groups: tuple[tuple[int, torch.Tensor | slice], ...]

    @classmethod
    def from_token_slots(cls, token_slots: list[int], device: torch.device) -> LoRAGroups:
        rows_of: dict[int, list[int]] = {}
        for t, slot in enumerate(token_slots):
            if slot >= 0:
                rows_of.setdefault(slot, []).append(t)
        groups: list[tuple[int, torch.Tensor | slice]] = []
        for slot, rows in rows_of.items():
            if rows[-1] - rows[0] + 1 == len(rows):  # contiguous: a view, no gather or scatter
                groups.append((slot, slice(rows[0], rows[-1] + 1)))
            else:
                groups.append((slot, torch.tensor(rows, dtype=torch.long, device=device)))
        return cls(tuple(groups))


def add_lora_grouped(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                     groups: LoRAGroups) -> None:
    """The batched torch path: per slot present in the batch, its tokens' rows [n, in] -> [n, R] -> [n, out].

    The products run in lora_a's dtype: on a CPU without AVX-512 torch's bf16 GEMM is a slow scalar loop, so
    the CPU keeps A and B in fp32 (``lora_compute_dtype``) and converts the gathered rows and the delta."""
    compute = lora_a.dtype
    for slot, rows in groups.groups:
        if isinstance(rows, slice):
            delta = (x[rows].to(compute) @ lora_a[slot].t()) @ lora_b[slot].t()
            y[rows] += delta.to(y.dtype)
        else:
            delta = (x.index_select(0, rows).to(compute) @ lora_a[slot].t()) @ lora_b[slot].t()
            y.index_add_(0, rows, delta.to(y.dtype))


def lora_compute_dtype(device: torch.device, dtype: torch.dtype, cpu_kernel: bool = False) -> torch.dtype:
    """The dtype of the slots' A and B: the model's on CUDA (the Triton kernels sum in fp32 anyway); on the CPU
    bf16 for a bf16 model with csrc/lora.cpp (which widens it to fp32 in registers: half the bytes a step
    streams, the base weights' precision), else fp32: torch's half-precision GEMMs are slow without AVX-512."""
    if device.type == "cuda" or (cpu_kernel and dtype == torch.bfloat16):
        return dtype
    return torch.float32


def add_lora_cpu(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b_t: torch.Tensor,
                 token_slots: torch.Tensor, out_offsets: list[int]) -> None:
    """csrc/lora.cpp's delta (the library loaded: ``cpu_lora_available``). lora_b_t [S, R, out]: lora_b
    transposed; A and B both fp32 or both bf16. out_offsets: the shards' first outputs and the end (``[0, out]``
    for a plain projection; q|k|v's ``[0, q, q + kv, q + 2 kv]``), shard j owning ranks j*R/shards onwards."""
    torch.ops.kvloom.lora_bgmv(y, x, lora_a, lora_b_t, token_slots, out_offsets)


def cpu_lora_available() -> bool:
    """Whether kvloom's C++ library is loaded with the LoRA kernel."""
    return hasattr(torch.ops, "kvloom") and hasattr(torch.ops.kvloom, "lora_bgmv")

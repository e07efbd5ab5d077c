"""4-bit safetensors checkpoints: GPTQ and AWQ, read from their ``quantization_config``.

Both store a linear's weight W [N, K] as 4-bit codes q with a scale s and a zero point z per (group of
``group_size`` inputs, output column):

    W[n, k] = s[g(k), n] * (q[k, n] - z[g(k), n])

- **GPTQ** (AutoGPTQ / GPTQModel, ``quant_method: "gptq"``): ``qweight`` int32 [K / 8, N] holds q[8 i + j, n] in
  bits 4 j of word (i, n); ``qzeros`` int32 [groups, N / 8] holds z[g, 8 i + j] in bits 4 j of word (g, i),
  stored as z - 1 in the original ("gptq", v1) checkpoint format and as z in "gptq_v2"; symmetric checkpoints
  (``sym: true``) mean z = 8 whatever qzeros says, as vLLM reads them. ``g_idx`` [K] gives each input's group
  (i // group_size, unless the checkpoint was quantized in activation order, ``desc_act``).
- **AWQ** (AutoAWQ GEMM, ``quant_method: "awq"``): ``qweight`` int32 [K, N / 8] and ``qzeros`` [groups, N / 8]
  pack 8 output columns per word in the order 0, 2, 4, 6, 1, 3, 5, 7 (column 8 i + j in nibble
  ``AWQ_NIBBLE[j]``); z as stored.

``scales`` fp16 [groups, N] in both. A group of ``group_size`` (a multiple of 32, or -1: all of K) is a run of
blocks of 32 that share one scale and offset, so each weight becomes ``Q4Blocks`` exactly (d = s, m = -s z: an
fp16 times a 4-bit integer is exact in fp32) and runs on the GGUF 4-bit product. A GPTQ weight in true
activation order (a g_idx that is not i // group_size) has no such blocks: it is dequantized to float, with one
log line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvloom.ops.q4 import BLOCK, Q4Blocks

logger = logging.getLogger("kvloom")

METHODS = ("gptq", "awq")
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8 i + j sits in nibble AWQ_NIBBLE[j] of an AWQ word
_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(frozen=True)
class Int4Format:
    method: str  # "gptq" or "awq"
    group_size: int  # -1: one group over all inputs
    symmetric: bool  # GPTQ sym: z = 8
    zero_offset: int  # GPTQ v1 stores z - 1

    @classmethod
    def from_config(cls, config: dict[str, Any], where: str) -> Int4Format:
        """From a config.json's ``quantization_config``; ValueError for what kvloom cannot read."""
        method = str(config.get("quant_method", "")).lower()
        if method not in METHODS:
            raise ValueError(f"{where}: quantization_config quant_method {config.get('quant_method')!r} is not "
                             f"supported; kvloom reads {list(METHODS)} (4-bit) and GGUF files")
        bits = config.get("bits", config.get("w_bit"))
        if bits != 4:
            raise ValueError(f"{where}: {method} with bits={bits!r} is not supported; kvloom reads 4-bit {method}")
        group_size = config.get("group_size", config.get("q_group_size", 128))
        if not isinstance(group_size, int) or not (group_size == -1 or (group_size > 0 and group_size % BLOCK == 0)):
            raise ValueError(f"{where}: {method} group_size={group_size!r} is not supported; it must be -1 or a "
                             f"multiple of {BLOCK}")
        if method == "awq":
            version = str(config.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"{where}: AWQ version {version!r} is not supported; kvloom reads the 'gemm' layout")
            if not config.get("zero_point", True):
                raise ValueError(f"{where}: AWQ without zero points is not supported")
            return cls("awq", group_size, symmetric=False, zero_offset=0)
        checkpoint_format = str(config.get("checkpoint_format", "gptq")).lower()
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"{where}: GPTQ checkpoint_format {checkpoint_format!r} is not supported; kvloom reads "
                             f"'gptq' and 'gptq_v2'")
        return cls("gptq", group_size, symmetric=bool(config.get("sym", True)),
                   zero_offset=1 if checkpoint_format == "gptq" else 0)


def unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int32 [8 R, C]: nibble j of word (i, c) is row 8 i + j (GPTQ's qweight)."""
    rows, columns = words.shape
    return ((words.unsqueeze(1) >> _SHIFTS[None, :, None]) & 0xF).reshape(8 * rows, columns)


def unpack_columns(words: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] -> int32 [R, 8 C]: column 8 i + j from nibble ``order[j]`` (j itself by default) of word
    (r, i) (GPTQ's qzeros; AWQ's qweight and qzeros with AWQ_NIBBLE)."""
    nibbles = (words.unsqueeze(-1) >> _SHIFTS) & 0xF  # [R, C, 8]
    if order is not None:
        nibbles = nibbles[..., list(order)]
    return nibbles.reshape(words.shape[0], -1)


def int4_weight(parts: dict[str, torch.Tensor], fmt: Int4Format, name: str, keep: bool) -> Q4Blocks | torch.Tensor:
    """One linear's packed tensors -> Q4Blocks [N, K] (``keep``, where its groups are blocks of 32) or its float32
    values. ValueError naming the tensor when a part is missing or the shapes disagree."""
    missing = [part for part in ("qweight", "scales") + (("qzeros",) if not fmt.symmetric else ())
               if part not in parts]
    if missing:
        raise ValueError(f"{fmt.method} weight {name!r}: the checkpoint has no {', '.join(missing)}")
    scales = parts["scales"].float()
    if fmt.method == "gptq":
        codes = unpack_rows(parts["qweight"].to(torch.int32))  # [K, N]
    else:
        codes = unpack_columns(parts["qweight"].to(torch.int32), AWQ_NIBBLE)
    k, n = codes.shape
    groups = 1 if fmt.group_size == -1 else -(-k // fmt.group_size)
    group_size = k if fmt.group_size == -1 else fmt.group_size
    if tuple(scales.shape) != (groups, n):
        raise ValueError(f"{fmt.method} weight {name!r}: scales have shape {tuple(scales.shape)}, expected "
                         f"{(groups, n)} for {k} inputs in groups of {group_size}")
    if fmt.symmetric:
        zeros = torch.full((groups, n), 8, dtype=torch.int32)
    else:
        order = AWQ_NIBBLE if fmt.method == "awq" else None
        zeros = unpack_columns(parts["qzeros"].to(torch.int32), order)[:, :n] + fmt.zero_offset
        if tuple(zeros.shape) != (groups, n):
            raise ValueError(f"{fmt.method} weight {name!r}: qzeros hold {tuple(zeros.shape)} zero points, "
                             f"expected {(groups, n)}")
    group_of = torch.arange(k) // group_size
    g_idx = parts.get("g_idx")
    ordered = g_idx is None or torch.equal(g_idx.to(torch.int64), group_of)
    if g_idx is not None and not ordered:
        if tuple(g_idx.shape) != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"{fmt.method} weight {name!r}: g_idx must give each of the {k} inputs a group in "
                             f"[0, {groups})")
        group_of = g_idx.to(torch.int64)
    if keep and ordered and k % BLOCK == 0:
        per_block = group_of[::BLOCK]  # [K / 32]: each block lies inside one group
        d = scales[per_block].t().contiguous()  # [N, K / 32]
        m = (-(scales * zeros.float()))[per_block].t().contiguous()
        return Q4Blocks(codes.t().to(torch.uint8).contiguous(), d, m)
    if keep:
        logger.info("%s weight %s is in activation order (desc_act): dequantized to float, not kept 4-bit",
                    fmt.method, name)
    return ((codes - zeros[group_of]).float() * scales[group_of]).t().contiguous()


def iter_int4_weights(weights: Iterable[tuple[str, torch.Tensor]], fmt: Int4Format, keep: bool
                      ) -> Iterator[tuple[str, torch.Tensor | Q4Blocks]]:
    """A GPTQ / AWQ checkpoint's tensors with each linear's packed parts (``<prefix>.qweight``, ``.qzeros``,
    ``.scales``, ``.g_idx``) turned into one ``<prefix>.weight``: ``Q4Blocks`` with ``keep``, else float32. The
    rest passes through as it comes; the packed linears follow once every tensor has been read (their parts may
    lie in any order and any shard)."""
    packed: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part in _PARTS:
            packed.setdefault(prefix, {})[part] = tensor
        else:
            yield name, tensor
    for prefix, parts in packed.items():
        yield f"{prefix}.weight", int4_weight(parts, fmt, prefix, keep)

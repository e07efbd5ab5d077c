"""GGUF files: a fast metadata reader, float32 dequantization (or the blocks kept: Q8_0 and Q5_0 as int8 codes and
block scales, ``Int8Blocks``; Q4_0, Q4_1 and Q4_K as 4-bit codes, Q5_0 (projections), Q5_1 and Q5_K as 5-bit ones,
each with a scale and offset per block of 32, Q6_K as 6-bit ones with a scale and offset per 16, ``Q4Blocks``), and
llama.cpp's names turned into HF's.

The metadata reader is ours rather than `gguf.GGUFReader` because that one builds numpy views for
every one of the ~100k vocabulary strings and takes ~3 s on the default model; this one reads the
same metadata in a fraction of that. The common block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are
dequantized with vectorized torch ops; any other block type falls back to `gguf.quants`.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import re
import struct
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from kvloom.ops.int8 import BLOCK, Int8Blocks, Q8_0Blocks
from kvloom.ops.q4 import Q4Blocks
from kvloom.ops.q4k import Q4KBlocks, Q6KBlocks, decode_k_quant

logger = logging.getLogger("kvloom")

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# ggml type ids (gguf.GGMLQuantizationType), for the types dequantized here without the gguf package.
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q5_0, GGML_Q5_1, GGML_Q8_0, GGML_BF16 = 0, 1, 2, 3, 6, 7, 8, 30
GGML_Q2_K, GGML_Q3_K, GGML_Q4_K, GGML_Q5_K, GGML_Q6_K = 10, 11, 12, 13, 14
# The types kept as codes with a scale and offset per block of 32 (Q6_K: per 16): each is exactly a Q4Blocks (a
# k-quant's sub-block scales and mins times its fp16 super-block ones are exact in fp32): 4-bit codes for Q4_0,
# Q4_1, Q4_K (``keep_q4``), 5-bit ones for Q5_1, Q5_K (``keep_q5``), 6-bit ones for Q6_K (``keep_q6``).
Q4_TYPES = (GGML_Q4_0, GGML_Q4_1, GGML_Q4_K)
Q5_TYPES = (GGML_Q5_1, GGML_Q5_K, GGML_Q5_0)  # Q5_0: codes q with m = -16 d (a projection; else int8 blocks)
Q6_TYPES = (GGML_Q6_K,)
CODE_BLOCK_TYPES = Q4_TYPES + Q5_TYPES + Q6_TYPES
# The types kept as int8 blocks (``keep_q8_0``): Q8_0, and Q5_0, whose codes q - 16 (-16..15) with the block's
# scale are exactly its values (llama.cpp's Q4_K_M of a model whose rows fit no 256-value k-quant block is
# mostly Q5_0).
INT8_BLOCK_TYPES = (GGML_Q8_0, GGML_Q5_0)
FLOAT_TYPES = (GGML_F32, GGML_F16, GGML_BF16)

# Metadata value types of the GGUF spec.
_STRING, _ARRAY = 8, 9
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}

# llama.cpp's tensor names for the llama architecture -> HF names (gguf-py's tensor_mapping, inverted).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
}
# GGUF architectures read here -> (HF architecture, model_type). llama.cpp's converter permutes Llama's q/k rows
# to its rotary order (undone at load: reverse_rotary_permute); Qwen's it stores as HF has them.
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                 "qwen3": ("Qwen3ForCausalLM", "qwen3"), "gemma2": ("Gemma2ForCausalLM", "gemma2"),
                 "gemma3": ("Gemma3ForCausalLM", "gemma3_text"), "phi3": ("Phi3ForCausalLM", "phi3"),
                 "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"), "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe")}
# Mixtral has no architecture of its own in llama.cpp: a llama file with {arch}.expert_count is one.
MIXTRAL = ("MixtralForCausalLM", "mixtral")
PERMUTED_ROTARY = frozenset({"llama"})
# Each family's own block tensor names where they differ from Llama's (llama.cpp's tensor_mapping, inverted).
# Gemma: four norms per layer. Phi-3: q/k/v fused as attn_qkv, and gate/up fused and stored as ffn_up (2I rows,
# gate first) -- Phi3ForCausalLM splits both. Mixture of experts: the router (ffn_gate_inp), Qwen2-MoE's shared
# expert and its sigmoid gate; the experts themselves are 3-D stacks (_EXPERT_STACKS).
_GEMMA_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_QWEN_MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                   "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                   "ffn_down_shexp": "mlp.shared_expert.down_proj"}
_FAMILY_BLOCK_NAMES: dict[str, dict[str, str]] = {
    "llama": {"ffn_gate_inp": "block_sparse_moe.gate"},  # Mixtral's router
    "gemma2": _GEMMA_NAMES, "gemma3": _GEMMA_NAMES,
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "qwen2moe": _QWEN_MOE_NAMES, "qwen3moe": _QWEN_MOE_NAMES,
}
# The experts' 3-D stacks [E, rows, cols] -> each expert's HF projection name, per family: Mixtral's w1 / w3 / w2
# under block_sparse_moe, Qwen-MoE's gate / up / down under mlp.
_EXPERT_STACKS = {"ffn_gate_exps": ("w1", "gate_proj"), "ffn_up_exps": ("w3", "up_proj"),
                  "ffn_down_exps": ("w2", "down_proj")}
# Gemma's RMSNorm scales by (1 + w); llama.cpp's converter stores 1 + w, HF's checkpoint w.
NORMS_PLUS_ONE = frozenset({"gemma2", "gemma3"})
# Phi-3's LongRoPE factors (per rotary frequency), read into rope_scaling rather than loaded as weights.
ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Llama-3.1-style checkpoints carry their rope scaling as this tensor of per-frequency divisors;
# gguf_config_dict turns it back into HF's rope_scaling, so it is not a weight.
ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: GGUF lists dimensions fastest-first, so this is reversed
    ggml_type: int
    offset: int  # absolute offset of the data in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]


def read_gguf(path: str) -> GGUFFile:
    """The metadata and tensor directory of a GGUF file (cached: config, weights, tokenizer all read it)."""
    stat = os.stat(path)
    return _read_gguf_cached(os.path.realpath(path), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=4)
def _read_gguf_cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    if size < 24:
        raise ValueError(f"{path} is not a GGUF file (too short for a GGUF header)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _parse(path, buf, size)
        except (struct.error, UnicodeDecodeError, OverflowError) as e:
            raise ValueError(f"{path}: GGUF metadata is truncated or corrupt ({e})") from None


def _parse(path: str, buf: mmap.mmap, size: int) -> GGUFFile:
    if buf[:4] != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (supported: 2, 3)")
    cursor = _Cursor(path, buf, 24)
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))

    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(tensor_count):
        name = cursor.string()
        n_dims = cursor.unpack("<I")
        dims = [cursor.unpack("<Q") for _ in range(n_dims)]
        ggml_type, offset = cursor.unpack("<I"), cursor.unpack("<Q")
        infos.append((name, tuple(reversed(dims)), ggml_type, offset))

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"{path}: GGUF general.alignment must be a positive integer, got {alignment!r}")
    data_start = cursor.pos + (-cursor.pos % alignment)
    tensors = {}
    for name, shape, ggml_type, offset in infos:
        nbytes = _tensor_nbytes(path, name, shape, ggml_type)
        start = data_start + offset
        if start + nbytes > size:
            raise ValueError(f"{path}: tensor {name} runs past the end of the file (is the file truncated?)")
        tensors[name] = GGUFTensorInfo(name, shape, ggml_type, start, nbytes)
    return GGUFFile(path, metadata, tensors)


class _Cursor:
    """Reads GGUF's little-endian values from a buffer, front to back."""

    def __init__(self, path: str, buf: mmap.mmap, pos: int) -> None:
        self.path, self.buf, self.pos = path, buf, pos

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        self.check_fits(length)
        text = self.buf[self.pos:self.pos + length].decode("utf-8", errors="replace")
        self.pos += length
        return text

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _NUMPY_DTYPES:
                dtype = np.dtype(_NUMPY_DTYPES[item_type])
                self.check_fits(dtype.itemsize * count)
                values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
                self.pos += dtype.itemsize * count
                return values
            if item_type == _STRING:
                return self.string_array(count)
            return [self.value(item_type) for _ in range(count)]
        fmt = _SCALAR_FORMATS.get(value_type)
        if fmt is None:
            raise ValueError(f"{self.path}: unknown GGUF metadata value type {value_type}")
        return self.unpack(fmt)

    def check_fits(self, nbytes: int) -> None:
        """A length read from a corrupt file can point anywhere: refuse one that runs past the end."""
        if self.pos + nbytes > len(self.buf):
            raise ValueError(f"{self.path}: GGUF metadata is truncated or corrupt (a value of {nbytes} bytes "
                             f"at offset {self.pos} runs past the end of the file)")

    def string_array(self, count: int) -> list[str]:
        # The vocabulary and merges are ~50k strings each: a tight loop over local names is what
        # keeps reading them well under 100 ms.
        buf, pos = self.buf, self.pos
        unpack = struct.Struct("<Q").unpack_from
        out: list[str] = []
        append = out.append
        end = len(buf)
        for _ in range(count):
            (length,) = unpack(buf, pos)
            pos += 8
            if pos + length > end:
                self.pos = pos
                self.check_fits(length)
            append(buf[pos:pos + length].decode("utf-8", errors="replace"))
            pos += length
        self.pos = pos
        return out


def _block_layout(ggml_type: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a ggml type."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise ValueError(f"unknown ggml tensor type {ggml_type}") from None


# The types of the common files, known here so that reading a header does not import the gguf package (0.1-0.2 s
# of a start); the rest come from gguf.constants (test_gguf_block_layouts_match_the_gguf_package).
_KNOWN_LAYOUTS = {GGML_F32: (1, 4), GGML_F16: (1, 2), GGML_BF16: (1, 2), GGML_Q4_0: (32, 18),
                  GGML_Q4_1: (32, 20), GGML_Q5_0: (32, 22), GGML_Q5_1: (32, 24), GGML_Q8_0: (32, 34),
                  GGML_Q2_K: (256, 84), GGML_Q3_K: (256, 110), GGML_Q4_K: (256, 144), GGML_Q5_K: (256, 176),
                  GGML_Q6_K: (256, 210)}


def _tensor_nbytes(path: str, name: str, shape: tuple[int, ...], ggml_type: int) -> int:
    layout = _KNOWN_LAYOUTS.get(ggml_type)
    if layout is None:
        try:
            layout = _block_layout(ggml_type)
        except ValueError as e:
            raise ValueError(f"{path}: tensor {name}: {e}") from None
    block_size, type_size = layout
    numel = math.prod(shape)
    if shape and shape[-1] % block_size:
        raise ValueError(f"{path}: tensor {name} has rows of {shape[-1]} values, not a multiple of its "
                         f"block size {block_size}")
    return numel // block_size * type_size


def mapped_tensor_bytes(path: str, info: GGUFTensorInfo) -> torch.Tensor:
    """One tensor's bytes as a view of the file's pages (a mapping of its own range, copy-on-write: writable for
    torch.frombuffer, never written). Packing reads the page cache in place; the mapping lives as long as the view
    (dropped once packed, so the file's pages do not stay mapped, nor counted as this process's)."""
    start = info.offset - info.offset % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), info.offset + info.nbytes - start, access=mmap.ACCESS_COPY, offset=start)
    return torch.frombuffer(mapping, dtype=torch.uint8, offset=info.offset - start, count=info.nbytes)


def read_tensor_bytes(path: str, info: GGUFTensorInfo) -> torch.Tensor:
    """The raw bytes of one tensor as a uint8 tensor (a fresh, writable buffer)."""
    data = bytearray(info.nbytes)
    with open(path, "rb") as f:
        f.seek(info.offset)
        if f.readinto(data) != info.nbytes:
            raise ValueError(f"{path}: could not read tensor {info.name} (is the file truncated?)")
    return torch.frombuffer(data, dtype=torch.uint8)


def dequantize(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Float32 values of a tensor stored as ggml type `ggml_type`.

    raw: the stored bytes, uint8 (n_bytes,); shape: the tensor's shape in torch order.
    """
    if ggml_type == GGML_F32:
        return raw.view(torch.float32).reshape(shape)
    if ggml_type == GGML_F16:
        return raw.view(torch.float16).float().reshape(shape)
    if ggml_type == GGML_BF16:
        return raw.view(torch.bfloat16).float().reshape(shape)
    dequantize_blocks = _TORCH_DEQUANTIZERS.get(ggml_type)
    if dequantize_blocks is None:
        # K-quants and the rest: gguf's numpy reference, slower but complete.
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        values = gguf_dequantize(raw.numpy(), GGMLQuantizationType(ggml_type))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)
    block_bytes = _KNOWN_LAYOUTS[ggml_type][1]
    return dequantize_blocks(raw.view(-1, block_bytes)).reshape(shape)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 stored at byte `start` of every block, as float32: (n_blocks, 1)."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n_blocks, 16) packed bytes -> (n_blocks, 32): low nibbles are elements 0-15, high ones 16-31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _fifth_bits(qh_bytes: torch.Tensor) -> torch.Tensor:
    """(n_blocks, 4) little-endian uint32 of high bits -> (n_blocks, 32) values 0 or 16."""
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = (qh_bytes.unsqueeze(-1) >> shifts) & 1  # (n_blocks, 4 bytes, 8 bits): bit j of the uint32
    return bits.reshape(-1, 32) << 4


def _dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # block: d (f16) | 16 bytes of 4-bit values; x = (q - 8) * d
    return _half(blocks, 0) * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()


def _dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # block: d (f16) | m (f16) | 16 bytes of 4-bit values; x = q * d + m
    return _half(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _half(blocks, 2)


def _q5_0_codes(blocks: torch.Tensor) -> torch.Tensor:
    # block: d (f16) | 32 fifth bits (u32) | 16 bytes of low nibbles; x = (q - 16) * d: the int8 codes q - 16
    return _q5_0_unsigned(blocks).to(torch.int8) - 16


def _q5_0_unsigned(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0's codes q as stored, 0..31 (uint8)."""
    return _nibbles(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6])


def _dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * _q5_0_codes(blocks).float()


def _dequantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * _q5_1_codes(blocks).float() + _half(blocks, 2)


def q8_0_blocks(raw: torch.Tensor, shape: tuple[int, ...]) -> Int8Blocks:
    """A 2-D Q8_0 tensor as stored: its int8 codes [N, K] and its fp16 block scales as fp32 [N, K / 32]
    (exact), bit for bit the file's (no dequantization)."""
    return Q8_0Blocks.from_gguf(raw, shape).to_int8_blocks()


def q5_0_blocks(raw: torch.Tensor, shape: tuple[int, ...]) -> Int8Blocks:
    """A 2-D Q5_0 tensor as int8 blocks: codes q - 16 [N, K] and the fp16 block scales as fp32 [N, K / 32], whose
    products are exactly the file's values."""
    n, k = shape
    blocks = raw.view(-1, _KNOWN_LAYOUTS[GGML_Q5_0][1])
    return Int8Blocks(_q5_0_codes(blocks).reshape(n, k), _half(blocks, 0).reshape(n, k // BLOCK))


def q8_0_weight_names(path: str) -> set[str]:
    """HF names of the file's 2-D tensors that ``keep_q8_0`` hands over as int8 blocks (Q8_0, Q5_0)."""
    return weight_names_of_types(path, INT8_BLOCK_TYPES)


def weight_names_of_types(path: str, ggml_types: tuple[int, ...]) -> set[str]:
    """HF names of the file's 2-D tensors stored in one of ``ggml_types``."""
    gguf = read_gguf(path)
    arch = str(gguf.metadata.get("general.architecture"))
    names = {hf_tensor_name(info.name, arch) for info in gguf.tensors.values()
             if info.ggml_type in ggml_types and len(info.shape) == 2}
    return {name for name in names if name}


def code_block_types(five_bits: bool, six_bits: bool) -> tuple[int, ...]:
    """The types kept as code blocks: the 4-bit ones, with ``five_bits`` the 5-bit ones, with ``six_bits`` Q6_K."""
    return Q4_TYPES + (Q5_TYPES if five_bits else ()) + (Q6_TYPES if six_bits else ())


def has_code_block_projections(path: str, five_bits: bool = True, six_bits: bool = True) -> bool:
    """Whether any of the file's projection weights (q/k/v/o, gate/up/down) is of a type ``code_block_types`` keeps."""
    types = code_block_types(five_bits, six_bits)
    return any(name.endswith("_proj.weight") for name in weight_names_of_types(path, types))


def q4_blocks(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> Q4Blocks:
    """A 2-D tensor of one of CODE_BLOCK_TYPES as codes (4-bit, or 5-bit for Q5_1 / Q5_K) with a scale and offset
    per block of 32, exactly the values the file's dequantization gives (no rounding: each scale and offset is
    exact in fp32)."""
    if ggml_type in (GGML_Q4_0, GGML_Q4_1):
        return Q4Blocks.from_gguf(raw, tuple(shape), with_offset=ggml_type == GGML_Q4_1)
    if ggml_type == GGML_Q5_1:
        return _q5_1_blocks(raw, tuple(shape))
    if ggml_type == GGML_Q5_0:  # x = (q - 16) d: codes q with the offset -16 d (exact)
        n, k = shape
        blocks = raw.view(-1, _KNOWN_LAYOUTS[GGML_Q5_0][1])
        d = _half(blocks, 0).reshape(n, k // BLOCK)
        return Q4Blocks(_q5_0_unsigned(blocks).reshape(n, k), d, -16 * d)
    if ggml_type == GGML_Q6_K:
        return _q6_k_blocks(raw, tuple(shape))
    if ggml_type not in (GGML_Q4_K, GGML_Q5_K):
        raise ValueError(f"ggml type {ggml_type} is not kept as code blocks; those are {CODE_BLOCK_TYPES}")
    return _k_quant_blocks(raw, ggml_type, tuple(shape))


def _q6_k_blocks(raw: torch.Tensor, shape: tuple[int, int]) -> Q4Blocks:
    """Q6_K: codes 0..63 with d * scale and -32 d * scale per 16 elements (exact in fp32; q4k.decode_q6_k)."""
    return Q6KBlocks.from_gguf(raw, shape).to_blocks()


def _q5_1_codes(blocks: torch.Tensor) -> torch.Tensor:
    # block: d (f16) | m (f16) | 32 fifth bits (u32) | 16 bytes of low nibbles; x = q * d + m, q in 0..31
    return _nibbles(blocks[:, 8:]) | _fifth_bits(blocks[:, 4:8])


def _q5_1_blocks(raw: torch.Tensor, shape: tuple[int, int]) -> Q4Blocks:
    n, k = shape
    blocks = raw.view(-1, _KNOWN_LAYOUTS[GGML_Q5_1][1])
    if blocks.shape[0] != n * k // BLOCK:
        raise ValueError(f"{raw.numel()} bytes do not hold a Q5_1 weight of shape {shape}")
    return Q4Blocks(_q5_1_codes(blocks).reshape(n, k), _half(blocks, 0).reshape(n, k // BLOCK),
                    _half(blocks, 2).reshape(n, k // BLOCK))


# Super-block bytes of the k-quants kept as code blocks: d | dmin | 12 bytes of scales and mins | (Q5_K: 32 bytes of
# fifth bits) | 128 bytes of nibbles.
_K_QUANT_BYTES = {GGML_Q4_K: 144, GGML_Q5_K: 176}


def _k_quant_blocks(raw: torch.Tensor, ggml_type: int, shape: tuple[int, int]) -> Q4Blocks:
    """Q4_K / Q5_K: super-blocks of 256 = d (f16) | dmin (f16) | 12 bytes of 6-bit (scale, min) pairs for 8
    sub-blocks of 32 | (Q5_K: 32 bytes qh) | 128 bytes of nibbles (q4k.decode_k_quant)."""
    n, k = shape
    name = "Q4_K" if ggml_type == GGML_Q4_K else "Q5_K"
    if k % 256:
        raise ValueError(f"a {name} weight needs in_features a multiple of 256, got {k}")
    blocks = raw.view(-1, _K_QUANT_BYTES[ggml_type])
    if blocks.shape[0] != n * k // 256:
        raise ValueError(f"{raw.numel()} bytes do not hold a {name} weight of shape {shape}")
    codes, d, m = decode_k_quant(blocks, fifth_bits=ggml_type == GGML_Q5_K)
    return Q4Blocks(codes.reshape(n, k).contiguous(), d.reshape(n, k // BLOCK), m.reshape(n, k // BLOCK))


def _dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # block: d (f16) | 32 int8 values; x = q * d
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _half(blocks, 0)


_TORCH_DEQUANTIZERS = {
    GGML_Q4_0: _dequantize_q4_0,
    GGML_Q4_1: _dequantize_q4_1,
    GGML_Q5_0: _dequantize_q5_0,
    GGML_Q5_1: _dequantize_q5_1,
    GGML_Q8_0: _dequantize_q8_0,
}


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF name of a GGUF tensor of architecture ``arch``; None for one with no HF counterpart (and for the
    experts' 3-D stacks, which become one HF tensor per expert: expert_tensor_names)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None:
        return None
    layer, part, kind = match.groups()
    names = _FAMILY_BLOCK_NAMES.get(arch, {})
    hf_part = names.get(part) or _BLOCK_NAMES.get(part)
    return None if hf_part is None else f"model.layers.{layer}.{hf_part}.{kind}"


def expert_tensor_names(gguf_name: str, arch: str, num_experts: int) -> list[str] | None:
    """HF names of each expert's slice of an expert stack (``blk.N.ffn_{gate,up,down}_exps.weight``), expert 0
    first; None for any other tensor."""
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _EXPERT_STACKS or match.group(3) != "weight":
        return None
    layer, part = match.group(1), match.group(2)
    mixtral_part, qwen_part = _EXPERT_STACKS[part]
    if arch == "llama":
        return [f"model.layers.{layer}.block_sparse_moe.experts.{e}.{mixtral_part}.weight" for e in range(num_experts)]
    return [f"model.layers.{layer}.mlp.experts.{e}.{qwen_part}.weight" for e in range(num_experts)]


def reverse_rotary_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k rows for its rotary convention.

    llama.cpp's converter stores each head's rows as interleaved (x0, x_half, x1, x_half+1, ...) pairs;
    HF's rotate_half wants the two halves contiguous. Same as transformers' _reverse_permute_weights.
    weight: (num_heads * head_dim, ...) -> same shape.
    """
    head_dim = weight.shape[0] // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


Weight = torch.Tensor | Int8Blocks | Q8_0Blocks | Q4Blocks | Q4KBlocks | Q6KBlocks


def iter_gguf_weights(path: str, num_heads: int, num_kv_heads: int, keep_q8_0: bool = False,
                      keep_q4: bool = False, keep_q5: bool = False, keep_q6: bool = False,
                      keep_super_blocks: bool = False, keep_q8_0_bytes: bool = False
                      ) -> Iterator[tuple[str, Weight]]:
    """Every weight of a GGUF (ARCHITECTURES) as (HF name, float32 tensor in HF layout); with ``keep_q8_0`` a 2-D
    Q8_0 (or Q5_0) weight comes as ``Int8Blocks`` instead, its codes and scales as stored, and with ``keep_q4`` a
    2-D Q4_0 / Q4_1 / Q4_K weight (with ``keep_q5`` too a Q5_1 / Q5_K one, with ``keep_q6`` a Q6_K one) as
    ``Q4Blocks`` (q/k rows reordered
    like the floats: a row keeps its blocks). Family transforms undone here: Llama's q/k row permutation, Gemma's 1 + w
    norms; an expert stack [E, rows, cols] comes as E tensors, one per expert (code blocks with ``keep_q4``, else
    float: Q8_0 experts are not kept as blocks); with ``keep_q4`` and ``keep_super_blocks`` a 2-D Q4_K weight (with
    ``keep_q6`` too a Q6_K one) comes as the file's bytes, ``Q4KBlocks`` (``Q6KBlocks``), not decoded; with
    ``keep_q8_0`` and ``keep_q8_0_bytes`` a projection's Q8_0 weight as the file's bytes, ``Q8_0Blocks``."""
    gguf = read_gguf(path)
    arch = str(gguf.metadata.get("general.architecture"))
    permuted = arch in PERMUTED_ROTARY
    code_types = code_block_types(keep_q5, keep_q6) if keep_q4 else ()
    int8_types = INT8_BLOCK_TYPES if keep_q8_0 else ()
    widened: Counter[int] = Counter()  # block-quantized weights dequantized to float although blocks were asked for
    for info in gguf.tensors.values():
        # Kept: a 2-D tensor of an int8-block or code-block type asked for, an expert stack of a code-block type.
        kept_type = code_types if len(info.shape) == 3 else int8_types + code_types if len(info.shape) == 2 else ()
        if (int8_types or code_types) and info.ggml_type not in FLOAT_TYPES + kept_type and len(info.shape) >= 2:
            widened[info.ggml_type] += 1
        name = hf_tensor_name(info.name, arch)
        if name is None:
            if info.name in (ROPE_FREQS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT):
                continue
            experts = expert_tensor_names(info.name, arch, info.shape[0] if len(info.shape) == 3 else 0)
            if experts and len(info.shape) == 3:
                yield from zip(experts, _expert_slices(path, info, code_types))
                continue
            raise ValueError(f"{path}: GGUF tensor {info.name!r} has no counterpart in kvloom's {arch} model")
        super_blocks = keep_super_blocks and info.ggml_type in (GGML_Q4_K, GGML_Q6_K) and \
            info.ggml_type in code_types and len(info.shape) == 2
        q8_0_bytes = keep_q8_0_bytes and info.ggml_type == GGML_Q8_0 and info.ggml_type in int8_types and \
            len(info.shape) == 2 and name.endswith("_proj.weight")
        if super_blocks or q8_0_bytes:  # packed from the file's pages as they are: no copy, no zeroed buffer first
            raw = mapped_tensor_bytes(path, info)
        else:
            raw = read_tensor_bytes(path, info)
        with _single_thread():
            kept: Int8Blocks | Q8_0Blocks | Q4Blocks | Q4KBlocks | Q6KBlocks | None = None
            if info.ggml_type == GGML_Q5_0 and GGML_Q5_0 in code_types and name.endswith("_proj.weight"):
                kept = q4_blocks(raw, info.ggml_type, info.shape)  # the 5-bit code-block product, not int8's
            elif q8_0_bytes:
                kept = Q8_0Blocks.from_gguf(raw, info.shape)
            elif info.ggml_type in int8_types and len(info.shape) == 2:
                kept = (q8_0_blocks if info.ggml_type == GGML_Q8_0 else q5_0_blocks)(raw, info.shape)
            elif super_blocks:
                kept = (Q4KBlocks if info.ggml_type == GGML_Q4_K else Q6KBlocks).from_gguf(raw, info.shape)
            elif info.ggml_type in code_types and len(info.shape) == 2:
                kept = q4_blocks(raw, info.ggml_type, info.shape)
            if kept is not None:
                if permuted and (".attn_q." in info.name or ".attn_k." in info.name):
                    heads = num_heads if ".attn_q." in info.name else num_kv_heads
                    kept = type(kept)(*(reverse_rotary_permute(t, heads).contiguous() for t in kept))
                yield name, kept
                continue
            weight = dequantize(raw, info.ggml_type, info.shape)
            if permuted and ".attn_q." in info.name:
                weight = reverse_rotary_permute(weight, num_heads)
            elif permuted and ".attn_k." in info.name:
                weight = reverse_rotary_permute(weight, num_kv_heads)
            elif arch in NORMS_PLUS_ONE and name.endswith("norm.weight"):
                weight = weight - 1.0  # back to HF's w (exact in fp32 for 1 + w in [0.5, 2])
            elif name.endswith("shared_expert_gate.weight"):
                weight = weight.reshape(1, -1)  # [1, H] as HF has it, whether stored 1-D or 2-D
        yield name, weight
    if widened:
        logger.info("%s: %s", os.path.basename(path), widened_notice(widened, int8_types, code_types))


def widened_notice(widened: Counter[int], int8_types: tuple[int, ...], code_types: tuple[int, ...]) -> str:
    """The one line saying which of a GGUF's block-quantized weights are dequantized to float at load (a type
    kvloom has no block product for) and which types are kept in blocks."""
    from gguf.constants import GGMLQuantizationType

    def type_name(ggml_type: int) -> str:
        try:
            return GGMLQuantizationType(ggml_type).name
        except ValueError:
            return f"type {ggml_type}"

    types = ", ".join(f"{count} {type_name(t)}" for t, count in sorted(widened.items()))
    kept = [type_name(t) for t in int8_types + code_types]
    total = sum(widened.values())
    hint = ("; Q5_1 / Q5_K stay in blocks with override_backend_config {\"gguf_5bit_blocks\": true}"
            if code_types and any(t in widened for t in Q5_TYPES) and Q5_TYPES[0] not in code_types else "")
    return (f"{total} weight{'s' if total != 1 else ''} dequantized to float at load ({types}); the types kept in "
            f"their blocks are {', '.join(kept)}{hint}")


def _expert_slices(path: str, info: GGUFTensorInfo, code_types: tuple[int, ...]) -> list[torch.Tensor | Q4Blocks]:
    """An expert stack [E, rows, cols] as E tensors [rows, cols]: a stack of one of ``code_types`` as each expert's
    code blocks (a row keeps its blocks, so the stack reads as one [E * rows, cols] weight), else
    float32."""
    experts, rows, cols = info.shape
    raw = read_tensor_bytes(path, info)
    with _single_thread():
        if info.ggml_type in code_types:
            blocks = q4_blocks(raw, info.ggml_type, (experts * rows, cols))
            return [Q4Blocks(*(t[e * rows:(e + 1) * rows] for t in blocks)) for e in range(experts)]
        return list(dequantize(raw, info.ggml_type, info.shape).unbind(0))


@contextmanager
def _single_thread() -> Iterator[None]:
    """Run torch ops on one thread: dequantization is memory-bound, and on a small, busy CPU torch's
    thread pool made it up to 10x slower (threads spinning at barriers) instead of faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def gguf_config_dict(path: str) -> dict[str, Any]:
    """An HF-style config.json dict for a GGUF of a supported architecture (llama: Llama, Mistral, SmolLM and the
    rest of llama.cpp's llama family, Mixtral; qwen2: Qwen2 / Qwen2.5; qwen3; gemma2; gemma3; phi3; qwen2moe;
    qwen3moe), from its metadata and tensor list."""
    gguf = read_gguf(path)
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)} "
                         "(Llama, Mistral, SmolLM, Mixtral and other llama-architecture models; Qwen2 / Qwen2.5; "
                         "Qwen3; Gemma 2; Gemma 3 text; Phi-3; Qwen2-MoE; Qwen3-MoE)")
    architecture, model_type = ARCHITECTURES[arch]
    if arch == "llama" and meta.get("llama.expert_count"):
        architecture, model_type = MIXTRAL

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    for required in ("embedding_length", "block_count", "feed_forward_length", "attention.head_count"):
        if key(required) is None:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{required}")
    embedding = gguf.tensors.get("token_embd.weight")
    if embedding is None:
        raise ValueError(f"{path}: GGUF file has no token_embd.weight tensor")
    num_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // num_heads
    types = {info.ggml_type for info in gguf.tensors.values()}
    dtype = None
    if types <= {GGML_F32, GGML_F16, GGML_BF16}:
        dtype = "bfloat16" if GGML_BF16 in types else "float16" if GGML_F16 in types else "float32"
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        # The embedding's row count is what the weights need; llama.vocab_size and the token list agree
        # with it in well-formed files.
        "vocab_size": embedding.shape[0],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", num_heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(gguf, arch, head_dim=int(head_dim)),
        "max_position_embeddings": int(key("context_length", 2048)),
        # llama.cpp writes output.weight only when it differs from the embedding.
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": dtype,
    }
    config.update(_family_config(gguf, arch, config))
    return config


def _family_config(gguf: GGUFFile, arch: str, base: dict[str, Any]) -> dict[str, Any]:
    """The config keys a family adds to Llama's, as llama.cpp's converter writes them and its loader reads them
    (where the converter writes nothing, the value llama.cpp's loader assumes)."""
    meta = gguf.metadata

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    out: dict[str, Any] = {}
    if key("expert_count"):  # Mixtral, Qwen2-MoE, Qwen3-MoE
        out.update(num_local_experts=int(key("expert_count")), num_experts=int(key("expert_count")),
                   num_experts_per_tok=int(key("expert_used_count", 0)),
                   moe_intermediate_size=int(key("expert_feed_forward_length") or base["intermediate_size"]),
                   shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length", 0)),
                   # llama.cpp's graphs: Mixtral and Qwen3-MoE renormalize the chosen experts' weights,
                   # Qwen2-MoE does not; a file may say so itself (expert_weights_norm).
                   norm_topk_prob=bool(key("expert_weights_norm", arch != "qwen2moe")),
                   decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "qwen2moe":  # q/k/v carry a bias, o does not
        out["attention_bias"] = "blk.0.attn_output.bias" in gguf.tensors
    if arch == "phi3":
        window = key("attention.sliding_window")
        out["sliding_window"] = int(window) if window else None  # 0: none (Phi-4)
        original = key("rope.scaling.original_context_length")
        if original:
            out["original_max_position_embeddings"] = int(original)
        if ROPE_FACTORS_LONG in gguf.tensors:
            out["rope_scaling"] = _longrope_scaling(gguf, base, int(original or base["max_position_embeddings"]))
    if arch in ("gemma2", "gemma3"):
        out.update(_gemma_config(gguf, arch, base))
    return out


def _gemma_config(gguf: GGUFFile, arch: str, base: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 / 3: GeGLU, soft-caps, windows and rotary bases. llama.cpp stores no query_pre_attn_scalar: its
    loader takes head_dim, or hidden / heads for the 27B models (46 layers in Gemma 2, 62 in Gemma 3)."""
    meta = gguf.metadata

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    layers, hidden, heads = base["num_hidden_layers"], base["hidden_size"], base["num_attention_heads"]
    is_27b = layers == (46 if arch == "gemma2" else 62)
    window = key("attention.sliding_window")
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if is_27b else base["head_dim"],
        "attn_logit_softcapping": key("attn_logit_softcapping"),
        "final_logit_softcapping": key("final_logit_softcapping"),
        "sliding_window": int(window) if window else None,
    }
    if arch == "gemma3":
        # One global layer per `pattern` (llama.cpp: 6 unless the file says; a list gives each layer's kind).
        pattern = key("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):
            sliding = [bool(p) for p in pattern]
        else:
            sliding = [bool((i + 1) % int(pattern)) for i in range(layers)]
        out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
        full: dict[str, Any] = {"rope_type": "default", "rope_theta": base["rope_theta"]}
        if base["rope_scaling"]:
            full.update(base["rope_scaling"])
        # The local layers' base: the file's, else llama.cpp's fixed 1e4 (with no scaling).
        local = {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", 10000.0))}
        out["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
        out["rope_theta"] = full["rope_theta"]
    return out


def _longrope_scaling(gguf: GGUFFile, base: dict[str, Any], original: int) -> dict[str, Any]:
    """Phi-3's LongRoPE from llama.cpp's rope_factors_long / rope_factors_short tensors (one divisor per rotary
    frequency each) and its original context; the attention factor is stored only where it is not the default
    sqrt(1 + ln(max / original) / ln(original)) that HF computes from the same two numbers."""
    factors = {}
    for label, name in (("long_factor", ROPE_FACTORS_LONG), ("short_factor", ROPE_FACTORS_SHORT)):
        info = gguf.tensors.get(name)
        if info is None:
            raise ValueError(f"{gguf.path}: a Phi-3 GGUF with {ROPE_FACTORS_LONG} needs {name} too")
        values = dequantize(read_tensor_bytes(gguf.path, info), info.ggml_type, info.shape)
        # The shortest decimal each fp32 value reads back from (1.1, not 1.100000023841858): the config's own.
        factors[label] = [float(str(np.float32(v))) for v in values.reshape(-1).tolist()]
    scaling: dict[str, Any] = {"rope_type": "longrope", **factors, "original_max_position_embeddings": original}
    stored = gguf.metadata.get("phi3.rope.scaling.attn_factor")
    ratio = base["max_position_embeddings"] / original
    default = math.sqrt(1 + math.log(ratio) / math.log(original)) if ratio > 1 else 1.0
    if stored is not None and abs(float(stored) - default) > 1e-6 * default:
        scaling["attention_factor"] = float(stored)
    return scaling


def _rope_scaling(gguf: GGUFFile, arch: str, head_dim: int) -> dict[str, Any] | None:
    meta = gguf.metadata
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor") or meta.get(f"{arch}.rope.scale_linear")
    if kind in ("linear", "yarn") and factor:
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    if kind is None and meta.get(f"{arch}.rope.scale_linear"):
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scale_linear"])}
    if ROPE_FREQS in gguf.tensors:
        return _llama3_scaling_from_rope_freqs(gguf, head_dim)
    return None


def _llama3_scaling_from_rope_freqs(gguf: GGUFFile, head_dim: int) -> dict[str, Any]:
    """Recover HF's llama3 rope_scaling from llama.cpp's rope_freqs tensor.

    llama.cpp stores the per-frequency divisors that llama3 scaling computes, not its parameters. Every
    Llama 3.1/3.2 release uses low_freq_factor 1, high_freq_factor 4 and an 8192 original context, with
    factor = the largest divisor; we take those and check they reproduce the stored divisors.
    """
    info = gguf.tensors[ROPE_FREQS]
    stored = dequantize(read_tensor_bytes(gguf.path, info), info.ggml_type, info.shape).double()
    scaling = {"rope_type": "llama3", "factor": float(stored.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    theta = float(gguf.metadata.get("llama.rope.freq_base", 10000.0))
    expected = torch.tensor(llama3_rope_divisors(theta, head_dim, scaling), dtype=torch.float64)
    if expected.shape != stored.shape or not torch.allclose(expected, stored, rtol=1e-4):
        raise ValueError(f"{gguf.path}: its rope_freqs tensor does not match Llama-3 rope scaling with the "
                         "standard parameters; this rope scaling is not supported")
    return scaling


def llama3_rope_divisors(theta: float, head_dim: int, scaling: dict[str, Any]) -> list[float]:
    """The factor each rotary frequency is divided by under llama3 rope scaling (llama.cpp's rope_freqs)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_freq_wavelen:
            divisors.append(1.0)
        elif wavelen > low_freq_wavelen:
            divisors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return divisors

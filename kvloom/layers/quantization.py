"""int8 weight storage for a whole model: quantize as the weights are read, and the state a quantized
checkpoint holds.

    weights = quantize_as_read(iter_weights(source), lm_head=False)  # linear weights become Int8Rows
    model.load_weights(weights)                                       # layers store int8 rows as given
    finish_int8(model, lm_head=False)                                 # every projection is int8, head tied

Each weight is quantized from the tensor the loader produced (fp32 for a GGUF, the stored dtype for
safetensors) before the model's own dtype ever rounds it, and the float copy is never kept, so the
first load needs no more memory than the int8 model. A GGUF Q8_0 weight read with ``keep_q8_0`` arrives
as ``Int8Blocks`` (its int8 codes and block scales, as stored) and a projection, the embedding and the head keep
them as they are: no float copy, no re-quantization (a tied head multiplies by the embedding's blocks; on a GPU,
which has no block product, the embedding and head are dequantized instead: ``keep_tables_in_blocks``). Without
``keep_q8_0`` it arrives as fp32 values equal to its codes times its block scales (exact in fp32), and is re-scaled
per row from those.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvloom.layers.embedding import LMHead, VocabEmbedding
from kvloom.layers.linear import Linear
from kvloom.loader import gguf
from kvloom.ops.int8 import Int8Blocks, Int8Rows, Q8_0Blocks
from kvloom.ops.q4 import Q4Blocks
from kvloom.ops.q4k import SUPER_BLOCK_TYPES, Q4KBlocks, Q6KBlocks

if TYPE_CHECKING:
    from kvloom.config import BackendConfig
    from kvloom.loader.weights import ModelSource

# HF names of the projections that int8 storage covers (the LM head and the embedding are an option).
LINEAR_WEIGHTS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                  "up_proj.weight", "down_proj.weight")
HEAD_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")
# Mixtral's expert projections (``...experts.<e>.w1.weight``): Qwen-MoE's share the dense names above.
EXPERT_WEIGHTS = ("w1.weight", "w2.weight", "w3.weight")
# A weight as the loader hands it over: float, or kept in the file's blocks.
Stored = torch.Tensor | Int8Blocks | Q8_0Blocks | Q4Blocks | Q4KBlocks | Q6KBlocks


def dense_projection_bytes(name: str, tensor: Stored) -> Stored:
    """A GGUF's Q8_0 bytes stay so for a dense projection, packed from them in one pass (layers/linear.py); anything
    else takes them as int8 blocks."""
    if isinstance(tensor, Q8_0Blocks) and (".experts." in name or not name.endswith(LINEAR_WEIGHTS)):
        return tensor.to_int8_blocks()
    return tensor


def quantize_as_read(weights: Iterable[tuple[str, torch.Tensor | Int8Blocks | Q8_0Blocks]], lm_head: bool
                     ) -> Iterator[tuple[str, torch.Tensor | Int8Rows | Int8Blocks | Q8_0Blocks]]:
    """The checkpoint's tensors with every projection weight (and with ``lm_head`` the embedding and the
    head) turned into int8 rows; a projection, embedding or head that arrives as int8 blocks (a kept GGUF Q8_0)
    stays as it is (a Q8_0 table's blocks are its exact values: finer than rows re-quantized from them), a dense
    projection as the file's Q8_0 bytes too."""
    for name, tensor in weights:
        tensor = dense_projection_bytes(name, tensor)
        if isinstance(tensor, Q8_0Blocks):
            yield name, tensor
            continue
        if isinstance(tensor, Int8Blocks):
            if name.endswith(LINEAR_WEIGHTS + HEAD_WEIGHTS):
                yield name, tensor
            else:
                yield name, tensor.dequantize()
        elif name.endswith(LINEAR_WEIGHTS + (HEAD_WEIGHTS if lm_head else ())) or (
                ".experts." in name and name.endswith(EXPERT_WEIGHTS) and tensor.dim() == 2):
            yield name, Int8Rows.quantize(tensor)
        else:
            yield name, tensor


def kept_as_stored(weights: Iterable[tuple[str, Stored]]) -> Iterator[tuple[str, Stored]]:
    """``quantization="gguf"``: the projections', the embedding's and the head's code blocks, k-quant super-blocks and
    Q8_0 blocks as the file stores them (a Q4_K_M file's Q6_K table: the head takes the k-quant product, a lookup
    reads rows of the same super-blocks)."""
    for name, tensor in weights:
        tensor = dense_projection_bytes(name, tensor)
        if isinstance(tensor, SUPER_BLOCK_TYPES):  # the file's super-blocks: a projection's and a table's product
            if name.endswith(LINEAR_WEIGHTS + HEAD_WEIGHTS) and ".experts." not in name:  # take them as such
                yield name, tensor
                continue
            tensor = tensor.to_blocks()  # anything else as the code blocks of 32 it always was
        keep = LINEAR_WEIGHTS + HEAD_WEIGHTS
        if ".experts." in name:  # a mixture's experts keep 4-bit blocks (layers/moe.py), not int8 ones
            keep = LINEAR_WEIGHTS + EXPERT_WEIGHTS if isinstance(tensor, Q4Blocks) else ()
        if isinstance(tensor, (Int8Blocks, Q4Blocks)) and not name.endswith(keep):
            yield name, tensor.dequantize()
        else:
            yield name, tensor


def keep_tables_in_blocks(model: nn.Module, q8_0_on_gpu: bool) -> bool:
    """After loading: the embedding and the head keep the blocks they were read in (a GGUF's Q8_0 or code blocks) on a
    CPU, a head tied to such an embedding multiplying by its blocks; returns whether the head is tied. On a GPU code
    blocks, and Q8_0 ones unless ``q8_0_on_gpu`` (as ``quantization="gguf"`` always kept them), are dequantized to
    the model's dtype, as before tables were kept in blocks: its code-block product holds no rows for the lookup (the
    table would be held twice), and it has no Q8_0 block product."""
    head = getattr(model, "lm_head", None)
    embedding = getattr(model, "embed_tokens", None)
    tied = isinstance(head, LMHead) and isinstance(embedding, VocabEmbedding) and head.weight is embedding.weight
    on_gpu = any(isinstance(m, (VocabEmbedding, LMHead)) and m.weight.device.type != "cpu" for m in (embedding, head))
    if on_gpu:
        for table in (embedding, head):
            if isinstance(table, (VocabEmbedding, LMHead)) and (table.blocks is not None or (
                    not q8_0_on_gpu and table.weight_scale is not None and table.weight_scale.dim() == 2)):
                table.dequantize()
    if tied and head.qweight is None and head.blocks is None and embedding.holds_blocks():
        head.take_table(embedding)
    return tied


def finish_gguf(model: nn.Module, requantize_lm_head: int | None = None) -> None:
    """After a ``quantization="gguf"`` (or GPTQ / AWQ) load: a head tied to an embedding in Q8_0 or code blocks
    multiplies by its blocks (keep_tables_in_blocks); with ``requantize_lm_head`` (4 or 5) the head's table, and a
    tied embedding's, becomes code blocks."""
    head = getattr(model, "lm_head", None)
    embedding = getattr(model, "embed_tokens", None)
    tied = keep_tables_in_blocks(model, q8_0_on_gpu=True)
    if requantize_lm_head is not None:
        if not isinstance(head, LMHead):
            raise ValueError(f"requantize_lm_head: {type(model).__name__} has no LM head to re-quantize")
        head.requantize(requantize_lm_head, tied_to=embedding if tied else None)


def holds_blocks(quantization: str | None, source: ModelSource, backend: BackendConfig) -> bool:
    """Whether the projections hold blocks of 32 inputs (4-bit kept, or GGUF Q8_0), which a row-parallel split
    must keep whole."""
    if quantization in ("gguf", "gptq", "awq"):
        return True
    return quantization == "int8" and keeps_q8_0_blocks(source, backend)


def finish_int8(model: nn.Module, lm_head: bool) -> None:
    """After loading: a head tied to the embedding shares its int8 table (with ``lm_head``, or a GGUF's Q8_0 blocks
    kept: keep_tables_in_blocks); a mixture's experts loaded in float are quantized; every projection must be int8
    but those marked ``keep_float`` (a mixture's routers)."""
    head = getattr(model, "lm_head", None)
    embedding = getattr(model, "embed_tokens", None)
    tied = keep_tables_in_blocks(model, q8_0_on_gpu=False)
    if lm_head and isinstance(head, LMHead) and head.qweight is None:
        head.quantize(tied_to=embedding if tied else None)
    for module in model.modules():
        if hasattr(module, "quantize_experts"):
            module.quantize_experts()
    float_layers = [name for name, module in model.named_modules() if isinstance(module, Linear)
                    and not module.quantized and not module.q8_0 and not getattr(module, "keep_float", False)]
    if float_layers:
        raise ValueError(f"int8 loading left {len(float_layers)} projection(s) in float, e.g. {float_layers[:3]}")


def int8_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a quantized checkpoint stores: each int8 layer's qweight and weight_scale ([out], or [out, in / 32]
    for a layer that holds Q8_0 blocks), and every float parameter still held (norms, biases, a float
    embedding); a tied head's table is stored once."""
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, module in model.named_modules():
        qweight = getattr(module, "qweight", None)
        if qweight is not None and qweight.data_ptr() not in seen:
            seen.add(qweight.data_ptr())
            state[f"{name}.qweight"] = qweight
            state[f"{name}.weight_scale"] = module.weight_scale
    for name, param in model.named_parameters():
        if param.numel() and param.data_ptr() not in seen:
            seen.add(param.data_ptr())
            state[name] = param.data
    return {name: tensor.contiguous() for name, tensor in state.items()}


def load_int8_state(model: nn.Module, state: dict[str, torch.Tensor], lm_head: bool) -> None:
    """Fill a freshly built model from ``int8_state``'s tensors; ValueError naming what is missing or extra."""
    remaining = dict(state)
    for name, module in model.named_modules():
        key = f"{name}.qweight"
        if key in remaining:
            qweight, scale = remaining.pop(key), remaining.pop(f"{name}.weight_scale", None)
            if scale is None:
                raise ValueError(f"quantized checkpoint has {key} but no {name}.weight_scale")
            if isinstance(module, Linear):
                module.set_int8(qweight, scale)
            elif isinstance(module, (VocabEmbedding, LMHead)):
                module.load_shard("weight", 0, Int8Rows(qweight, scale))
            else:
                raise ValueError(f"quantized checkpoint has int8 weights for {name!r}, which cannot hold them")
    for name, param in model.named_parameters():
        if name in remaining:
            tensor = remaining.pop(name)
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"quantized checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            param.data.copy_(tensor)
    if remaining:
        raise ValueError(f"quantized checkpoint has {len(remaining)} tensor(s) this model does not, "
                         f"e.g. {sorted(remaining)[:3]}")
    finish_int8(model, lm_head)


def keeps_q8_0_blocks(source: ModelSource, backend: BackendConfig) -> bool:
    """Whether an int8 load keeps the GGUF's Q8_0 projections as their int8 codes and block scales: a GGUF
    with Q8_0 projection weights, int8 activations (the blocks' product quantizes them per block) and
    ``int8_gguf_blocks`` on."""
    if source.kind != "gguf" or not backend.int8_activations or not backend.int8_gguf_blocks:
        return False
    return any(name.endswith(LINEAR_WEIGHTS) for name in gguf.q8_0_weight_names(source.path))

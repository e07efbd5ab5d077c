"""Token embedding and the LM head (which may share the embedding's weight).

With int8 weights and ``quantize_lm_head``, the embedding table is stored as int8 rows with one scale
per token (a lookup dequantizes the rows it reads) and the LM head multiplies by the same int8 table,
so a tied model keeps one int8 copy. A GGUF's Q8_0 table, kept as stored on a CPU (``quantization="gguf"``, and the
Q8_0 default ``"int8"``), holds a scale per token and block of 32 instead (``weight_scale`` [vocab, hidden / 32]); the
head then multiplies by the blocks with activations quantized per block, as llama.cpp does. A table in code blocks
(a Q4_K or Q5_K one: ``Q4Blocks``; a Q4_K or Q6_K one as the file's super-blocks, ``Q4KBlocks`` / ``Q6KBlocks``, where
the CPU's k-quant product takes them) is kept as such too (``blocks``), and the head takes the code-block product
(kvloom/ops/q4.py) or the k-quant one (kvloom/ops/q4k.py), as llama.cpp's does: at one sequence the head streams its
table once a token, so the file's 6.56 bits a weight (a Q4_K_M file's Q6_K table) instead of bf16's 16, or the 10 of
its decoded code blocks (the table of Llama-3.2-1B's Q4_K_M is 22% of its decode time in bf16). With
``requantize_lm_head`` (4 or 5) the table becomes 4- or 5-bit code blocks at load.

Once the head is packed for its product (``process_weights_after_loading``), a tied embedding reads its rows from
the head's packed weight (``share_tied_table``: the packed products' ``rows``) and the row-major table is dropped:
the table is resident once, in the head's layout, not twice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.ops import int8, q4
from kvloom.ops.int8 import Int8Blocks, Int8Rows
from kvloom.ops.q4 import Q4Blocks
from kvloom.ops.q4k import SUPER_BLOCK_TYPES, Q4KBlocks, Q6KBlocks
from kvloom.ops.table import Ops

Table = torch.Tensor | Int8Rows | Int8Blocks | Q4Blocks | Q4KBlocks | Q6KBlocks
CodeTable = Q4Blocks | Q4KBlocks | Q6KBlocks  # a table as code blocks, or as the file's k-quant super-blocks


def dequantize_rows(rows: Table, dtype: torch.dtype) -> torch.Tensor:
    """A lookup's rows [T, H] in ``dtype``: float rows as they are, int8 codes times their scale per token or block
    in ``dtype`` (as the table's own lookup always did), code blocks as ``Q4Blocks.dequantize`` (fp32) rounded to
    ``dtype``."""
    if isinstance(rows, torch.Tensor):
        return rows.to(dtype)
    if isinstance(rows, (Q4Blocks, *SUPER_BLOCK_TYPES)):
        return rows.dequantize().to(dtype)
    codes, scale = rows.qweight.to(dtype), rows.scale.to(dtype)
    if scale.dim() == 1:
        return codes * scale[:, None]
    return (codes.view(*scale.shape, int8.BLOCK) * scale[..., None]).view(codes.shape)


def int8_rows(qweight: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> Int8Rows | Int8Blocks:
    """Rows ``ids`` [T] of an int8 table: a scale per token (Int8Rows) or per token and block of 32 (Int8Blocks)."""
    return (Int8Rows if scale.dim() == 1 else Int8Blocks)(qweight[ids], scale[ids])


def check_table_shape(name: str, tensor: Int8Rows | Int8Blocks | CodeTable, expected: tuple[int, ...]) -> None:
    """ValueError unless a table read in blocks has the [vocab, hidden] shape the model was built with."""
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} weight has shape {tuple(tensor.shape)} in the checkpoint, expected {expected}")


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.num_embeddings = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.qweight: torch.Tensor | None = None  # int8 [vocab, hidden] after quantize
        self.weight_scale: torch.Tensor | None = None  # fp32 [vocab], or [vocab, hidden / 32] for Q8_0 blocks
        self.blocks: CodeTable | None = None  # a GGUF's code-block table, as read (until a tied head takes it)
        self.packed_table: object | None = None  # an untied code-block table packed, whose rows this reads
        # The tied head's packed weight, whose ``rows`` this reads instead of a table of its own (share_tied_table).
        self.table: Callable[[torch.Tensor], Table] | None = None
        self.dtype = self.weight.dtype

    def quantize(self) -> None:
        qweight, scale = int8.quantize_per_channel(self.weight.data)
        self.set_int8(qweight, scale)

    def set_int8(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        expected = tuple(self.weight.shape)
        scales = (expected[:1], (expected[0], expected[1] // int8.BLOCK))
        if qweight.dtype != torch.int8 or tuple(qweight.shape) != expected or tuple(scale.shape) not in scales:
            raise ValueError(f"int8 embedding must be int8 {expected} with scales {scales[0]} (per token) or "
                             f"{scales[1]} (per block), got {qweight.dtype} {tuple(qweight.shape)} and "
                             f"{tuple(scale.shape)}")
        self.dtype = self.weight.dtype
        device = self.weight.device  # a checkpoint's blocks are read on the CPU; the model may sit on a GPU
        self.qweight, self.weight_scale = qweight.to(device), scale.float().to(device)
        self.weight.data = self.weight.data.new_empty(0, expected[1])

    def load_shard(self, name: str, shard: int, tensor: Int8Rows | Int8Blocks | CodeTable) -> None:
        """int8 rows, Q8_0 blocks, code blocks or k-quant super-blocks read from a checkpoint (the only things the
        loader hands this way)."""
        if isinstance(tensor, (Q4Blocks, *SUPER_BLOCK_TYPES)):
            check_table_shape("embedding", tensor, tuple(self.weight.shape))
            device = self.weight.device
            self.blocks = type(tensor)(*(t.to(device) for t in tensor))
            self.dtype = self.weight.dtype
            self.read_from(self.blocks.take)
            self.weight.data = self.weight.data.new_empty(0, tensor.shape[1])
            return
        self.set_int8(tensor.qweight, tensor.scale)

    def read_from(self, table: Callable[[torch.Tensor], Table]) -> None:
        """Rows from ``table`` (the tied head's packed weight's ``rows``) instead of a table of this module's own."""
        self.table = table
        self.qweight = self.weight_scale = None

    def process_weights_after_loading(self, ops: Ops) -> None:
        """A table of its own in code blocks (an untied embedding) packed as the code-block product packs it, where its
        rows are read back (4 or 6 bits a weight beside its scales; the unpacked codes take a byte each): the product
        itself is never called. A table of the file's k-quant super-blocks (an 8B Q4_K_M's Q4_K table) is not packed
        at all: a lookup decodes its rows from the file's bytes as read (mapped: only the rows looked up become
        resident). A tied embedding's blocks are the head's by now."""
        if self.blocks is None or isinstance(self.blocks, SUPER_BLOCK_TYPES):
            return
        packed = ops.pack_linear_q4(self.blocks, None)
        if getattr(packed, "holds_rows", hasattr(packed, "rows")):
            self.packed_table = packed
            self.read_from(packed.rows)
            self.blocks = None

    def holds_blocks(self) -> bool:
        """Whether the table is a GGUF's blocks (Q8_0, or code blocks) held by this module."""
        return self.blocks is not None or (self.weight_scale is not None and self.weight_scale.dim() == 2)

    def dequantize(self) -> None:
        """The table held (int8 or code blocks) as float rows in the model's dtype again, for products that take no
        blocks (a GPU's: layers/quantization.py keep_tables_in_blocks)."""
        if self.blocks is None and self.qweight is None:
            return
        rows = torch.arange(self.blocks.shape[0] if self.blocks is not None else self.qweight.shape[0],
                            device=self.weight.device)
        table = self.blocks.take if self.blocks is not None else (
            lambda ids: int8_rows(self.qweight, self.weight_scale, ids))
        # q d exact in fp32, rounded once to the model's dtype (as a dequantized GGUF load does)
        self.weight.data = torch.cat([dequantize_rows(table(ids), torch.float32).to(self.dtype)
                                      for ids in rows.split(4096)])
        self.qweight = self.weight_scale = self.blocks = self.table = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.table is None and self.qweight is None:
            return F.embedding(input_ids, self.weight)
        ids = input_ids.reshape(-1)
        rows = self.table(ids) if self.table is not None else int8_rows(self.qweight, self.weight_scale, ids)
        return dequantize_rows(rows, self.dtype).view(*input_ids.shape, -1)


class LMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.qweight: torch.Tensor | None = None
        self.weight_scale: torch.Tensor | None = None
        self.blocks: CodeTable | None = None  # the table as code blocks or super-blocks, until packed
        self.packed: Callable[[torch.Tensor], torch.Tensor] | None = None

    def quantize(self, tied_to: VocabEmbedding | None = None) -> None:
        """int8 weights; a head tied to the embedding uses the embedding's int8 table (quantized first)."""
        if tied_to is not None:
            if tied_to.qweight is None:
                tied_to.quantize()
            self.qweight, self.weight_scale = tied_to.qweight, tied_to.weight_scale
        else:
            self.qweight, self.weight_scale = int8.quantize_per_channel(self.weight.data)
            self.weight.data = self.weight.data.new_empty(0, self.weight.shape[1])

    def load_shard(self, name: str, shard: int, tensor: Int8Rows | Int8Blocks | CodeTable) -> None:
        """int8 rows, Q8_0 blocks, code blocks or k-quant super-blocks of an untied head read from a checkpoint."""
        expected = tuple(self.weight.shape)
        check_table_shape("lm_head", tensor, expected)
        device = self.weight.device
        if isinstance(tensor, (Q4Blocks, *SUPER_BLOCK_TYPES)):
            self.blocks = type(tensor)(*(t.to(device) for t in tensor))
        else:
            self.qweight, self.weight_scale = tensor.qweight.to(device), tensor.scale.float().to(device)
        self.weight.data = self.weight.data.new_empty(0, expected[1])

    def take_table(self, embedding: VocabEmbedding) -> None:
        """A head tied to ``embedding`` multiplies by the table the embedding was loaded with (int8 rows, Q8_0 blocks
        or code blocks), and the embedding reads its rows back from this head: one copy."""
        if embedding.blocks is not None:
            self.blocks, embedding.blocks = embedding.blocks, None
            embedding.read_from(self.rows)  # until packed, then the packed weight's rows (share_tied_table)
        else:
            self.quantize(tied_to=embedding)

    def dequantize(self) -> None:
        """An untied head's blocks as float rows in the weight's dtype again (see VocabEmbedding.dequantize)."""
        if self.blocks is None and self.qweight is None:
            return
        rows = torch.arange(self.blocks.shape[0] if self.blocks is not None else self.qweight.shape[0],
                            device=self.weight.device)
        self.weight.data = torch.cat([dequantize_rows(self.rows(ids), torch.float32).to(self.weight.dtype)
                                      for ids in rows.split(4096)])
        self.qweight = self.weight_scale = self.blocks = None

    def requantize(self, bits: int, tied_to: VocabEmbedding | None = None) -> None:
        """The table (int8 rows, Q8_0 blocks or float) re-quantized to ``bits``-bit code blocks with a scale and an
        offset per 32 inputs from the values it holds (``Q4Blocks.quantize``: Q4_1's / Q5_1's min and max per block;
        a least-squares fit of d and m, llama.cpp's k-quant search, had 10% less squared error on SmolLM2's table
        and a worse perplexity, 12.14 against 12.11 at 5 bits, 12.77 against 12.51 at 4); a tied embedding takes
        the same blocks. Changes the model's values: docs/quantization.md has the perplexity it costs."""
        table = self.weight if self.qweight is None else self.qweight
        rows = torch.arange(table.shape[0] if self.blocks is None else self.blocks.shape[0], device=table.device)
        pieces = [Q4Blocks.quantize(self.float_rows(ids), bits) for ids in rows.split(4096)]  # a few MB at a time
        self.blocks = Q4Blocks(*(torch.cat(parts) for parts in zip(*pieces)))
        self.qweight = self.weight_scale = None
        if tied_to is not None:
            tied_to.read_from(self.rows)  # until packed, then the packed weight's rows (share_tied_table)
        self.weight.data = self.weight.data.new_empty(0, self.weight.shape[1])  # a tied one: the embedding's too

    def float_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [T] of the table as held before packing, in fp32."""
        if self.qweight is None and self.blocks is None:
            return self.weight.data[ids].float()
        return dequantize_rows(self.rows(ids), torch.float32)

    def rows(self, ids: torch.Tensor) -> Table:
        """Rows ``ids`` [T] of the table as held (before packing; after, the packed product's where it holds them)."""
        if self.blocks is not None:
            return self.blocks.take(ids)
        if self.qweight is None and self.packed is not None:
            return self.packed.rows(ids)
        return int8_rows(self.qweight, self.weight_scale, ids)

    def process_weights_after_loading(self, ops: Ops) -> None:
        """As Linear's, but the plain (or int8) weight stays: it may be the embedding's too."""
        if self.packed is not None:
            return
        if self.blocks is not None:
            self.packed = ops.pack_linear_q4(self.blocks, None)
            if getattr(self.packed, "holds_rows", hasattr(self.packed, "rows")):
                self.blocks = None  # the packed product holds the table (and hands back rows): not kept twice
        elif self.qweight is not None:
            pack = ops.pack_linear_int8_blocks if self.weight_scale.dim() == 2 else ops.pack_linear_int8
            self.packed = pack(self.qweight, self.weight_scale, None)
        elif ops.pack_linear is not None:
            self.packed = ops.pack_linear(self.weight.data, None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, V] in the model's dtype (the sampler upcasts what needs it)."""
        if self.packed is not None:
            return self.packed(hidden)
        if self.blocks is not None:
            return q4.q4_linear_reference(hidden, self.blocks)
        if self.qweight is not None:
            if self.weight_scale.dim() == 2:
                return int8.w8a8_blocks_linear_reference(hidden, self.qweight, self.weight_scale, None)
            return int8.int8_linear_reference(hidden, self.qweight, self.weight_scale)
        return F.linear(hidden, self.weight)


def share_tied_table(model: nn.Module) -> None:
    """After packing (registry.process_weights_after_loading): an embedding tied to a head whose packed weight can
    hand back rows (the CPU's int8, code-block and bf16 products, the code blocks' torch fallback) reads its rows
    there; neither keeps the row-major table, which would be a second copy of it (31.9 MB of SmolLM2's Q8_0 table,
    56.6 MB in bf16)."""
    embeddings = [m for m in model.modules() if isinstance(m, VocabEmbedding)]
    for head in model.modules():
        if not isinstance(head, LMHead) or not getattr(head.packed, "holds_rows", hasattr(head.packed, "rows")):
            continue
        for embedding in embeddings:
            # Tied when built (one parameter): whatever the head packed, float, int8 or code blocks, is the table
            # the embedding reads (the int8 one shared since loading, code blocks through the head's rows).
            if embedding.weight is head.weight:
                embedding.read_from(head.packed.rows)
                head.qweight = head.weight_scale = head.blocks = None
                head.weight.data = head.weight.data.new_empty(0, head.weight.shape[1])  # the embedding's too

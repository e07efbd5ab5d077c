"""A mixture of experts: a router picks each token's top-k experts and the experts' SwiGLU MLPs run as one
fused computation over the tokens grouped by expert (the op table's ``pack_experts``).

Every expert's weights live in two 3-D tensors, loaded expert by expert from the checkpoint's per-expert
tensors (the Hub's layout) or whole (transformers 5's in-memory layout):

    w13  [E, 2I, H]   expert e's gate rows [0, I), then its up rows [I, 2I)
    w2   [E, H, I]    expert e's down projection

With ``quantization="int8"`` the experts are int8 in the dense layers' per-row format: codes int8 of the same
shapes and one fp32 scale per row (w13_scale [E, 2I], w2_scale [E, H]); the routers stay float (``keep_float``:
a few rows whose rounding would move tokens between experts), as vLLM keeps them. A GGUF's 4-bit expert stacks
(``quantization="gguf"``) stay 4-bit per expert and projection: each expert's gate/up and down run the platform's
4-bit product where all their row blocks are 4-bit, the float product where any is not (dequantized then).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.layers.linear import Linear
from kvloom.ops.int8 import Int8Blocks, Int8Rows, quantize_per_channel
from kvloom.ops.native import ExpertProducts, PackedInt8Experts
from kvloom.ops.q4 import Q4Blocks
from kvloom.ops.q4k import joined_blocks
from kvloom.ops.reference import fused_experts_int8_reference, fused_experts_reference
from kvloom.ops.table import Ops

# Checkpoint names of an expert's three projections -> (w13 or w2, row block): Mixtral's w1/w3/w2 and
# Qwen-MoE's gate/up/down.
EXPERT_PARTS = {"w1": ("w13", 0), "gate_proj": ("w13", 0), "w3": ("w13", 1), "up_proj": ("w13", 1),
                "w2": ("w2", 0), "down_proj": ("w2", 0)}


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64): softmax over every expert in
    fp32, the top k kept, and with ``renormalize`` divided by their sum (softmax over the chosen)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    """The experts: (hidden [T, H], router logits [T, E]) -> [T, H]."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 ops: Ops) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        # The op table's prepared experts (process_weights_after_loading); until then the reference runs.
        self.packed: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.loaded: set[tuple[str, int, int]] = set()  # (w13 or w2, expert, row block) filled so far
        # int8 storage, created by the first int8 tensor loaded (or quantize_experts): name -> (codes, scales).
        self.int8: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.loaded_int8: set[tuple[str, int, int]] = set()  # the entries of `loaded` held in int8
        # 4-bit blocks as a GGUF stores them (quantization="gguf"): (w13 or w2, expert, row block) -> Q4Blocks.
        self.q4: dict[tuple[str, int, int], Q4Blocks] = {}

    def load_expert(self, expert: int, part: str, tensor: torch.Tensor | Int8Rows | Int8Blocks | Q4Blocks) -> None:
        """One expert's projection (``part``: a key of EXPERT_PARTS) from the checkpoint's [rows, cols] tensor;
        int8 rows (quantized as read) go to the int8 storage, 4-bit blocks (a GGUF's, kept) to the 4-bit one."""
        if part not in EXPERT_PARTS or not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint expert tensor {expert}.{part} has no place in a mixture of "
                             f"{self.num_experts} experts with parts {sorted(EXPERT_PARTS)}")
        if isinstance(tensor, Int8Blocks):
            tensor = tensor.to_rows()  # one kind of scale for every expert: per row
        name, block = EXPERT_PARTS[part]
        size = self.intermediate_size if name == "w13" else self.w2.shape[1]
        rows = slice(block * size, (block + 1) * size)
        target = getattr(self, name).data[expert, rows]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"checkpoint expert {expert} {part} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(target.shape)}")
        entry = (name, expert, block)
        self.q4.pop(entry, None)
        self.loaded_int8.discard(entry)
        if isinstance(tensor, Q4Blocks):
            self.q4[entry] = tensor
        elif isinstance(tensor, Int8Rows):
            codes, scales = self._int8_storage()[name]
            codes[expert, rows].copy_(tensor.qweight)
            scales[expert, rows].copy_(tensor.scale)
            self.loaded_int8.add(entry)
        else:
            target.copy_(tensor)
        self.loaded.add(entry)

    def load_stacked(self, name: str, tensor: torch.Tensor) -> None:
        """Every expert at once: ``gate_up_proj`` [E, 2I, H] or ``down_proj`` [E, H, I] (transformers 5)."""
        ours = {"gate_up_proj": "w13", "down_proj": "w2"}[name]
        param = getattr(self, ours)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"checkpoint experts.{name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        param.data.copy_(tensor)
        entries = {(ours, e, b) for e in range(self.num_experts) for b in ((0, 1) if ours == "w13" else (0,))}
        self.loaded.update(entries)
        self.loaded_int8.difference_update(entries)
        for entry in entries:
            self.q4.pop(entry, None)

    def _int8_storage(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if self.int8 is None:
            device = self.w13.device
            self.int8 = {name: (torch.zeros(getattr(self, name).shape, dtype=torch.int8, device=device),
                                torch.ones(getattr(self, name).shape[:2], dtype=torch.float32, device=device))
                         for name in ("w13", "w2")}
        return self.int8

    def quantize_experts(self) -> None:
        """int8 experts (quantization="int8"): every expert tensor loaded in float (Mixtral's w1 / w3 / w2 or a
        stacked layout, which quantization as read does not name) quantized per row, as the dense layers' are;
        the float stacks are then released."""
        self._q4_to_float(set(self.q4))
        storage = self._int8_storage()
        for name, expert, block in sorted(self.loaded - self.loaded_int8):
            size = self.intermediate_size if name == "w13" else self.w2.shape[1]
            rows = slice(block * size, (block + 1) * size)
            codes, scales = storage[name]
            codes[expert, rows], scales[expert, rows] = quantize_per_channel(getattr(self, name).data[expert, rows])
            self.loaded_int8.add((name, expert, block))
        self.w13.data = self.w13.data.new_empty(0, *self.w13.shape[1:])
        self.w2.data = self.w2.data.new_empty(0, *self.w2.shape[1:])

    def missing(self) -> list[str]:
        """The expert tensors not loaded yet, as (w13 or w2)[expert][row block]."""
        wanted = [("w13", e, b) for e in range(self.num_experts) for b in (0, 1)]
        wanted += [("w2", e, 0) for e in range(self.num_experts)]
        return [f"{name}[{e}][{b}]" for name, e, b in wanted if (name, e, b) not in self.loaded]

    def process_weights_after_loading(self, ops: Ops) -> None:
        """Hand the final stacks to the op table's ``pack_experts`` once (int8 ones, each expert's product packed
        by ``pack_linear_int8``); the stacks are then released here (the prepared experts hold what they need)."""
        if self.packed is not None:
            return
        if self.int8 is not None:
            if self.loaded != self.loaded_int8:
                self.quantize_experts()
            (w13, w13_scale), (w2, w2_scale) = self.int8["w13"], self.int8["w2"]
            self.packed = PackedInt8Experts(w13, w13_scale, w2, w2_scale, ops.pack_linear_int8)
            self.int8 = None
            return
        if self.q4:
            self.packed = self._pack_q4(ops)
        else:
            self.packed = ops.pack_experts(self.w13.data, self.w2.data)
        self.w13.data = self.w13.data.new_empty(0, *self.w13.shape[1:])
        self.w2.data = self.w2.data.new_empty(0, *self.w2.shape[1:])

    def _q4_to_float(self, entries: set[tuple[str, int, int]]) -> None:
        """Dequantize these 4-bit entries into the float stacks (exact in fp32)."""
        for name, expert, block in entries:
            size = self.intermediate_size if name == "w13" else self.w2.shape[1]
            getattr(self, name).data[expert, block * size:(block + 1) * size].copy_(self.q4.pop((name, expert, block))
                                                                                  .dequantize())

    def _pack_q4(self, ops: Ops) -> ExpertProducts:
        """Each expert's gate/up ([gate | up] rows) and down as the platform's 4-bit product where all its row
        blocks are 4-bit, else (a file mixing types, as Q4_K_M's Q6_K downs do) as the float product."""
        parts = {"w13": (0, 1), "w2": (0,)}
        for name, blocks in parts.items():
            for e in range(self.num_experts):
                entries = {(name, e, b) for b in blocks}
                if not entries <= set(self.q4):
                    self._q4_to_float(entries & set(self.q4))

        def product(name: str, e: int) -> Callable[[torch.Tensor], torch.Tensor]:
            kept = [self.q4.get((name, e, b)) for b in parts[name]]
            if all(k is not None for k in kept):  # Q6_K rows (scales per 16) may stand beside blocks of 32
                return ops.pack_linear_q4(joined_blocks(kept), None)
            weight = getattr(self, name).data[e].clone()
            return ops.pack_linear(weight, None) if ops.pack_linear is not None else lambda x: F.linear(x, weight)

        packed = ExpertProducts([product("w13", e) for e in range(self.num_experts)],
                                [product("w2", e) for e in range(self.num_experts)])
        self.q4 = {}
        self.w13.data = self.w13.data.new_empty(0, *self.w13.shape[1:])
        self.w2.data = self.w2.data.new_empty(0, *self.w2.shape[1:])
        return packed

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route(router_logits, self.top_k, self.renormalize)
        if self.packed is not None:
            return self.packed(hidden, weights, ids)
        if self.q4:  # not packed yet: the reference on the 4-bit weights' exact values
            self._q4_to_float(set(self.q4))
        if self.int8 is not None:
            (w13, w13_scale), (w2, w2_scale) = self.int8["w13"], self.int8["w2"]
            return fused_experts_int8_reference(hidden, w13, w13_scale, w2, w2_scale, weights, ids)
        return fused_experts_reference(hidden, self.w13, self.w2, weights, ids)


class SparseMoeBlock(nn.Module):
    """A router (``gate``: hidden -> one logit per expert, no bias) and its experts: hidden [T, H] -> [T, H]."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 ops: Ops) -> None:
        super().__init__()
        self.gate = Linear(hidden_size, [num_experts])
        self.gate.keep_float = True  # int8 leaves the router float (layers/quantization.py finish_int8)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize, ops)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


_EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")
_STACKED_NAME = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def load_experts_as_read(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """Hand each expert tensor (``...mlp.experts.<e>.<part>.weight``, or transformers 5's stacked
    ``...mlp.experts.gate_up_proj`` / ``down_proj``) to its FusedMoE; yield every other tensor."""
    for hf_name, tensor in weights:
        name = hf_name.removeprefix("model.")
        if match := _EXPERT_NAME.match(name):
            model.get_submodule(match[1]).load_expert(int(match[2]), match[3], tensor)
        elif match := _STACKED_NAME.match(name):
            model.get_submodule(match[1]).load_stacked(match[2], tensor)
        else:
            yield hf_name, tensor

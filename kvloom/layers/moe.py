"""A mixture of experts: a router picks each token's top-k experts and the experts' SwiGLU MLPs run as one
fused computation over the tokens grouped by expert (the op table's ``pack_experts``).

Every expert's weights live in two 3-D tensors, loaded expert by expert from the checkpoint's per-expert
tensors (the Hub's layout) or whole (transformers 5's in-memory layout):

    w13  [E, 2I, H]   expert e's gate rows [0, I), then its up rows [I, 2I)
    w2   [E, H, I]    expert e's down projection
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from kvloom.layers.linear import Linear
from kvloom.ops.int8 import Int8Blocks, Int8Rows
from kvloom.ops.reference import fused_experts_reference
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

    def load_expert(self, expert: int, part: str, tensor: torch.Tensor | Int8Rows | Int8Blocks) -> None:
        """One expert's projection (``part``: a key of EXPERT_PARTS) from the checkpoint's [rows, cols] tensor."""
        if isinstance(tensor, (Int8Rows, Int8Blocks)):
            raise ValueError("int8 expert weights are not supported; load mixture-of-experts models without "
                             "quantization")
        if part not in EXPERT_PARTS or not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint expert tensor {expert}.{part} has no place in a mixture of "
                             f"{self.num_experts} experts with parts {sorted(EXPERT_PARTS)}")
        name, block = EXPERT_PARTS[part]
        size = self.intermediate_size if name == "w13" else self.w2.shape[1]
        target = getattr(self, name).data[expert, block * size:(block + 1) * size]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"checkpoint expert {expert} {part} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(target.shape)}")
        target.copy_(tensor)
        self.loaded.add((name, expert, block))

    def load_stacked(self, name: str, tensor: torch.Tensor) -> None:
        """Every expert at once: ``gate_up_proj`` [E, 2I, H] or ``down_proj`` [E, H, I] (transformers 5)."""
        ours = {"gate_up_proj": "w13", "down_proj": "w2"}[name]
        param = getattr(self, ours)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"checkpoint experts.{name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        param.data.copy_(tensor)
        self.loaded.update((ours, e, b) for e in range(self.num_experts) for b in ((0, 1) if ours == "w13" else (0,)))

    def missing(self) -> list[str]:
        """The expert tensors not loaded yet, as (w13 or w2)[expert][row block]."""
        wanted = [("w13", e, b) for e in range(self.num_experts) for b in (0, 1)]
        wanted += [("w2", e, 0) for e in range(self.num_experts)]
        return [f"{name}[{e}][{b}]" for name, e, b in wanted if (name, e, b) not in self.loaded]

    def process_weights_after_loading(self, ops: Ops) -> None:
        """Hand the final stacks to the op table's ``pack_experts`` once; the stacks are then released here
        (the prepared experts hold what they need)."""
        if self.packed is not None:
            return
        self.packed = ops.pack_experts(self.w13.data, self.w2.data)
        self.w13.data = self.w13.data.new_empty(0, *self.w13.shape[1:])
        self.w2.data = self.w2.data.new_empty(0, *self.w2.shape[1:])

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route(router_logits, self.top_k, self.renormalize)
        if self.packed is None:
            return fused_experts_reference(hidden, self.w13, self.w2, weights, ids)
        return self.packed(hidden, weights, ids)


class SparseMoeBlock(nn.Module):
    """A router (``gate``: hidden -> one logit per expert, no bias) and its experts: hidden [T, H] -> [T, H]."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 ops: Ops) -> None:
        super().__init__()
        self.gate = Linear(hidden_size, [num_experts])
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

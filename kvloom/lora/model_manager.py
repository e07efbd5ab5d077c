"""The runner's side of LoRA: compute slots on the device, a host cache, and the per-layer delta.

Every target projection (each decoder layer's qkv_proj, o_proj, gate_up_proj, down_proj) gets a forward
hook that adds the step's LoRA delta to its output (kvloom/ops/lora.py: shrink then expand, each token by
its own adapter; csrc/lora.cpp on the CPU with kvloom's C++ ops, Triton on CUDA, torch's grouped GEMMs
elsewhere). Its slot tensors hold up to ``max_loras`` adapters at once:

    lora_a [max_loras, shards * max_lora_rank, in]    shard j's A in rows j*max_lora_rank onwards
    lora_b [max_loras, out, shards * max_lora_rank]   shard j's B (scaled) in its output rows, columns j*...

so a fused projection (q|k|v, gate|up) is one shrink and one expand, its B block-diagonal; ranks below
``max_lora_rank`` and targets an adapter lacks are zeros. Adapters come from disk into an LRU host cache of
``max_cpu_loras``; a step's adapters are copied into slots (the least recently used slot not needed by this
step is overwritten). The scheduler never schedules more distinct adapters in a step than there are slots.

The C++ layer stack (csrc/decoder.cpp) runs every decoder layer in one call with no Python between the
projections, so no hook can run there: a step with adapter tokens runs the layers module by module (the
per-op path, where the hooks add the deltas); a step of base requests alone keeps the layer stack.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from kvloom.lora.peft import ModelShape, check_adapter
from kvloom.lora.request import LoRARequest
from kvloom.lora.weights import LoRAWeights, load_lora_weights
from kvloom.ops.lora import LoRAGroups, add_lora_cpu, add_lora_grouped, cpu_lora_available, lora_compute_dtype

logger = logging.getLogger("kvloom")

# Our fused projection -> (its parent in a decoder layer, the PEFT modules of its row blocks, in order).
FUSED_TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}


@dataclass
class _Target:
    layer: int
    modules: tuple[str, ...]     # PEFT names of the row blocks
    output_sizes: list[int]
    lora_a: torch.Tensor         # [S, shards * R, in]
    lora_b: torch.Tensor         # [S, out, shards * R]


@dataclass
class _Step:
    groups: LoRAGroups           # the CPU path's tokens by slot
    token_slots: torch.Tensor    # [T] int64, -1: the base (the Triton path's)


class LoRAModelManager:
    def __init__(self, model: nn.Module, shape: ModelShape, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, device: torch.device, dtype: torch.dtype, ops_name: str = "native") -> None:
        """``ops_name``: the op table's; "cpu" (kvloom's C++ library) takes csrc/lora.cpp's fused delta."""
        self.model = model
        self.shape = shape
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.device = device
        self.dtype = dtype
        self.use_triton = device.type == "cuda"
        self.use_cpu_kernel = device.type == "cpu" and ops_name == "cpu" and cpu_lora_available()
        slot_dtype = lora_compute_dtype(device, dtype)
        self.targets: list[_Target] = []
        for index, layer in enumerate(model.layers):
            for name, (parent, modules) in FUSED_TARGETS.items():
                linear = getattr(getattr(layer, parent), name, None)
                if linear is None:
                    continue
                rank = len(modules) * max_lora_rank
                out = sum(linear.output_sizes)
                target = _Target(index, modules, list(linear.output_sizes),
                                 torch.zeros(max_loras, rank, linear.in_features, dtype=slot_dtype, device=device),
                                 torch.zeros(max_loras, out, rank, dtype=slot_dtype, device=device))
                self.targets.append(target)
                linear.register_forward_hook(self._hook(target))
        # The adapter in each slot, as (id, path): an id given again to another directory is another adapter.
        self.slots: list[tuple[int, str] | None] = [None] * max_loras
        self.slot_use: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))  # LRU first
        self.host: OrderedDict[int, LoRAWeights] = OrderedDict()  # adapter id -> weights, LRU first
        self.requests: dict[str, LoRARequest] = {}   # request id -> its adapter
        self.step: _Step | None = None
        self.load_seconds: dict[int, float] = {}

    # ---- requests ----------------------------------------------------------------------------------------
    def add_request(self, request_id: str, lora_request: LoRARequest | None) -> None:
        if lora_request is not None:
            self.requests[request_id] = lora_request

    def release_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def any_adapter(self, request_ids: list[str]) -> bool:
        return any(request_id in self.requests for request_id in request_ids)

    # ---- host cache and slots ----------------------------------------------------------------------------
    def host_weights(self, lora_request: LoRARequest) -> LoRAWeights:
        """The adapter's host copy: from the LRU cache, else read from disk (the least recent one dropped)."""
        key = lora_request.lora_int_id
        weights = self.host.get(key)
        if weights is not None and weights.info.path == lora_request.lora_path:
            self.host.move_to_end(key)
            return weights
        start = time.perf_counter()
        weights = load_lora_weights(check_adapter(lora_request.lora_path, self.shape, self.max_lora_rank),
                                    self.targets[0].lora_a.dtype)
        self.load_seconds[key] = time.perf_counter() - start
        self.host[key] = weights
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return weights

    def _slot_for(self, lora_request: LoRARequest, needed: set[tuple[int, str]]) -> int:
        key = (lora_request.lora_int_id, lora_request.lora_path)
        if key in self.slots:
            slot = self.slots.index(key)
        else:
            free = [s for s in self.slot_use if self.slots[s] is None or self.slots[s] not in needed]
            if not free:
                raise RuntimeError(f"a step holds more than max_loras={self.max_loras} adapters; the scheduler "
                                   f"admits at most that many")
            slot = free[0]
            self._fill(slot, self.host_weights(lora_request))
            self.slots[slot] = key
        self.slot_use.move_to_end(slot)
        return slot

    def _fill(self, slot: int, weights: LoRAWeights) -> None:
        rank, r = weights.info.rank, self.max_lora_rank
        for target in self.targets:
            target.lora_a[slot].zero_()
            target.lora_b[slot].zero_()
            start = 0
            for j, (module, size) in enumerate(zip(target.modules, target.output_sizes)):
                pair = weights.pairs.get((target.layer, module))
                if pair is not None:
                    a, b = pair
                    target.lora_a[slot, j * r:j * r + rank].copy_(a)
                    target.lora_b[slot, start:start + size, j * r:j * r + rank].copy_(b)
                start += size

    # ---- the step ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def activate(self, request_ids: list[str], query_start_loc: list[int], num_tokens: int) -> Iterator[None]:
        """For one forward: request i's tokens are rows query_start_loc[i]:query_start_loc[i + 1] of the
        [num_tokens] batch (rows past the last request are padding, run as the base)."""
        adapters = [self.requests.get(request_id) for request_id in request_ids]
        if not any(adapters):
            yield
            return
        needed = {(a.lora_int_id, a.lora_path) for a in adapters if a is not None}
        token_slots = [-1] * num_tokens
        for i, adapter in enumerate(adapters):
            if adapter is not None:
                slot = self._slot_for(adapter, needed)
                token_slots[query_start_loc[i]:query_start_loc[i + 1]] = [slot] * (
                    query_start_loc[i + 1] - query_start_loc[i])
        self.step = _Step(LoRAGroups.from_token_slots(token_slots, self.device),
                          torch.tensor(token_slots, dtype=torch.long, device=self.device))
        model = self.model
        layer_stack = getattr(model, "layer_stack", None)
        model.layer_stack = None  # the per-op path, where the hooks run
        try:
            yield
        finally:
            self.step = None
            model.layer_stack = layer_stack

    def _hook(self, target: _Target):  # noqa: ANN202 (torch's hook signature)
        def add_delta(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            step = self.step
            if step is None:
                return
            x = args[0]
            if self.use_triton:
                from kvloom.ops.triton.lora import add_lora_triton

                add_lora_triton(output, x, target.lora_a, target.lora_b, step.token_slots)
            elif self.use_cpu_kernel and x.is_contiguous() and output.is_contiguous():
                add_lora_cpu(output, x, target.lora_a, target.lora_b, step.token_slots)
            else:
                add_lora_grouped(output, x, target.lora_a, target.lora_b, step.groups)

        return add_delta

    @property
    def slot_bytes(self) -> int:
        """Device memory of one compute slot (every target's A and B)."""
        return sum((t.lora_a[0].numel() + t.lora_b[0].numel()) * t.lora_a.element_size() for t in self.targets)

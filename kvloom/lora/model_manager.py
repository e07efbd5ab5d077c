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

On the CPU with kvloom's C++ ops B is kept transposed, ``lora_b [max_loras, shards * max_lora_rank, out]``
(csrc/lora.h: the expand adds whole rows), and the model's C++ layer stack (csrc/decoder.cpp, every decoder
layer in one call, where no hook can run) holds the slots too (``set_lora``): a step with adapter tokens passes
each token's slot to the stack, which adds the deltas after each projection with the same kernel the hooks
call. Where there is no stack, the layers run module by module and the hooks add the deltas.

Loading: an adapter is read from disk on a loader thread (``prefetch``, started by the engine when a request
names it); the engine holds the request back until its future is done, so the steps of the other requests
go on meanwhile. A step that needs an adapter not in host memory (dropped from the LRU since) reads it then.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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
    lora_b: torch.Tensor         # [S, out, shards * R]; transposed, [S, shards * R, out], for the C++ kernel
    out_offsets: list[int]       # each shard's first output, then out


@dataclass
class _Step:
    groups: LoRAGroups | None    # the grouped torch path's tokens by slot (None: another path runs)
    token_slots: torch.Tensor    # [T] int64, -1: the base (the C++ and Triton paths')


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
        slot_dtype = lora_compute_dtype(device, dtype, self.use_cpu_kernel)
        self.b_transposed = self.use_cpu_kernel  # csrc/lora.h's layout
        self.targets: list[_Target] = []
        for index, layer in enumerate(model.layers):
            for name, (parent, modules) in FUSED_TARGETS.items():
                linear = getattr(getattr(layer, parent), name, None)
                if linear is None:
                    continue
                rank = len(modules) * max_lora_rank
                out = sum(linear.output_sizes)
                b_shape = (max_loras, rank, out) if self.b_transposed else (max_loras, out, rank)
                target = _Target(index, modules, list(linear.output_sizes),
                                 torch.zeros(max_loras, rank, linear.in_features, dtype=slot_dtype, device=device),
                                 torch.zeros(*b_shape, dtype=slot_dtype, device=device),
                                 list(itertools.accumulate(linear.output_sizes, initial=0)))
                self.targets.append(target)
                linear.register_forward_hook(self._hook(target))
        # The adapter in each slot, as (id, path): an id given again to another directory is another adapter.
        self.slots: list[tuple[int, str] | None] = [None] * max_loras
        self.slot_use: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))  # LRU first
        self.host: OrderedDict[int, LoRAWeights] = OrderedDict()  # adapter id -> weights, LRU first
        self.requests: dict[str, LoRARequest] = {}   # request id -> its adapter
        self.step: _Step | None = None
        self.load_seconds: dict[int, float] = {}
        # The loader thread's work: (id, path) -> the future of its host copy. The lock guards self.host,
        # which the loader thread fills while the engine's thread reads it.
        self._lock = threading.Lock()
        self._loads: dict[tuple[int, str], Future[LoRAWeights]] = {}
        self._loader: ThreadPoolExecutor | None = None
        # The model's C++ layer stack, when it takes the slots: adapter steps then stay on it.
        self.layer_stack = self._attach_layer_stack()

    def _attach_layer_stack(self) -> object | None:
        stack = getattr(self.model, "layer_stack", None)
        layers = len(self.model.layers)
        if (stack is None or not hasattr(stack, "set_lora") or not self.use_cpu_kernel
                or [t.layer for t in self.targets] != [i for i in range(layers) for _ in FUSED_TARGETS]):
            return None
        stack.set_lora([t.lora_a for t in self.targets], [t.lora_b for t in self.targets], self.max_lora_rank)
        return stack

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
    def prefetch(self, lora_request: LoRARequest) -> Future[LoRAWeights]:
        """The adapter's host copy as a future: done at once when cached, else read on the loader thread (one
        read per adapter however many requests ask). A read that fails holds its ValueError."""
        key = (lora_request.lora_int_id, lora_request.lora_path)
        with self._lock:
            weights = self.host.get(key[0])
            if weights is not None and weights.info.path == key[1]:
                self.host.move_to_end(key[0])
                done: Future[LoRAWeights] = Future()
                done.set_result(weights)
                return done
            future = self._loads.get(key)
            if future is None:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvloom-lora-load")
                future = self._loader.submit(self._load, lora_request)
                self._loads[key] = future
            return future

    def _load(self, lora_request: LoRARequest) -> LoRAWeights:
        """On the loader thread: checks and tensors from disk into the host cache (the least recent dropped)."""
        key = (lora_request.lora_int_id, lora_request.lora_path)
        try:
            start = time.perf_counter()
            weights = load_lora_weights(check_adapter(lora_request.lora_path, self.shape, self.max_lora_rank),
                                        self.targets[0].lora_a.dtype)
            with self._lock:
                self.load_seconds[key[0]] = time.perf_counter() - start
                self.host[key[0]] = weights
                self.host.move_to_end(key[0])
                while len(self.host) > self.max_cpu_loras:
                    self.host.popitem(last=False)
            return weights
        finally:
            with self._lock:
                self._loads.pop(key, None)

    def host_weights(self, lora_request: LoRARequest) -> LoRAWeights:
        """The adapter's host copy for this step: cached, or waited for (read now when no load is under way)."""
        return self.prefetch(lora_request).result()

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
                    if self.b_transposed:
                        target.lora_b[slot, j * r:j * r + rank, start:start + size].copy_(b.t())
                    else:
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
        grouped = not (self.use_triton or self.use_cpu_kernel)
        self.step = _Step(LoRAGroups.from_token_slots(token_slots, self.device) if grouped else None,
                          torch.tensor(token_slots, dtype=torch.long, device=self.device))
        model = self.model
        layer_stack = getattr(model, "layer_stack", None)
        if layer_stack is not None and layer_stack is self.layer_stack:
            layer_stack.lora_token_slots = self.step.token_slots  # the stack adds the deltas itself
        else:
            model.layer_stack = None  # the per-op path, where the hooks run
        try:
            yield
        finally:
            self.step = None
            model.layer_stack = layer_stack
            if self.layer_stack is not None:
                self.layer_stack.lora_token_slots = None

    def _hook(self, target: _Target):  # noqa: ANN202 (torch's hook signature)
        def add_delta(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            step = self.step
            if step is None:
                return
            x = args[0]
            if self.use_triton:
                from kvloom.ops.triton.lora import add_lora_triton

                add_lora_triton(output, x, target.lora_a, target.lora_b, step.token_slots)
            elif self.use_cpu_kernel and output.is_contiguous():
                add_lora_cpu(output.view(-1, output.shape[-1]), x.reshape(-1, x.shape[-1]).contiguous(),
                             target.lora_a, target.lora_b, step.token_slots, target.out_offsets)
            else:
                groups = step.groups or LoRAGroups.from_token_slots(step.token_slots.tolist(), self.device)
                lora_b = target.lora_b.transpose(1, 2) if self.b_transposed else target.lora_b
                add_lora_grouped(output, x, target.lora_a, lora_b, groups)

        return add_delta

    @property
    def slot_bytes(self) -> int:
        """Device memory of one compute slot (every target's A and B)."""
        return sum((t.lora_a[0].numel() + t.lora_b[0].numel()) * t.lora_a.element_size() for t in self.targets)

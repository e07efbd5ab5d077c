"""SmoothQuant smoothing for W8A8 int8 (Xiao et al. 2023): move the activations' outlier channels into
the weights before both are quantized, folded into the previous op so nothing extra runs per step.

A linear layer y = X W^T reads the same result from X' = X / s and W' = W * s (s [K], one factor per
input channel j), and with

    s_j = max|X_j| ^ alpha / max|W_:,j| ^ (1 - alpha)

the per-token int8 activations of X' lose less to a few large channels, while the per-row int8 weights
of W' take part of that range instead. The division of X is folded into the op that makes X:

- q/k/v (one fused input): input_layernorm's weight (one s shared by q, k and v);
- gate/up (one fused input): post_attention_layernorm's weight;
- down (input silu(gate) * up, linear in up): up_proj's rows (and bias);
- o (input: the attention output, linear in v): v_proj's rows (and bias). With grouped-query attention
  o's input channel (q head h, dim d) comes from kv head h // group, so s is one value per (kv head, d),
  computed from the maxima over the q heads of the group.

The activation maxima come from the model itself, in its own dtype, over ``calibration_text`` (Python's
pydoc topics from the middle of the list on: the perplexity text of ``kvloom/bench/int8_quality.py`` is
its first topics). Every rescaling is done on the checkpoint's tensors in fp32 as they are read a second
time, before their per-row int8 quantization (``smooth_as_read``): exact algebra up to fp32 rounding.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvloom.layers.linear import Linear
from kvloom.ops.metadata import whole_prefill

if TYPE_CHECKING:
    from kvloom.config import BackendConfig

# What the factors depend on besides alpha and the model (part of a quantized checkpoint's fingerprint).
CALIBRATION_TOKENS = 2048
CALIBRATION_WINDOW = 512
CALIBRATION_ID = f"pydoc_data topics from the middle, {CALIBRATION_TOKENS} tokens in windows of {CALIBRATION_WINDOW}"

# kvloom's module names of the layers smoothed, by what they read.
_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_HF_NAME = re.compile(r"layers\.(\d+)\.(input_layernorm|post_attention_layernorm|self_attn\.[qkvo]_proj|"
                      r"mlp\.(?:gate|up|down)_proj)\.(weight|bias)$")


@dataclass
class LayerSmoothing:
    """One decoder layer's factors (fp32)."""

    qkv: torch.Tensor  # [hidden]: divides input_layernorm, multiplies q/k/v columns
    gate_up: torch.Tensor  # [hidden]: divides post_attention_layernorm, multiplies gate/up columns
    o: torch.Tensor  # [num_kv_heads * head_dim]: divides v_proj rows, multiplies o_proj columns (per q head)
    down: torch.Tensor  # [intermediate]: divides up_proj rows, multiplies down_proj columns


def smoothing_alpha(backend: BackendConfig, device: torch.device) -> float | None:
    """The alpha the int8 weights are smoothed with: only where int8 activations are quantized (W8A8 is a
    CPU product; elsewhere int8 products are weight-only, which smoothing cannot help)."""
    if not backend.int8_activations or device.type != "cpu":
        return None
    return backend.int8_smoothing_alpha


def calibration_text() -> str:
    """Python's pydoc topics from the middle of the sorted list on (the evaluation text starts at the first)."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    return "\n\n".join(topics[key] for key in keys[len(keys) // 2:])


def calibration_windows(token_ids: list[int], max_positions: int) -> list[list[int]]:
    """The first CALIBRATION_TOKENS ids in windows the model's context holds."""
    window = min(CALIBRATION_WINDOW, max_positions)
    ids = token_ids[:CALIBRATION_TOKENS]
    return [ids[i:i + window] for i in range(0, len(ids), window)]


@torch.inference_mode()
def activation_maxima(model: nn.Module, windows: list[list[int]]) -> dict[str, torch.Tensor]:
    """max |x| per input channel (fp32 [K]) of each smoothed projection's input, over every token of the
    windows, each window one prefill of the (float, unpacked) model; keyed by module name."""
    linears = {name: module for name, module in model.named_modules()
               if isinstance(module, Linear) and name.endswith(_PROJECTIONS)}
    if len(linears) != 4 * len(getattr(model, "layers", ())) or not linears:
        raise ValueError("int8 smoothing supports Llama-style decoder layers (qkv_proj, o_proj, gate_up_proj, "
                         f"down_proj); {type(model).__name__} has {sorted(linears)[:4]}")
    maxima: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            amax = args[0].detach().abs().amax(dim=0).float()  # x: [T, K] -> [K]
            maxima[name] = amax if name not in maxima else torch.maximum(maxima[name], amax)
        return hook

    handles = [module.register_forward_pre_hook(record(name)) for name, module in linears.items()]
    try:
        for window in windows:
            _prefill(model, window)
    finally:
        for handle in handles:
            handle.remove()
    return {name: maxima[name].cpu() for name in linears}


def _prefill(model: nn.Module, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """One sequence through the model as a single prefill into a scratch KV cache ([T, H] hidden states)."""
    config = model.config
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    metadata, positions, num_blocks = whole_prefill([len(token_ids)], block_size, config.sliding_window, device)
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    kv_caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                 for _ in range(config.num_hidden_layers)]
    return model(torch.tensor(token_ids, device=device), positions, kv_caches, metadata)


def weight_maxima(linear: Linear) -> torch.Tensor:
    """max |W[:, j]| over every row of a (fused) float weight: fp32 [K]."""
    return linear.weight.detach().abs().amax(dim=0).float().cpu()


def factors(activation: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = a^alpha / w^(1 - alpha), 1 where a channel never fired or has no weight (nothing to move)."""
    s = activation.pow(alpha) / weight.pow(1 - alpha)
    return torch.where((activation > 0) & (weight > 0) & torch.isfinite(s), s, torch.ones_like(s))


def smoothing_factors(model: nn.Module, maxima: dict[str, torch.Tensor], alpha: float) -> list[LayerSmoothing]:
    """Each layer's factors from the activation maxima and the model's (still float) weights."""
    config = model.config
    kv_heads, head_dim = config.num_key_value_heads, config.head_dim
    group = config.num_attention_heads // kv_heads
    result = []
    for index, layer in enumerate(model.layers):
        act = {name: maxima[f"layers.{index}.{name}"] for name in _PROJECTIONS}
        attn, mlp = layer.self_attn, layer.mlp
        # o_proj's input [num_heads * head_dim] as [kv_heads, group, head_dim]: one factor per (kv head, d).
        o_act, o_weight = (t.view(kv_heads, group, head_dim).amax(dim=1).reshape(-1)
                           for t in (act["self_attn.o_proj"], weight_maxima(attn.o_proj)))
        result.append(LayerSmoothing(
            qkv=factors(act["self_attn.qkv_proj"], weight_maxima(attn.qkv_proj), alpha),
            gate_up=factors(act["mlp.gate_up_proj"], weight_maxima(mlp.gate_up_proj), alpha),
            o=factors(o_act, o_weight, alpha),
            down=factors(act["mlp.down_proj"], weight_maxima(mlp.down_proj), alpha)))
    return result


def calibrate(model: nn.Module, token_ids: list[int], alpha: float) -> list[LayerSmoothing]:
    """The factors of a model loaded in float (not yet quantized nor packed), from ``token_ids`` of the
    calibration text."""
    windows = calibration_windows(token_ids, model.config.max_position_embeddings)
    return smoothing_factors(model, activation_maxima(model, windows), alpha)


def smooth_as_read(weights: Iterable[tuple[str, torch.Tensor]], smoothing: list[LayerSmoothing], num_heads: int
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's HF-named tensors with the factors folded in, in fp32 (the others as they come)."""
    for name, tensor in weights:
        match = _HF_NAME.search(name)
        if match is None:
            yield name, tensor
            continue
        layer, part, kind = smoothing[int(match.group(1))], match.group(2), match.group(3)
        t = tensor.float()
        if part == "input_layernorm":
            t = t / layer.qkv
        elif part == "post_attention_layernorm":
            t = t / layer.gate_up
        elif kind == "bias":
            # A bias follows its rows: v's and up's rows are divided, the others' outputs do not change.
            if part == "self_attn.v_proj":
                t = t / layer.o
            elif part == "mlp.up_proj":
                t = t / layer.down
        elif part in ("self_attn.q_proj", "self_attn.k_proj"):
            t = t * layer.qkv
        elif part == "self_attn.v_proj":
            t = t * layer.qkv / layer.o[:, None]
        elif part == "self_attn.o_proj":
            # [hidden, num_heads * head_dim]: q head h reads kv head h // group's factors.
            o = layer.o.view(-1, 1, t.shape[1] // num_heads)  # [kv_heads, 1, head_dim]
            t = t * o.expand(-1, num_heads // o.shape[0], -1).reshape(-1)
        elif part == "mlp.gate_proj":
            t = t * layer.gate_up
        elif part == "mlp.up_proj":
            t = t * layer.gate_up / layer.down[:, None]
        elif part == "mlp.down_proj":
            t = t * layer.down
        yield name, t

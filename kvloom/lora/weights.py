"""An adapter's tensors, read from its safetensors file after ``peft.check_adapter`` accepted it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from kvloom.lora.peft import WEIGHTS_NAME, AdapterInfo


@dataclass
class LoRAWeights:
    """Host copies of an adapter: per (layer, module) its A [r, in] and scaling * B [out, r] in ``dtype``."""

    info: AdapterInfo
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.pairs.values())


def load_lora_weights(info: AdapterInfo, dtype: torch.dtype) -> LoRAWeights:
    """Read the adapter's tensors; the scaling goes into B once, here, not in every step's product."""
    try:
        tensors = load_file(f"{info.path}/{WEIGHTS_NAME}", device="cpu")
    except Exception as error:  # safetensors raises its own errors for a file its header check missed
        raise ValueError(f"LoRA adapter at {info.path!r}: {WEIGHTS_NAME} could not be read ({error})") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, (layer, module, kind) in info.tensors.items():
        halves.setdefault((layer, module), {})[kind] = tensors[name]
    pairs = {key: (ab["A"].to(torch.float32).to(dtype).contiguous(),
                   (ab["B"].to(torch.float32) * info.scaling).to(dtype).contiguous())
             for key, ab in halves.items()}
    for (layer, module), (a, b) in pairs.items():
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError(f"LoRA adapter at {info.path!r}: layer {layer} {module} holds NaN or infinite values")
    return LoRAWeights(info, pairs)

"""Tiny random LoRA adapters in PEFT's on-disk format, written with safetensors (peft is not needed), and
the merged model (W + scaling * B A) that is their oracle in transformers."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
from safetensors.torch import save_file

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _sizes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) of each target projection of a HF config."""
    h, i = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def write_tiny_lora(path: str, base_dir: str, *, rank: int = 8, alpha: float = 16, seed: int = 0,
                    targets: tuple[str, ...] = ATTENTION + MLP, use_rslora: bool = False,
                    layers: tuple[int, ...] | None = None, std: float = 0.1) -> str:
    """A PEFT adapter directory for the checkpoint at base_dir (random A and B, both nonzero)."""
    with open(os.path.join(base_dir, "config.json")) as f:
        config = json.load(f)
    sizes = _sizes(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers if layers is not None else range(config["num_hidden_layers"]):
        for module in targets:
            in_features, out_features = sizes[module]
            parent = "self_attn" if module in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * std
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": use_rslora,
                   "target_modules": list(targets), "base_model_name_or_path": base_dir, "bias": "none",
                   "task_type": "CAUSAL_LM", "lora_dropout": 0.0}, f)
    return path


def merged_hf_model(base_dir: str, adapter_dir: str | None) -> Any:
    """transformers' model of base_dir in fp32 with the adapter merged into its weights (None: the base)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return model
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        config = json.load(f)
    rank = config["r"]
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            params[target] += scaling * (b.double() @ a.double()).float()
    return model


def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             min_new_tokens=max_tokens, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()

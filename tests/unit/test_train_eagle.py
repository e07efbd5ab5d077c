"""The EAGLE-1 training script (kvloom/spec_decode/train_eagle.py) on a tiny random Llama: the layout it
saves, the features it trains on, and that training lowers the loss."""

from __future__ import annotations

import json
import os

import torch

from kvloom.loader.weights import resolve_model
from kvloom.spec_decode import train_eagle


def _expected_layout(config: dict) -> dict[str, tuple[int, ...]]:
    """The docstring's table: vLLM's llama_eagle.py layout."""
    h, i = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    return {
        "fc.weight": (h, 2 * h),
        "layers.0.self_attn.q_proj.weight": (q, h),
        "layers.0.self_attn.k_proj.weight": (kv, h),
        "layers.0.self_attn.v_proj.weight": (kv, h),
        "layers.0.self_attn.o_proj.weight": (h, q),
        "layers.0.post_attention_layernorm.weight": (h,),
        "layers.0.mlp.gate_proj.weight": (i, h),
        "layers.0.mlp.up_proj.weight": (i, h),
        "layers.0.mlp.down_proj.weight": (h, i),
    }


def test_target_features_equal_transformers_final_hidden_states(tiny_llama_dir: str) -> None:
    """Features are the hidden states after the final norm (what the LM head reads), one sequence or many."""
    from transformers import AutoModelForCausalLM

    target = train_eagle.Target(resolve_model(tiny_llama_dir), dtype=torch.float32)
    oracle = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 400, (n,), generator=generator) for n in (37, 5, 60)]
    with torch.no_grad():
        for ids, features in zip(sequences, target.forward(sequences)):
            expected = oracle.model(input_ids=ids[None]).last_hidden_state[0]
            torch.testing.assert_close(features, expected, rtol=1e-4, atol=1e-4)


def test_head_with_cache_equals_head_on_whole_sequence(tiny_llama_dir: str) -> None:
    """The evaluation's step-by-step drafting (KV cache) computes what one causal pass does."""
    config = train_eagle.load_model_config(resolve_model(tiny_llama_dir))
    torch.manual_seed(0)
    head = train_eagle.EagleHead(config)
    embeds, features = torch.randn(1, 9, config.hidden_size), torch.randn(1, 9, config.hidden_size)
    with torch.no_grad():
        whole = head(embeds, features, torch.arange(9))
        cache = [torch.zeros(1, config.num_key_value_heads, 0, config.head_dim) for _ in range(2)]
        first = head(embeds[:, :5], features[:, :5], torch.arange(5), cache)
        rest = [head(embeds[:, t:t + 1], features[:, t:t + 1], torch.tensor([t]), cache) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), whole, rtol=1e-5, atol=1e-5)


def test_training_saves_vllm_eagle_layout_and_lowers_loss(tiny_llama_dir: str, tmp_path) -> None:
    out = tmp_path / "head"
    result = train_eagle.main(["--model", tiny_llama_dir, "--out", str(out), "--minutes", "0.25",
                               "--num-prompts", "12", "--eval-prompts", "3", "--max-tokens", "24",
                               "--batch-tokens", "1024", "--threads", "1", "--lr", "3e-3"])
    with open(os.path.join(tiny_llama_dir, "config.json"), encoding="utf-8") as f:
        target_config = json.load(f)
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    assert {name: tuple(t.shape) for name, t in tensors.items()} == _expected_layout(target_config)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    with open(out / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 1
    assert config["hidden_size"] == target_config["hidden_size"]
    assert config["vocab_size"] == target_config["vocab_size"]

    losses = result["losses"]
    assert len(losses) >= 10, f"too few training steps in the budget: {result['timings']}"
    window = len(losses) // 5
    assert sum(losses[-window:]) / window < sum(losses[:window]) / window
    assert 1.0 <= result["mean_acceptance_length"] <= 1 + 4

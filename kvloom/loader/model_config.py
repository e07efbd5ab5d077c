"""ModelConfig: the architecture facts the engine needs, from a HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
# What a config.json must give; the rest has defaults.
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    attention_bias: bool = False
    mlp_bias: bool = False
    torch_dtype: str | None = None  # as stored: "float32", "bfloat16", "float16" or None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "the model config") -> ModelConfig:
        """The facts of a HF config.json's dict; a ValueError naming ``source`` (its file) when a
        required key is missing or a value has the wrong type."""
        missing = [key for key in _REQUIRED_KEYS if key not in d]
        if missing:
            raise ValueError(f"{source} lacks the required key(s) {missing}; a Llama or Mistral config "
                             f"needs {list(_REQUIRED_KEYS)}")
        for key in _REQUIRED_KEYS:
            value = d[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{source}: {key} must be a positive integer, got {value!r}")
        architectures = d.get("architectures") or []
        architecture = architectures[0] if architectures else {
            "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}.get(d.get("model_type", ""), "")
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"{source}: model architecture {architecture or d.get('model_type')!r} is not "
                             f"supported; supported: {list(SUPPORTED_ARCHITECTURES)}")
        try:
            num_heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            eos = d.get("eos_token_id")
            eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
            dtype = d.get("torch_dtype") or d.get("dtype")
            return cls(
                architecture=architecture,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=num_heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
                head_dim=int(d.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                rope_theta=float(d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
                rope_scaling=_rope_scaling(d),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                sliding_window=d.get("sliding_window"),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                attention_bias=bool(d.get("attention_bias", False)),
                mlp_bias=bool(d.get("mlp_bias", False)),
                torch_dtype=str(dtype).replace("torch.", "") if dtype else None,
            )
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{source} has a value of the wrong type ({e})") from None


def _rope_scaling(d: dict[str, Any]) -> dict[str, Any] | None:
    """rope_scaling (transformers < 5) or rope_parameters (transformers 5); None for plain rope."""
    scaling = d.get("rope_scaling") or d.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    return dict(scaling, rope_type=kind)

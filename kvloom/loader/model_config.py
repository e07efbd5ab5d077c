"""ModelConfig: the architecture facts the engine needs, from a HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
    "Idefics3ForConditionalGeneration", "LlavaForConditionalGeneration",
)
# Text-only families (what a sequence classifier may be built on).
TEXT_ARCHITECTURES = tuple(a for a in SUPPORTED_ARCHITECTURES if a.endswith("ForCausalLM"))
# Vision-language architectures: a vision encoder before a text model of a supported family (its text_config).
_VISION_TEXT_ARCHITECTURES = {"Idefics3ForConditionalGeneration": "LlamaForCausalLM",
                              "LlavaForConditionalGeneration": "LlamaForCausalLM"}
# config.json's model_type -> architecture, for a config without an ``architectures`` list.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "idefics3": "Idefics3ForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
}
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# Sequence classifiers: a text family's decoder with a ``score`` head on the last token (``<Family>ForCausalLM``
# renamed ``<Family>ForSequenceClassification``, as transformers names them).
CLASSIFIER_SUFFIX = "ForSequenceClassification"
# vLLM's ways to make a classifier of a causal LM from its LM head's rows (hf_overrides ``method``):
# from_2_way_softmax: one label, the "yes" row minus the "no" row (softmax over the two = sigmoid of the
# difference); no_post_processing: one label per token, the rows as they are.
CLASSIFIER_METHODS = ("from_2_way_softmax", "no_post_processing")
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
    # The q/k/v projections' bias where it differs from the output projection's (Qwen2: q/k/v only).
    qkv_bias: bool | None = None
    # A per-head RMSNorm of q and k before rotary (Qwen3, Qwen3-MoE, Gemma 3).
    qk_norm: bool = False
    # Per layer where the layers differ (Gemma 2/3, Qwen with max_window_layers): each layer's window
    # (None: global attention). ``sliding_window`` then stays None, so the runner's metadata is global and
    # a sliding layer narrows it itself (ops/metadata.py with_sliding_window).
    layer_sliding_windows: list[int | None] | None = None
    # Gemma 3: the sliding layers' rotary (base, scaling) when it differs from the global layers'.
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    # Gemma: attention scale query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5); soft-caps (None: off).
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    hidden_activation: str = "silu"
    # Mixture of experts (0 experts: a dense MLP).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # A vision-language model (Idefics3): the HF config's vision_config, scale_factor and image_token_id; the
    # fields above then describe its text model (text_config). None: a text-only model.
    multimodal: dict[str, Any] | None = None
    # A sequence classifier (``*ForSequenceClassification``): its ``score`` head's labels (0: a language model).
    # ``classifier_from_token`` (vLLM's hf_overrides): the head is made of these tokens' LM-head rows by
    # ``classifier_method``; their ids are settled with the tokenizer (``classifier_token_ids``) before loading.
    num_labels: int = 0
    classifier_from_token: list[str] | None = None
    classifier_method: str | None = None
    classifier_token_ids: list[int] | None = None
    # vLLM's is_original_qwen3_reranker: a Qwen3-Reranker scored through its "no" / "yes" rows, whose pairs are
    # written into Qwen's reranker prompt by default (kvloom/scoring.py).
    is_original_qwen3_reranker: bool = False

    @property
    def is_classifier(self) -> bool:
        return self.num_labels > 0

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "the model config") -> ModelConfig:
        """The facts of a HF config.json's dict; a ValueError naming ``source`` (its file) when a
        required key is missing or a value has the wrong type."""
        vision_text = _VISION_TEXT_ARCHITECTURES.get((d.get("architectures") or [""])[0]) or \
            _VISION_TEXT_ARCHITECTURES.get(_MODEL_TYPES.get(d.get("model_type", ""), ""))
        if vision_text is not None:
            return _vision_language_config(cls, d, vision_text, source)
        if str((d.get("architectures") or [""])[0]).endswith(CLASSIFIER_SUFFIX):
            return _classifier_config(cls, d, source)
        missing = [key for key in _REQUIRED_KEYS if key not in d]
        if missing:
            raise ValueError(f"{source} lacks the required key(s) {missing}; a Llama or Mistral config "
                             f"needs {list(_REQUIRED_KEYS)}")
        for key in _REQUIRED_KEYS:
            value = d[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{source}: {key} must be a positive integer, got {value!r}")
        architectures = d.get("architectures") or []
        architecture = architectures[0] if architectures else _MODEL_TYPES.get(d.get("model_type", ""), "")
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"{source}: model architecture {architecture or d.get('model_type')!r} is not "
                             f"supported; supported: {list(SUPPORTED_ARCHITECTURES)}")
        try:
            num_heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            eos = d.get("eos_token_id")
            eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
            dtype = d.get("torch_dtype") or d.get("dtype")
            sliding_window, layer_windows = _sliding_windows(d, architecture, source)
            rope, local_rope = _rope_by_layer_type(d, architecture)
            head_dim = int(d.get("head_dim") or hidden // num_heads)
            config = cls(
                architecture=architecture,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=num_heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
                head_dim=head_dim,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))),
                rope_scaling=_rope_scaling(rope),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                sliding_window=sliding_window,
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                attention_bias=bool(d.get("attention_bias", False)),
                mlp_bias=bool(d.get("mlp_bias", False)),
                torch_dtype=str(dtype).replace("torch.", "") if dtype else None,
                qkv_bias=True if architecture == "Qwen2ForCausalLM" or architecture == "Qwen2MoeForCausalLM"
                else None,
                qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
                layer_sliding_windows=layer_windows,
                local_rope_theta=None if local_rope is None else float(
                    local_rope.get("rope_theta", d.get("rope_local_base_freq", 10000.0))),
                local_rope_scaling=None if local_rope is None else _rope_scaling(local_rope),
                query_pre_attn_scalar=(float(d.get("query_pre_attn_scalar") or head_dim)
                                       if architecture in _GEMMA else None),
                attn_logit_softcapping=_optional_float(d.get("attn_logit_softcapping")),
                final_logit_softcapping=_optional_float(d.get("final_logit_softcapping")),
                hidden_activation=str(d.get("hidden_activation") or d.get("hidden_act") or "silu"),
                num_experts=int(d.get("num_local_experts") or d.get("num_experts") or 0),
                num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
                moe_intermediate_size=int(d.get("moe_intermediate_size") or d["intermediate_size"]),
                shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0),
                # Mixtral always renormalizes the chosen experts' weights; Qwen-MoE says whether.
                norm_topk_prob=bool(d.get("norm_topk_prob", architecture == "MixtralForCausalLM")),
                decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
                mlp_only_layers=[int(i) for i in d.get("mlp_only_layers") or []],
            )
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{source} has a value of the wrong type ({e})") from None
        _check_supported(config, d, source)
        return config


def _vision_language_config(cls: type[ModelConfig], d: dict[str, Any], text_architecture: str,
                            source: str) -> ModelConfig:
    """A vision-language config: its text model's facts (text_config, as that family's own config) and, in
    ``multimodal``, what the vision side needs."""
    architecture = (d.get("architectures") or [None])[0] or _MODEL_TYPES[d["model_type"]]
    text = d.get("text_config")
    vision = d.get("vision_config")
    if not isinstance(text, dict) or not isinstance(vision, dict):
        raise ValueError(f"{source}: a {architecture} config needs text_config and vision_config dicts")
    image_token_id = d.get("image_token_id", d.get("image_token_index"))
    if image_token_id is None:
        raise ValueError(f"{source}: a {architecture} config needs image_token_id")
    if text.get("model_type") == "mistral":  # LLaVA's text model may be Mistral
        text_architecture = "MistralForCausalLM"
    elif text.get("model_type", "llama") != "llama":
        raise ValueError(f"{source}: {architecture}'s text model {text.get('model_type')!r} is not supported; "
                         f"supported: llama, mistral")
    text = dict(text, architectures=[text_architecture])
    if not (text.get("torch_dtype") or text.get("dtype")):
        text["dtype"] = d.get("torch_dtype") or d.get("dtype")
    if "tie_word_embeddings" in d:  # the top level's word is the one transformers' model follows
        text["tie_word_embeddings"] = d["tie_word_embeddings"]
    config = cls.from_hf_dict(text, f"{source} (text_config)")
    config.architecture = architecture
    config.multimodal = {"vision_config": dict(vision), "image_token_id": int(image_token_id),
                         "text_architecture": text_architecture,
                         # Idefics3: the pixel shuffle's factor. LLaVA: which layer's patches, CLS or not, the MLP.
                         "scale_factor": int(d.get("scale_factor", 2)),
                         "vision_feature_layer": d.get("vision_feature_layer", -2),
                         "vision_feature_select_strategy": d.get("vision_feature_select_strategy", "default"),
                         "projector_hidden_act": d.get("projector_hidden_act", "gelu"),
                         "multimodal_projector_bias": bool(d.get("multimodal_projector_bias", True))}
    return config


def _classifier_config(cls: type[ModelConfig], d: dict[str, Any], source: str) -> ModelConfig:
    """A sequence classifier's config: its family's causal LM facts, its labels and (vLLM's hf_overrides) the
    tokens its head is made of."""
    architecture = str(d["architectures"][0])
    causal = architecture.removesuffix(CLASSIFIER_SUFFIX) + "ForCausalLM"
    if causal not in TEXT_ARCHITECTURES:
        raise ValueError(f"{source}: model architecture {architecture!r} is not supported; sequence classifiers "
                         f"run on {[a.removesuffix('ForCausalLM') + CLASSIFIER_SUFFIX for a in TEXT_ARCHITECTURES]}")
    config = cls.from_hf_dict(dict(d, architectures=[causal]), source)
    config.architecture = architecture
    tokens = d.get("classifier_from_token")
    method = d.get("method")
    if d.get("is_original_qwen3_reranker"):
        # vLLM's Qwen3-Reranker switch: "no" / "yes" logits softmaxed, as the model card scores.
        method = method or "from_2_way_softmax"
        tokens = tokens or ["no", "yes"]
        config.is_original_qwen3_reranker = True
    if tokens is not None:
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t for t in tokens):
            raise ValueError(f"{source}: classifier_from_token must be a non-empty list of tokens, got {tokens!r}")
        if method not in CLASSIFIER_METHODS:
            raise ValueError(f"{source}: classifier_from_token needs method, one of {list(CLASSIFIER_METHODS)} "
                             f"(or is_original_qwen3_reranker: true), got {method!r}")
        if method == "from_2_way_softmax" and len(tokens) != 2:
            raise ValueError(f"{source}: method from_2_way_softmax takes two tokens (the 'no' and the 'yes' one), "
                             f"got {tokens!r}")
        config.num_labels = 1 if method == "from_2_way_softmax" else len(tokens)
        config.classifier_from_token, config.classifier_method = list(tokens), method
    else:
        labels = d.get("id2label")
        num_labels = d.get("num_labels", len(labels) if isinstance(labels, dict) else 2)
        if not isinstance(num_labels, int) or isinstance(num_labels, bool) or num_labels < 1:
            raise ValueError(f"{source}: num_labels must be a positive integer, got {num_labels!r}")
        config.num_labels = num_labels
    return config


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _sliding_windows(d: dict[str, Any], architecture: str, source: str
                     ) -> tuple[int | None, list[int | None] | None]:
    """(the window of every layer, or None) and, where the layers differ, each layer's window.

    transformers 5 writes ``layer_types``; Hub configs say it through ``use_sliding_window`` and
    ``max_window_layers`` (Qwen), ``sliding_window_pattern`` (Gemma 3: every n-th layer global) or nothing
    (Gemma 2: even layers slide, odd ones are global)."""
    window = d.get("sliding_window")
    if architecture in _QWEN and not d.get("use_sliding_window", False):
        window = None
    if not window:
        return None, None
    window = int(window)
    layers = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if types is None:
        if architecture == "Gemma2ForCausalLM":
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        elif architecture == "Gemma3ForCausalLM":
            pattern = int(d.get("sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        elif architecture in _QWEN:
            first = int(d.get("max_window_layers", layers))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        else:
            return window, None
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"{source}: layer_types must list 'sliding_attention' or 'full_attention' for each of "
                         f"the {layers} layers, got {types!r}")
    windows = [window if kind == "sliding_attention" else None for kind in types]
    if all(w is not None for w in windows):
        return window, None
    if all(w is None for w in windows):
        return None, None
    return None, windows


def _rope_by_layer_type(d: dict[str, Any], architecture: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the global layers' rope parameters, the sliding layers' where they differ: Gemma 3) as dicts that may
    hold rope_theta and a scaling type; transformers 5 nests Gemma 3's by layer type."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling")
    if "full_attention" in params or "sliding_attention" in params:
        return dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    merged = dict(params)
    if scaling:
        merged.update(scaling)
    if architecture == "Phi3ForCausalLM" and "original_max_position_embeddings" in d:
        merged.setdefault("original_max_position_embeddings", d["original_max_position_embeddings"])
    if architecture == "Gemma3ForCausalLM":
        return merged, {"rope_theta": float(d.get("rope_local_base_freq", 10000.0))}
    return merged, None


def _check_supported(config: ModelConfig, d: dict[str, Any], source: str) -> None:
    """A config option kvloom does not implement is an error naming it, never silently wrong output."""
    if config.hidden_activation not in ("silu", "gelu_pytorch_tanh"):
        raise ValueError(f"{source}: hidden activation {config.hidden_activation!r} is not supported; "
                         "supported: silu, gelu_pytorch_tanh")
    for scaling in (d, d.get("rope_parameters") or {}, config.rope_scaling or {}, config.local_rope_scaling or {}):
        if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"{source}: partial_rotary_factor {scaling['partial_rotary_factor']} is not "
                             "supported; kvloom rotates the whole head (1.0)")
    if config.num_experts and not 0 < config.num_experts_per_tok <= config.num_experts:
        raise ValueError(f"{source}: num_experts_per_tok must be in 1..{config.num_experts}, "
                         f"got {config.num_experts_per_tok}")
    if d.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention is not supported; kvloom's attention is causal")

def _rope_scaling(scaling: dict[str, Any]) -> dict[str, Any] | None:
    """The scaling of rope_scaling (transformers < 5) or rope_parameters (transformers 5); None for plain rope."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    kind = "longrope" if kind == "su" else kind  # Phi-3's early configs name LongRoPE "su"
    if kind == "default":
        return None
    return dict(scaling, rope_type=kind)

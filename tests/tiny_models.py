"""Tiny random checkpoints and tokenizers for tests, built on the spot; nothing is downloaded.

    build_tiny_checkpoint(path, arch="llama")            # Llama, GQA 4/2 heads, tied, fp32
    build_tiny_checkpoint(path, arch="llama3")           # untied, Llama-3 rope scaling
    build_tiny_checkpoint(path, arch="mistral", sliding_window=32)
    build_tiny_checkpoint(path, max_shard_size="100KB")  # sharded, with model.safetensors.index.json
    write_tiny_gguf(path, checkpoint_dir)                # the same weights as a quantized llama GGUF
    relabel_gguf(source, target, token_texts=..., uint32_keys=...)  # a GGUF's tokens renamed / named by key

The tokenizer is a byte-level BPE trained deterministically on TRAINING_TEXT, with SmolLM2's special
tokens and ChatML template, so transformers' AutoTokenizer loads it too (it is the tests' oracle).
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
TOKENIZER_VOCAB_SIZE = 400

# SmolLM2-Instruct's template: ChatML with a default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the fox runs away.
Once upon a time, there was a little robot who wanted to learn how to read and write stories.
It read every book in the library, from the first page to the last, and then it wrote its own.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
for i in range(10):
    print(i, fibonacci(i))
The numbers 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 and 1,000,000 appear in text.
User: What is the capital of France? Assistant: The capital of France is Paris.
Café, naïve, résumé, façade, jalapeño, Zürich, São Paulo, Ångström, crème brûlée.
日本語のテキスト、中文文本、한국어 텍스트。 東京 北京 서울.
Emoji: 😀 🎉 🚀 👍🏽 ❤️ 🇫🇷 and symbols like → ∑ ≤ ≥ ± × ÷ € £ ¥.
    Indented lines,\ttabs,\t\tand   runs   of   spaces.
<html><body><p>Hello, world!</p></body></html>
{"key": "value", "list": [1, 2, 3], "nested": {"a": true, "b": null}}
"""


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE like GPT-2's / SmolLM2's, trained on TRAINING_TEXT (deterministic)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeated lines make word frequencies uneven, so merges are not decided by ties alone.
    lines = TRAINING_TEXT.splitlines(keepends=True)
    tokenizer.train_from_iterator(lines * 3 + lines[:4] * 5, trainer=trainer)
    return tokenizer


def save_tokenizer(path: str, *, add_bos_token: bool = False) -> int:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json into path; returns the vocab size.

    add_bos_token puts BOS in tokenizer.json's post-processor (transformers 5 ignores tokenizer_config's
    add_bos_token when there is a tokenizer.json).
    """
    os.makedirs(path, exist_ok=True)
    tokenizer = train_tokenizer()
    if add_bos_token:
        bos = SPECIAL_TOKENS[BOS_ID]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_ID)])
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    special = {
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[EOS_ID],
        "unk_token": SPECIAL_TOKENS[UNK_ID],
    }
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
        **special,
    }
    _write_json(os.path.join(path, "tokenizer_config.json"), config)
    _write_json(os.path.join(path, "special_tokens_map.json"), special)
    return tokenizer.get_vocab_size(with_added_tokens=True)


_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": True},
    "llama3": {
        "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        "rope_theta": 500000.0,
    },
    "mistral": {"tie_word_embeddings": False, "sliding_window": None},
}


def build_tiny_checkpoint(
    path: str,
    arch: str = "llama",
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    add_bos_token: bool = False,
    generation_eos_token_ids: list[int] | None = None,
    **config_overrides: Any,
) -> str:
    """A tiny random model + tokenizer saved like a HF checkpoint (fp32 safetensors); returns path.

    arch: "llama" (tied), "llama3" (untied, llama3 rope scaling) or "mistral". config_overrides go to
    the transformers config (e.g. sliding_window=32, num_hidden_layers=4).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    if arch not in _ARCH_DEFAULTS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {sorted(_ARCH_DEFAULTS)}")
    vocab_size = save_tokenizer(path, add_bos_token=add_bos_token)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID, dtype="float32",
    )
    # Deep copies: transformers writes into the rope dicts it is given.
    kwargs.update(copy.deepcopy(_ARCH_DEFAULTS[arch]))
    kwargs.update(copy.deepcopy(config_overrides))
    config_class, model_class = ((MistralConfig, MistralForCausalLM) if arch == "mistral"
                                 else (LlamaConfig, LlamaForCausalLM))
    config = config_class(**kwargs)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    # The default init (std 0.02) makes every logit ~0; wider weights give peaked, seed-specific
    # distributions, so greedy/sampling tests notice mistakes.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0.0, 0.3 if "embed" in name else 0.1)
    save_kwargs: dict[str, Any] = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **save_kwargs)
    if generation_eos_token_ids is not None:
        generation_path = os.path.join(path, "generation_config.json")
        with open(generation_path, encoding="utf-8") as f:
            generation = json.load(f)
        generation["eos_token_id"] = generation_eos_token_ids
        _write_json(generation_path, generation)
    return path


def quantize_tensor(w: Any, ggml_type: int) -> Any:
    """gguf.quants.quantize, and Q6_K and Q4_K (which it lacks) by quantize_q6_k and quantize_q4_k."""
    import gguf

    if ggml_type == int(gguf.GGMLQuantizationType.Q4_K):
        return quantize_q4_k(w)
    return quantize_q6_k(w) if ggml_type == int(gguf.GGMLQuantizationType.Q6_K) else gguf.quants.quantize(w,
                                                                                                         ggml_type)


def quantize_q4_k(w: Any) -> Any:
    """A float32 [rows, K] (K a multiple of 256) as GGUF Q4_K bytes [rows, K / 256 * 144], laid out as ggml's
    dequantize_row_q4_K reads them: per super-block of 256 an fp16 d and dmin, per block of 32 a 6-bit scale and min
    (the block's range / 15 and -min(block, 0), in units of d = the largest scale / 63 and dmin = the largest min /
    63, packed as get_scale_min_k4 unpacks them) and codes round((x + dmin mn) / (d sc)) in 0..15, block 2 j's in the
    low nibbles of bytes 32 j .. 32 j + 31 and block 2 j + 1's in their high ones. Not llama.cpp's search for the
    best scales: a valid file's bytes for tests."""
    import numpy as np

    rows, k = w.shape
    x = w.astype(np.float32).reshape(-1, 8, 32)  # [S, block, 32]
    lo = np.minimum(x.min(axis=2), 0)
    step, offset = (x.max(axis=2) - lo) / 15, -lo  # [S, 8]
    d = (step.max(axis=1) / 63).astype(np.float16)
    dmin = (offset.max(axis=1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.round(step / np.where(d32 > 0, d32, 1)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(offset / np.where(dmin32 > 0, dmin32, 1)[:, None]), 0, 63).astype(np.uint8)
    scale = d32[:, None] * sc.astype(np.float32)
    q = np.round((x + (dmin32[:, None] * mn.astype(np.float32))[..., None]) / np.where(scale > 0, scale, 1)[..., None])
    codes = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)  # [S, j, half, l]
    qs = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(-1, 128)
    packed = np.concatenate((sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)), axis=1)  # [S, 12]
    out = np.concatenate((d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), packed, qs), axis=1)
    return out.reshape(rows, k // 256 * 144)


def quantize_q6_k(w: Any) -> Any:
    """A float32 [rows, K] (K a multiple of 256) as GGUF Q6_K bytes [rows, K / 256 * 210], laid out as ggml's
    dequantize_row_q6_K reads them: per super-block of 256 an fp16 d, an int8 scale per 16 values (max |x| / 31 of
    the 16, in units of d = the largest of them / 127) and codes round(x / (d * scale)) + 32 in 0..63, their low
    nibbles in ql and top two bits in qh."""
    import numpy as np

    rows, k = w.shape
    x = w.astype(np.float32).reshape(-1, 256)  # [S, 256]
    sub = np.abs(x.reshape(-1, 16, 16)).max(axis=2) / 31  # [S, 16]
    d = (np.abs(sub).max(axis=1) / 127).astype(np.float16)  # [S]
    d32 = d.astype(np.float32)
    safe = np.where(d32 > 0, d32, 1)
    scale = np.clip(np.round(sub / safe[:, None]), -128, 127).astype(np.int8)  # [S, 16]
    step = d32[:, None] * scale.astype(np.float32)
    q = np.round(x.reshape(-1, 16, 16) / np.where(step != 0, step, 1)[..., None])
    codes = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [S, half, quarter, l]
    low, high = codes & 0x0F, codes >> 4
    ql = np.concatenate((low[:, :, 0:2] | (low[:, :, 2:4] << 4),), axis=2).reshape(-1, 128)  # [S, half, q % 2, l]
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    out = np.concatenate((ql, qh, scale.view(np.uint8), d.reshape(-1, 1).view(np.uint8)), axis=1)  # [S, 210]
    return out.reshape(rows, k // 256 * 210)


def write_tiny_gguf(path: str, checkpoint_dir: str, *, types: dict[str, int] | None = None, arch: str = "llama",
                    pre: str = "smollm") -> str:
    """The checkpoint's weights and tokenizer as a llama GGUF, written the way llama.cpp's converter does.

    Q/K rows are permuted to llama.cpp's rotary order, and each weight is quantized to a ggml type
    chosen by tensor kind (types overrides: "embed", "attn", "ffn", "output", "norm" -> ggml type id; a
    layer tensor's own GGUF name, e.g. "attn_v", overrides its kind's),
    so one file exercises Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and F16. ``arch`` "qwen2" / "qwen3": llama.cpp's Qwen
    files, which keep HF's q/k row order and carry the q/k/v biases (Qwen2) or q/k norms (Qwen3). ``pre``: the
    tokenizer.ggml.pre name written (which pre-tokenizer split the file's readers apply).
    """
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    with open(os.path.join(checkpoint_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    q = gguf.GGMLQuantizationType
    chosen = {"embed": q.Q8_0, "attn": q.Q5_0, "ffn": q.Q4_1, "output": q.Q5_1, "norm": q.F32,
              "attn_o": q.Q4_0, "ffn_down": q.F16}
    chosen.update({key: q(value) for key, value in (types or {}).items()})
    weights: dict[str, np.ndarray] = {}
    for name in sorted(os.listdir(checkpoint_dir)):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(checkpoint_dir, name)))

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config["hidden_size"] // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(float(config.get("rope_theta") or config["rope_parameters"]["rope_theta"]))
    writer.add_file_type(q.Q4_1)
    _add_gguf_tokenizer(writer, checkpoint_dir, pre)

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:
        # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    gguf_names = {"model.embed_tokens.weight": ("token_embd.weight", "embed"),
                  "model.norm.weight": ("output_norm.weight", "norm"),
                  "lm_head.weight": ("output.weight", "output")}
    parts = {"input_layernorm": ("attn_norm", "norm"), "post_attention_layernorm": ("ffn_norm", "norm"),
             "self_attn.q_proj": ("attn_q", "attn"), "self_attn.k_proj": ("attn_k", "attn"),
             "self_attn.v_proj": ("attn_v", "attn"), "self_attn.o_proj": ("attn_output", "attn_o"),
             "mlp.gate_proj": ("ffn_gate", "ffn"), "mlp.up_proj": ("ffn_up", "ffn"),
             "mlp.down_proj": ("ffn_down", "ffn_down"), "self_attn.q_norm": ("attn_q_norm", "norm"),
             "self_attn.k_norm": ("attn_k_norm", "norm")}
    for i in range(config["num_hidden_layers"]):
        for hf_part, (gguf_part, kind) in parts.items():
            gguf_names[f"model.layers.{i}.{hf_part}.weight"] = (f"blk.{i}.{gguf_part}.weight", kind)
            gguf_names[f"model.layers.{i}.{hf_part}.bias"] = (f"blk.{i}.{gguf_part}.bias", "norm")
    for hf_name, (gguf_name, kind) in gguf_names.items():
        if hf_name not in weights:
            continue
        w = weights[hf_name].astype(np.float32)
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            w = permute(w, heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            w = permute(w, kv_heads)
        part = gguf_name.split(".")[-2]  # a type named for one tensor ("attn_v") overrides its kind's
        ggml_type = chosen[part] if part in chosen and gguf_name.startswith("blk.") else chosen[kind]
        writer.add_tensor(gguf_name, quantize_tensor(w, ggml_type), raw_dtype=ggml_type)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama3_rope_factors(config: dict[str, Any]) -> Any:
    """llama.cpp's rope_freqs tensor for llama3 rope scaling (convert_hf_to_gguf.py, LlamaModel)."""
    import math

    import numpy as np

    rope = config.get("rope_parameters") or config["rope_scaling"]
    base = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _add_gguf_tokenizer(writer: Any, checkpoint_dir: str, pre: str = "smollm") -> None:
    """The byte-level BPE of checkpoint_dir as llama.cpp's "gpt2" tokenizer metadata."""
    with open(os.path.join(checkpoint_dir, "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {added["content"] for added in spec["added_tokens"] if added["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in special else 1 for token in tokens])  # 3: control, 1: normal
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(UNK_ID)
    writer.add_pad_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


def _write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, ensure_ascii=False)
        f.write("\n")


SENTENCEPIECE_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
USER_DEFINED_TOKEN = "<|tool|>"


def write_sentencepiece_gguf(path: str, vocab_size: int = 400, *, add_space_prefix: bool | None = None) -> str:
    """A GGUF holding only a Llama-2-style tokenizer (llama.cpp's "llama" model: sentencepiece BPE with
    byte fallback, merges implied by scores), trained on TRAINING_TEXT; no chat template, no tensors.
    ``add_space_prefix``: the tokenizer.ggml.add_space_prefix flag (False in Gemma's files; absent: unset)."""
    import gguf

    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    lines = TRAINING_TEXT.splitlines()
    trainer_tokenizer.train_from_iterator(lines * 3 + lines[:4] * 5, trainer=trainer)
    pieces = [piece for piece, _ in sorted(trainer_tokenizer.get_vocab().items(), key=lambda item: item[1])]

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = [*SENTENCEPIECE_SPECIAL_TOKENS, *byte_tokens, *pieces, USER_DEFINED_TOKEN]
    # sentencepiece scores: pieces learned earlier score higher; specials and bytes score 0.
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))] + [0.0]
    token_types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4]  # unknown, control, byte, normal, user

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-sentencepiece")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(token_types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def requantize_gguf(source: str, target: str, ggml_type: int = 8) -> str:
    """``source``'s tensors re-quantized to ``ggml_type`` (default Q8_0; 1-D tensors stay F32), with its
    metadata and tokenizer copied: e.g. a Q8_0 SmolLM2 from the shipped Q4_1 file."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = gguf.GGMLQuantizationType(ggml_type) if field.name == "general.file_type" else field.contents()
        writer.add_key_value(field.name, int(value) if field.name == "general.file_type" else value, kind,
                             sub_type=sub_type)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        values = values.reshape([int(n) for n in reversed(tensor.shape)])
        if values.ndim == 1:
            writer.add_tensor(tensor.name, values)
        else:
            kind = gguf.GGMLQuantizationType(ggml_type)
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def relabel_gguf(source: str, target: str, *, token_texts: dict[int, str] | None = None,
                 uint32_keys: dict[str, int] | None = None) -> str:
    """``source`` with its tensors copied byte for byte and its tokenizer relabelled: ``token_texts`` renames
    tokens (id -> new spelling), ``uint32_keys`` adds or replaces uint32 metadata (e.g.
    ``tokenizer.ggml.fim_pre_token_id``). A real model with fill-in-the-middle tokens both kvloom and llama.cpp
    load, made from one without (SmolLM2's control tokens renamed or named by key)."""
    import gguf

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF.") \
                or field.name in (uint32_keys or {}):
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf.Keys.Tokenizer.LIST and token_texts:
            value = [token_texts.get(index, text) for index, text in enumerate(value)]
        writer.add_key_value(field.name, value, kind, sub_type=sub_type)
    for key, value in (uint32_keys or {}).items():
        writer.add_uint32(key, value)
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes,
                               tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data)
    writer.close()
    return target


def build_tiny_eagle(path: str, target_dir: str, method: str = "eagle", *, seed: int = 0,
                     draft_vocab_size: int | None = None, own_embedding: bool = False,
                     aux_layer_ids: list[int] | None = None, fc_bias: bool = False) -> str:
    """A random EAGLE head for the target checkpoint, in the layout vLLM loads (llama_eagle.py: ``fc``,
    ``layers.0.*`` without an input norm; llama_eagle3.py: ``midlayer.*``, ``fc`` over 3 aux states, ``norm``,
    ``lm_head`` over a draft vocabulary with ``d2t``, ``t2d``). One layer, the target's hidden size."""
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(target_dir, "config.json"), encoding="utf-8") as f:
        target = json.load(f)
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    heads, kv_heads, inter = target["num_attention_heads"], target["num_key_value_heads"], target["intermediate_size"]
    head_dim = hidden // heads
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    def norm() -> torch.Tensor:
        return 1.0 + rand(hidden, std=0.05)

    eagle3 = method == "eagle3"
    prefix = "midlayer." if eagle3 else "layers.0."
    width = 2 * hidden if eagle3 else hidden
    tensors = {
        f"{prefix}self_attn.q_proj.weight": rand(heads * head_dim, width),
        f"{prefix}self_attn.k_proj.weight": rand(kv_heads * head_dim, width),
        f"{prefix}self_attn.v_proj.weight": rand(kv_heads * head_dim, width),
        f"{prefix}self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        f"{prefix}mlp.gate_proj.weight": rand(inter, hidden),
        f"{prefix}mlp.up_proj.weight": rand(inter, hidden),
        f"{prefix}mlp.down_proj.weight": rand(hidden, inter),
        f"{prefix}post_attention_layernorm.weight": norm(),
        "fc.weight": rand(hidden, (3 if eagle3 else 2) * hidden),
    }
    if fc_bias:
        tensors["fc.bias"] = rand(hidden)
    if own_embedding:
        tensors["embed_tokens.weight"] = rand(vocab, hidden, std=0.3)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3" if eagle3 else "EagleLlamaForCausalLM"],
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
        "max_position_embeddings": target["max_position_embeddings"], "rms_norm_eps": target["rms_norm_eps"],
        "rope_theta": target.get("rope_theta", 10000.0), "torch_dtype": "float32",
    }
    if eagle3:
        draft_vocab = draft_vocab_size or vocab
        tensors[f"{prefix}input_layernorm.weight"] = norm()
        tensors[f"{prefix}hidden_norm.weight"] = norm()
        tensors["norm.weight"] = norm()
        tensors["lm_head.weight"] = rand(draft_vocab, hidden, std=0.3)
        # Draft id d is target id d + d2t[d]; t2d marks the target ids the draft vocabulary has.
        target_ids = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
        tensors["d2t"] = target_ids - torch.arange(draft_vocab)
        tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, target_ids, True)
        config["draft_vocab_size"] = draft_vocab
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids or [0, 1, 1],
                                  "use_aux_hidden_state": True}
    os.makedirs(path, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, os.path.join(path, "model.safetensors"))
    _write_json(os.path.join(path, "config.json"), config)
    return path


# Families beyond Llama: (transformers config class, model class, config defaults). Every distinctive
# feature is on and binds in a tiny model: windows shorter than the test prompts, soft-caps that the
# widened weights reach, more experts than top-k, a shared expert.
_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1000000.0, "tie_word_embeddings": False}),
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1000000.0, "tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "rope_theta": 1000000.0,
                                                  "tie_word_embeddings": True}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"tie_word_embeddings": False, "num_key_value_heads": 4,
                                               "original_max_position_embeddings": 256}),
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM", {
        "tie_word_embeddings": False, "original_max_position_embeddings": 48,
        "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                         "long_factor": [2.0 + 0.5 * i for i in range(8)]}}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8, "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 3.0, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8, "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False, "sliding_window": None}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 96, "norm_topk_prob": False, "tie_word_embeddings": False}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "tie_word_embeddings": False}),
}


def build_tiny_family_checkpoint(path: str, family: str, *, seed: int = 0, **config_overrides: Any) -> str:
    """A tiny random checkpoint of another family (_FAMILIES: qwen2, qwen3, phi3, gemma2, gemma3, mixtral,
    qwen2_moe, qwen3_moe, ...) saved by transformers itself, with the test tokenizer; returns path.

    Norm weights are perturbed too (around 1, or around 0 for Gemma's (1 + w) norms), so a norm loaded into
    the wrong place, or not at all, changes the tokens."""
    import torch
    import transformers

    if family not in _FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; choose from {sorted(_FAMILIES)}")
    config_name, model_name, defaults = _FAMILIES[family]
    vocab_size = save_tokenizer(path)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID, dtype="float32",
    )
    kwargs.update(copy.deepcopy(defaults))
    kwargs.update(copy.deepcopy(config_overrides))
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            else:
                param.normal_(0.0, 0.3 if "embed" in name else 0.1)
    model.save_pretrained(path)
    return path


# llama.cpp's GGUF architecture for each tiny family written by write_tiny_family_gguf (Mixtral is a llama file
# with experts; Gemma 3's checkpoint needs six layers for llama.cpp's fixed five-local-one-global pattern).
GGUF_FAMILY_ARCHS = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "phi3": "phi3",
                     "phi3_longrope": "phi3", "gemma2": "gemma2", "gemma3": "gemma3"}


def write_tiny_family_gguf(path: str, checkpoint_dir: str, arch: str, *, types: dict[str, int] | None = None
                           ) -> str:
    """A tiny family checkpoint as llama.cpp's convert_hf_to_gguf.py writes it, for ``arch`` in gemma2, gemma3,
    phi3, qwen2moe, qwen3moe and llama (Mixtral).

    Its conventions, each followed here: Gemma's norm weights stored as 1 + w; q/k rows permuted for the llama
    architecture only; Phi-3's fused qkv_proj (attn_qkv) and gate_up_proj (stored as ffn_up) kept fused and its
    LongRoPE factors as rope_factors_long / rope_factors_short tensors; each layer's experts stacked into 3-D
    ffn_{gate,up,down}_exps [E, rows, cols] beside the router ffn_gate_inp (and Qwen2-MoE's *_shexp shared
    expert); the metadata keys of each family's set_gguf_parameters. ``types``: ggml type per tensor kind
    ("embed", "attn", "attn_o", "ffn", "ffn_down", "experts", "experts_down", "output", "norm"); all F32 by
    default, and "experts_down" (ffn_down_exps) as "experts" unless given.
    """
    import math

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    with open(os.path.join(checkpoint_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    q = gguf.GGMLQuantizationType
    chosen = {kind: q.F32 for kind in ("embed", "attn", "attn_o", "ffn", "ffn_down", "experts", "output", "norm")}
    chosen.update({key: q(value) for key, value in (types or {}).items()})
    chosen.setdefault("experts_down", chosen["experts"])
    weights: dict[str, np.ndarray] = {}
    for name in sorted(os.listdir(checkpoint_dir)):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(checkpoint_dir, name)))

    layers, heads, kv_heads = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    global_rope = rope.get("full_attention", rope)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch != "gemma2":  # Gemma2Model writes no rope base (llama.cpp's default 1e4)
        writer.add_rope_freq_base(float(global_rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    if "head_dim" in config or arch.startswith("gemma"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size") is not None:
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])
    if arch == "gemma3":
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])
        if global_rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(global_rope["factor"])
    extra: dict[str, np.ndarray] = {}
    if arch == "phi3":
        original = rope.get("original_max_position_embeddings") or config["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_dimension_count(head_dim)
        writer.add_sliding_window(config.get("sliding_window") or 0)
        if rope.get("long_factor"):
            scale = config["max_position_embeddings"] / original
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original))
                                                 if scale > 1.0 else 1.0)
            extra["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
            extra["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0 if q.Q4_0 in chosen.values() else gguf.LlamaFileType.ALL_F32)
    _add_gguf_tokenizer(writer, checkpoint_dir)

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    parts = {"input_layernorm": ("attn_norm", "norm"), "self_attn.q_proj": ("attn_q", "attn"),
             "self_attn.k_proj": ("attn_k", "attn"), "self_attn.v_proj": ("attn_v", "attn"),
             "self_attn.qkv_proj": ("attn_qkv", "attn"), "self_attn.o_proj": ("attn_output", "attn_o"),
             "self_attn.q_norm": ("attn_q_norm", "norm"), "self_attn.k_norm": ("attn_k_norm", "norm"),
             "mlp.gate_proj": ("ffn_gate", "ffn"), "mlp.up_proj": ("ffn_up", "ffn"),
             "mlp.gate_up_proj": ("ffn_up", "ffn"), "mlp.down_proj": ("ffn_down", "ffn_down"),
             "mlp.gate": ("ffn_gate_inp", "norm"), "block_sparse_moe.gate": ("ffn_gate_inp", "norm"),
             "mlp.shared_expert_gate": ("ffn_gate_inp_shexp", "norm"),
             "mlp.shared_expert.gate_proj": ("ffn_gate_shexp", "ffn"),
             "mlp.shared_expert.up_proj": ("ffn_up_shexp", "ffn"),
             "mlp.shared_expert.down_proj": ("ffn_down_shexp", "ffn_down")}
    if arch.startswith("gemma"):
        parts.update({"post_attention_layernorm": ("post_attention_norm", "norm"),
                      "pre_feedforward_layernorm": ("ffn_norm", "norm"),
                      "post_feedforward_layernorm": ("post_ffw_norm", "norm")})
    else:
        parts["post_attention_layernorm"] = ("ffn_norm", "norm")
    names = {"model.embed_tokens.weight": ("token_embd.weight", "embed"),
             "model.norm.weight": ("output_norm.weight", "norm"), "lm_head.weight": ("output.weight", "output")}
    for i in range(layers):
        for hf_part, (gguf_part, kind) in parts.items():
            names[f"model.layers.{i}.{hf_part}.weight"] = (f"blk.{i}.{gguf_part}.weight", kind)
            names[f"model.layers.{i}.{hf_part}.bias"] = (f"blk.{i}.{gguf_part}.bias", "norm")
    tensors: dict[str, tuple[np.ndarray, str]] = {}
    for hf_name, (gguf_name, kind) in names.items():
        if hf_name not in weights or (hf_name == "lm_head.weight" and config.get("tie_word_embeddings")):
            continue
        w = weights[hf_name].astype(np.float32)
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            w = permute(w, heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            w = permute(w, kv_heads)
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            w = w + 1  # Gemma's RMSNorm scales by (1 + w)
        tensors[gguf_name] = (w, kind)
    # Each layer's experts as 3-D stacks [E, rows, cols] (Qwen2MoeModel / LlamaModel's "merge the experts").
    moe = "block_sparse_moe" if arch == "llama" else "mlp"
    stacks = {"ffn_gate_exps": ("w1", "gate_proj"), "ffn_up_exps": ("w3", "up_proj"),
              "ffn_down_exps": ("w2", "down_proj")}
    for i in range(layers if experts else 0):
        for gguf_part, (mixtral_part, qwen_part) in stacks.items():
            part = mixtral_part if arch == "llama" else qwen_part
            stack = [weights[f"model.layers.{i}.{moe}.experts.{e}.{part}.weight"] for e in range(experts)]
            kind = "experts_down" if gguf_part == "ffn_down_exps" else "experts"
            tensors[f"blk.{i}.{gguf_part}.weight"] = (np.stack(stack).astype(np.float32), kind)
    for name, values in extra.items():
        tensors[name] = (values, "norm")
    for gguf_name, (w, kind) in tensors.items():
        ggml_type = chosen[kind] if w.ndim > 1 else q.F32  # 1-D tensors stay F32, as llama.cpp keeps them
        writer.add_tensor(gguf_name, gguf.quants.quantize(w, ggml_type), raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

"""A tiny random Idefics3 (SmolVLM) checkpoint with its saved processor, built on the spot (nothing downloaded).

    build_tiny_idefics3(path)   # SigLIP tower 32 px tiles of 8 px patches, scale 2 -> 4 rows a tile; Llama text

The tokenizer is tests/tiny_models.py's byte-level BPE plus SmolVLM's image tokens (``<image>``,
``<fake_token_around_image>``, ``<global-img>``, ``<row_i_col_j>``, ``<end_of_utterance>``); the processor
(transformers' Idefics3Processor with its PIL image processor) is saved beside the weights, so transformers
is the oracle for both preprocessing and greedy tokens.
"""

from __future__ import annotations

import os
from typing import Any

from tiny_models import EOS_ID, _write_json, save_tokenizer

IMAGE_SPECIAL_TOKENS = (["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                        + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])
TILE = 32  # pixels a side of one tile (the vision tower's image_size)


def build_tiny_idefics3(path: str, *, seed: int = 0, longest_edge: int = 2 * TILE, do_image_splitting: bool = True,
                        scale_factor: int = 2, text_overrides: dict[str, Any] | None = None,
                        wide_init: bool = True, **vision_overrides: Any) -> str:
    """Weights (fp32 safetensors), config, tokenizer and processor of a tiny Idefics3; returns path.

    ``longest_edge``: the image processor's resize target (2 tiles a side by default, so a wide image is split
    into 1 x 2 tiles + the global view, a large one into 2 x 2). ``text_overrides`` / ``vision_overrides``:
    the text and vision configs' sizes (benchmarks/vision_ttft.py builds a SmolVLM-256M-shaped model);
    ``wide_init``: weights wider than transformers' init, so greedy tests notice mistakes."""
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        PreTrainedTokenizerFast,
    )

    os.makedirs(path, exist_ok=True)
    save_tokenizer(path)
    tokenizer_file = os.path.join(path, "tokenizer.json")
    tokenizer = Tokenizer.from_file(tokenizer_file)
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in IMAGE_SPECIAL_TOKENS])
    tokenizer.save(tokenizer_file)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    image_token_id = tokenizer.token_to_id("<image>")

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=TILE, patch_size=8)
    vision.update(vision_overrides)
    config = Idefics3Config(
        text_config={**dict(model_type="llama", vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=EOS_ID,
                            pad_token_id=EOS_ID, tie_word_embeddings=False), **(text_overrides or {})},
        vision_config=vision, scale_factor=scale_factor, image_token_id=image_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # wider than the default init: peaked logits, so greedy tests notice mistakes
        for name, param in model.named_parameters() if wide_init else ():
            if not name.endswith("norm.weight") and "layer_norm" not in name and "layernorm" not in name:
                param.normal_(0.0, 0.3 if "embed" in name else 0.1)
    model.save_pretrained(path)

    tile = vision["image_size"]
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": longest_edge},
                                                max_image_size={"longest_edge": tile},
                                                do_image_splitting=do_image_splitting)
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, bos_token="<|im_start|>",
                                           eos_token="<|im_end|>", unk_token="<|endoftext|>")
    image_seq_len = (tile // vision["patch_size"]) ** 2 // scale_factor ** 2
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=hf_tokenizer,
                                  image_seq_len=image_seq_len)
    processor.save_pretrained(path)
    _restore_tokenizer_config(path)
    return path


def _restore_tokenizer_config(path: str) -> None:
    """The processor's save rewrote tokenizer_config.json; keep tests/tiny_models.py's (its chat template)."""
    from tiny_models import CHATML_TEMPLATE, SPECIAL_TOKENS, UNK_ID

    special = {"bos_token": SPECIAL_TOKENS[1], "eos_token": SPECIAL_TOKENS[EOS_ID], "pad_token": SPECIAL_TOKENS[EOS_ID],
               "unk_token": SPECIAL_TOKENS[UNK_ID]}
    _write_json(os.path.join(path, "tokenizer_config.json"),
                {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
                 "clean_up_tokenization_spaces": False, "chat_template": CHATML_TEMPLATE, **special})


def load_hf_processor(path: str) -> Any:
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"))
    image_processor = Idefics3ImageProcessorPil.from_pretrained(path)
    import json

    with open(os.path.join(path, "processor_config.json")) as f:
        image_seq_len = json.load(f).get("image_seq_len")
    return Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=image_seq_len)


def build_tiny_llava(path: str, *, seed: int = 0, strategy: str = "default") -> str:
    """A tiny random LLaVA (CLIP tower: 28 px images of 7 px patches, 3 layers, features of layer -2; a Llama
    text model) with its tokenizer and saved processor (CLIP's PIL image processor: shortest edge 32, center
    crop 28); returns path."""
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import (
        CLIPImageProcessorPil,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    os.makedirs(path, exist_ok=True)
    save_tokenizer(path)
    tokenizer_file = os.path.join(path, "tokenizer.json")
    tokenizer = Tokenizer.from_file(tokenizer_file)
    tokenizer.add_special_tokens([AddedToken("<image>", normalized=False, special=True)])
    tokenizer.save(tokenizer_file)
    config = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
                         hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1,
                         eos_token_id=EOS_ID, pad_token_id=EOS_ID, tie_word_embeddings=False),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=2, image_size=28, patch_size=7, projection_dim=16),
        image_token_index=tokenizer.token_to_id("<image>"), vision_feature_select_strategy=strategy,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight") and "layer_norm" not in name and "layrnorm" not in name:
                param.normal_(0.0, 0.3 if "embed" in name else 0.1)
    model.save_pretrained(path)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 28, "width": 28})
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, bos_token="<|im_start|>",
                                           eos_token="<|im_end|>", unk_token="<|endoftext|>")
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=hf_tokenizer, patch_size=7,
                               vision_feature_select_strategy=strategy, num_additional_image_tokens=1,
                               image_token="<image>")
    processor.save_pretrained(path)
    _restore_tokenizer_config(path)
    return path


def load_hf_llava_processor(path: str, strategy: str = "default") -> Any:
    from transformers import CLIPImageProcessorPil, LlavaProcessor, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"))
    return LlavaProcessor(image_processor=CLIPImageProcessorPil.from_pretrained(path), tokenizer=tokenizer,
                          patch_size=7, vision_feature_select_strategy=strategy, num_additional_image_tokens=1,
                          image_token="<image>")

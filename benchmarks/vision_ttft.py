"""Time to first token of an image + text prompt on a SmolVLM-256M-shaped random model: kvloom vs transformers.

The model has SmolVLM-256M-Instruct's shapes (a 12-layer, 768-wide SigLIP tower on 512-pixel tiles of 16-pixel
patches, pixel shuffle by 4 -> 64 rows a tile, a 30-layer 576-wide Llama) with random weights, and its image
processor (longest edge resized to 2048, 512-pixel tiles): a 512 x 512 image becomes 4 x 4 tiles + a global
view, 17 tiles, 1,088 image tokens. It is built once into ``--model-dir`` (a cache) by tests/tiny_vision.py.

    .venv/bin/python benchmarks/vision_ttft.py [--runs 3] [--dtype float32] [--concurrent 16]
    .venv/bin/python benchmarks/vision_ttft.py --kvloom-dtype bfloat16 --quantization int8   # kvloom's tower in W8A8

Each engine runs in this process in turn, a warm-up first; every timed request carries an image it has not
seen (fresh pixels), so the encoder runs. kvloom's time is ``LLM.generate`` of one token (preprocessing on its
pool included); transformers' is its processor plus ``generate(max_new_tokens=1)``. Then kvloom answers the
same image again (the encoder cache's hit: the vision tower is skipped, the prefix cache holds the prompt's
blocks) and, with ``--concurrent N``, N requests with distinct images at once (their tiles encoded in one batch),
reporting images per second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "<|im_start|>User:<image>Describe this image.<end_of_utterance>\nAssistant:"
# The same image after other words: the prefix cache cannot serve it, the encoder cache can.
OTHER_PROMPT = "<|im_start|>User: Here is a photo.<image>What is in it?<end_of_utterance>\nAssistant:"
TEXT = dict(vocab_size=49280, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5)
VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=512,
              patch_size=16)


def build(model_dir: str) -> None:
    if os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        return
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_vision

    tiny_vision.build_tiny_idefics3(model_dir, longest_edge=2048, scale_factor=4, text_overrides=TEXT,
                                    wide_init=False, **VISION)


def image(seed: int, size: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


def time_kvloom(model_dir: str, dtype: str, runs: int, size: int, concurrent: int, warmup: bool,
                quantization: str | None = None) -> dict:
    from kvloom import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, quantization=quantization, max_model_len=4096,
              max_num_batched_tokens=max(4096, 1200 * concurrent),
              limit_mm_per_prompt={"image": 1})
    one = SamplingParams(temperature=0, max_tokens=1)

    num_prompt_tokens = 0

    def ttft(seed: int, prompt: str = PROMPT) -> float:
        nonlocal num_prompt_tokens
        start = time.perf_counter()
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image(seed, size)}}, one, use_tqdm=False)
        num_prompt_tokens = len(out[0].prompt_token_ids)
        return time.perf_counter() - start

    if warmup:
        ttft(1000)
    times = [ttft(seed) for seed in range(runs)]
    scheduler = llm.llm_engine.scheduler
    before = scheduler.stats()
    again = ttft(0, OTHER_PROMPT)  # the image of the first timed run after other words: an encoder cache hit
    after = scheduler.stats()
    result = {"ttft_s": statistics.median(times), "ttft_runs_s": times, "same_image_other_words_s": again,
              "encoder_cache_hits": after.encoder_cache_hits - before.encoder_cache_hits,
              "encoder_cache_misses": after.encoder_cache_misses - before.encoder_cache_misses,
              "num_prompt_tokens": num_prompt_tokens}
    if concurrent:
        prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": image(2000 + i, size)}} for i in range(concurrent)]
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        seconds = time.perf_counter() - start
        result["concurrent"] = {"requests": concurrent, "seconds": seconds, "images_per_s": concurrent / seconds,
                                "output_tokens_per_s": 16 * concurrent / seconds}
    llm.llm_engine.shutdown()
    return result


def time_transformers(model_dir: str, dtype: str, runs: int, size: int, warmup: bool) -> dict:
    import torch
    from transformers import Idefics3ForConditionalGeneration

    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_vision

    processor = tiny_vision.load_hf_processor(model_dir)
    model = Idefics3ForConditionalGeneration.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()

    def ttft(seed: int) -> float:
        start = time.perf_counter()
        inputs = processor(text=PROMPT, images=[image(seed, size)], return_tensors="pt")
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=1, do_sample=False)
        return time.perf_counter() - start

    if warmup:
        ttft(1000)
    times = [ttft(seed) for seed in range(runs)]
    return {"ttft_s": statistics.median(times), "ttft_runs_s": times, "threads": torch.get_num_threads()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=os.path.expanduser("~/.cache/kvloom/bench/smolvlm-256m-random"))
    parser.add_argument("--dtype", default="float32", help="both engines' dtype (float32 or bfloat16)")
    parser.add_argument("--kvloom-dtype", default=None, help="kvloom's dtype where it differs (e.g. bfloat16)")
    parser.add_argument("--quantization", default=None, choices=["int8"],
                        help="kvloom's quantization (int8: the tower's, the connector's and the text model's "
                        "projections in int8 rows, W8A8 on a CPU)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-warmup", action="store_true", help="time from the first request (each is minutes "
                        "long on a small CPU; the warm-up's own costs are seconds)")
    parser.add_argument("--image-size", type=int, default=512)
    parser.add_argument("--concurrent", type=int, default=0, help="then N requests with distinct images at once")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()
    build(args.model_dir)
    results = {"image": f"{args.image_size}x{args.image_size}", "dtype": args.dtype,
               "kvloom_dtype": args.kvloom_dtype or args.dtype, "kvloom_quantization": args.quantization,
               "kvloom": time_kvloom(args.model_dir, args.kvloom_dtype or args.dtype, args.runs, args.image_size,
                                     args.concurrent, not args.no_warmup, args.quantization)}
    if not args.skip_transformers:
        results["transformers"] = time_transformers(args.model_dir, args.dtype, args.runs, args.image_size,
                                                    not args.no_warmup)
        results["speedup"] = results["transformers"]["ttft_s"] / results["kvloom"]["ttft_s"]
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""int8 against bf16 on the default model: greedy agreement on real chat prompts, and perplexity.

The study's command is ``benchmarks/int8_quality.py``; ``measure`` and ``compare`` live here because
``tests/e2e/test_int8.py`` bounds the default model's int8 quality with them.

- Greedy: 32 chat prompts (below, written for this test) through the chat template, 32 new tokens each
  at temperature 0, once with bf16 weights and once with int8; reported: the share of prompts whose
  tokens are identical (all of the first 32, or up to the shorter one's end of sequence) and the mean
  length of the identical prefix.
- Perplexity: the first ``--ppl-tokens`` tokens of Python's own reference documentation (the
  ``pydoc_data`` package that ships with CPython: real English prose with code), scored in windows of
  ``--window`` tokens through prompt logprobs; reported: both perplexities and their ratio.
- The int8 model has the engine's default settings unless told: ``--int8-activations off`` for
  weight-only products (``on``: W8A8 for batches of 2+ rows on the CPU, which every measurement here
  is), ``--smoothing-alpha`` for SmoothQuant's alpha (``none``: no smoothing; kvloom/layers/smoothing.py),
  ``--gguf-blocks off`` to re-quantize a GGUF's Q8_0 weights per row rather than keep their blocks.
- Memory: the bytes of the weights each model holds (parameters, int8 buffers and packed copies), and
  the resident memory of a fresh process after loading each (VmRSS; VmHWM is the peak during the load).
"""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys
import time
from typing import Any

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about autumn leaves.",
    "How do I reverse a list in Python?",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and French.",
    "What are the main causes of inflation?",
    "Write a short thank-you note to a teacher.",
    "How many legs does a spider have?",
    "Explain what a black hole is to a child.",
    "List four healthy breakfast ideas.",
    "What does HTTP stand for?",
    "Describe the water cycle briefly.",
    "How can I improve my sleep?",
    "What is a prime number? Give two examples.",
    "Write one sentence that uses the word 'serendipity'.",
    "What is the boiling point of water at sea level?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "What is machine learning?",
    "Give me a simple recipe for pancakes.",
    "Why do cats purr?",
    "What is the largest planet in our solar system?",
    "How do vaccines work?",
    "Write a limerick about a cat who loves coffee.",
    "What is the Pythagorean theorem?",
    "Name three famous painters and one work by each.",
    "How do I make a cup of green tea?",
    "What should I pack for a weekend hiking trip?",
    "Explain the difference between a list and a tuple in Python.",
]


def reference_text() -> str:
    """Real prose that ships with Python: the pydoc topics, in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def identical_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def greedy_tokens(llm: Any, max_tokens: int) -> list[list[int]]:
    from kvloom import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in CHAT_PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def perplexity(llm: Any, token_ids: list[int], window: int, score_from: int = 1, whole_windows: bool = False) -> float:
    """exp of the mean negative log-likelihood of the tokens at positions ``score_from``.. of each window.

    The default scores every token after the first of each window (the last window may be short).
    llama.cpp's ``llama-perplexity -c W`` is ``score_from=W // 2 + 1, whole_windows=True``: whole windows
    only, each token of the second half scored with at least W/2 tokens of context."""
    from kvloom import SamplingParams

    ends = len(token_ids) - window + 1 if whole_windows else len(token_ids) - 1
    windows = [token_ids[i:i + window] for i in range(0, max(ends, 0), window)]
    windows = [w for w in windows if len(w) > score_from]
    if not windows:
        raise ValueError(f"{len(token_ids)} tokens make no window of {window} with tokens from position {score_from}")
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    total, count = 0.0, 0
    for window_ids, output in zip(windows, outputs):
        for position in range(score_from, len(window_ids)):
            total -= output.prompt_logprobs[position][window_ids[position]].logprob
            count += 1
    return math.exp(total / count)


def weight_bytes(llm: Any) -> int:
    """Bytes of every weight tensor the model holds (parameters, int8 buffers, packed copies), each once."""
    import torch

    model = llm.llm_engine.executor.driver.model
    seen: dict[int, int] = {}

    def add(tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()

    for param in model.parameters():
        add(param)
    for module in model.modules():
        for attr in ("qweight", "weight_scale"):
            add(getattr(module, attr, None))
        packed = getattr(module, "packed", None)
        if packed is not None:
            for value in vars(packed).values():
                add(value)
    rotary = getattr(model, "rotary", None) or getattr(model.layers[0].self_attn, "rotary", None)
    for buffer in (rotary.buffers() if rotary is not None else ()):
        seen.pop(buffer.untyped_storage().data_ptr(), None)  # a position table, not a weight
    return sum(seen.values())


_RSS_CHILD = """
import json, sys
from kvloom import LLM
quantization, backend = sys.argv[2] or None, json.loads(sys.argv[3])
llm = LLM(model=sys.argv[1], dtype="bfloat16", quantization=quantization or "none", max_model_len=256,
          kv_cache_memory="64MiB", override_backend_config=backend if quantization else None)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({key: int(status[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}))
"""


def process_memory(model: str, quantization: str | None, backend: dict[str, Any]) -> dict[str, int]:
    """VmRSS / VmHWM in bytes of a fresh process that loaded the model (64 MiB of KV cache)."""
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, model, quantization or "", json.dumps(backend)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def int8_backend(lm_head: bool, activations: str | None = None, smoothing_alpha: str | None = None,
                 gguf_blocks: str | None = None) -> dict[str, Any]:
    """override_backend_config of an int8 model: the head, and W8A8 ("on" / "off"), smoothing's alpha
    (a number or "none") and keeping Q8_0 blocks ("on" / "off") where given (else the engine's defaults)."""
    backend: dict[str, Any] = {"quantize_lm_head": lm_head}
    if gguf_blocks is not None:
        backend["int8_gguf_blocks"] = gguf_blocks == "on"
    if activations is not None:
        backend["int8_activations"] = activations == "on"
    if smoothing_alpha is not None:
        backend["int8_smoothing_alpha"] = None if smoothing_alpha == "none" else float(smoothing_alpha)
    return backend


def measure(model: str, quantization: str | None, max_tokens: int, ppl_tokens: int, window: int,
            lm_head: bool, activations: str | None = None, smoothing_alpha: str | None = None,
            gguf_blocks: str | None = None) -> dict[str, Any]:
    from kvloom import LLM
    from kvloom.layers.quantization import keeps_q8_0_blocks
    from kvloom.loader.weights import resolve_model

    overrides = int8_backend(lm_head, activations, smoothing_alpha, gguf_blocks) if quantization else None
    start = time.perf_counter()
    # The baseline is bf16: a 4-bit GGUF dequantized ("none"), not kept 4-bit as by default.
    llm = LLM(model=model, dtype="bfloat16", quantization=quantization or "none",
              max_model_len=max(window + 1, 256), override_backend_config=overrides)
    load_s = time.perf_counter() - start
    text_ids = llm.get_tokenizer().encode(reference_text())[:ppl_tokens]
    backend = llm.llm_engine.config.backend
    blocks = bool(quantization) and keeps_q8_0_blocks(resolve_model(model), backend)
    result = {"quantization": quantization or "bf16", "load_s": round(load_s, 2),
              "int8_activations": bool(quantization) and backend.int8_activations, "q8_0_blocks": blocks,
              "smoothing_alpha": (backend.int8_smoothing_alpha if quantization and backend.int8_activations
                                  and not blocks else None),
              "weight_bytes": weight_bytes(llm), "tokens": greedy_tokens(llm, max_tokens),
              "perplexity": perplexity(llm, text_ids, window), "ppl_tokens": len(text_ids)}
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    return result


def compare(bf16: dict[str, Any], int8: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    prefixes = [identical_prefix(a, b) for a, b in zip(bf16["tokens"], int8["tokens"])]
    identical = [a == b or p >= max_tokens for a, b, p in zip(bf16["tokens"], int8["tokens"], prefixes)]
    return {
        "prompts": len(prefixes),
        "identical_share": sum(identical) / len(identical),
        "mean_identical_prefix": sum(prefixes) / len(prefixes),
        "perplexity_bf16": round(bf16["perplexity"], 4),
        "perplexity_int8": round(int8["perplexity"], 4),
        "perplexity_ratio": round(int8["perplexity"] / bf16["perplexity"], 4),
        "ppl_tokens": bf16["ppl_tokens"],
        "weight_bytes_bf16": bf16["weight_bytes"],
        "weight_bytes_int8": int8["weight_bytes"],
        "weight_bytes_ratio": round(int8["weight_bytes"] / bf16["weight_bytes"], 4),
    }

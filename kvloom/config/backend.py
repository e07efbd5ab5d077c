"""Backend knobs: ``override_backend_config`` (the seeds' ``override_neuron_config``), a dict or JSON.

They tune how the platform runs the model (attention backend, CPU threads, shape buckets, int8 details);
``KVLOOM_*`` environment variables set some of them, and an explicit key wins over the variable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from kvloom import envs
from kvloom.config.compat import canonical_quantization
from kvloom.ops import ATTENTION_BACKENDS

# The data-parallel router's policies (backend knob data_parallel_routing; kvloom/engine/data_parallel/router.py).
DATA_PARALLEL_ROUTING = ("prefix", "least_loaded", "round_robin")

# The keys that make shapes padded to buckets (CUDA graphs); kvloom's CPU path runs every shape eagerly.
BUCKET_KEYS = ("enable_bucketing", "token_gen_buckets", "context_length_buckets")


@dataclass
class BackendConfig:
    """Backend knobs, set through ``override_backend_config``."""

    # "auto" picks the fast path of the platform; "reference" the plain-torch one.
    attention_backend: str = "auto"
    # torch intra-op threads on the CPU (None: all cores).
    num_threads: int | None = None
    # Shape buckets (the seeds' enable_bucketing): decode batches padded to a token-generation bucket
    # run as one captured CUDA graph each; prefill token counts padded to a context-length bucket.
    # None: on CUDA, on; on the CPU, off (the C++ kernels take any shape at no cost).
    enable_bucketing: bool | None = None
    token_gen_buckets: list[int] | None = None  # None: 1, 2, 4, 8, 16, 24, 32, ... up to max_num_seqs
    context_length_buckets: list[int] | None = None  # None: prefills run at their own length (eager)
    # When each decode bucket's CUDA graph is captured: "lazy", the first time a step needs it (a start captures
    # none); "start", all of them before the engine is ready (no step pays a capture).
    graph_capture: str = "lazy"
    # Where compiled kernels are kept across restarts (None: KVLOOM_CACHE_DIR/compiled).
    compiled_artifacts: str | None = None
    # int8 weight storage, the seeds' spelling (NxD's quantized / quantization_dtype; KVLOOM_QUANT_DTYPE=s8):
    # the same as the engine argument quantization="int8".
    quantized: bool = False
    quantization_dtype: str = "int8"
    # With int8 weights: the LM head too (off by default: it is the layer whose error shows most).
    quantize_lm_head: bool = False
    # With int8 weights on the CPU: quantize activations per token too (W8A8 on VNNI) for batches of 2+
    # rows: 1.4-1.9x faster products than weight-only, at a perplexity cost (SmolLM2: +3.3% against +0.3%
    # weight-only) that smoothing (below) cuts to +0.7%. False: weight-only products.
    int8_activations: bool = True
    # With a GGUF's Q4_0 / Q4_1 weights kept on a CPU with AMX-BF16 and bf16 activations: "bf16" keeps the activations
    # bf16 and takes the table product on AMX-BF16 tiles at every row count (one formula whatever the batch; SmolLM2
    # on 2 cores of an AMX Xeon: 1.41x "int8" at 64 sequences, 1.05x at 8, 0.72x at one); "int8": llama.cpp's product
    # (activations in int8 per 32). None: KVLOOM_Q4_ACTIVATIONS, else "int8".
    q4_activations: str | None = None
    # With int8 activations on the CPU: SmoothQuant's migration strength alpha in [0, 1] (None: no smoothing).
    # Per input channel s = max|X|^alpha / max|W|^(1 - alpha), calibrated at quantize time and folded into
    # the weights (kvloom/layers/smoothing.py). Unused without int8_activations or off the CPU, and skipped
    # (with a log line) when a GGUF's Q8_0 blocks are kept (below): their product needs no smoothing.
    int8_smoothing_alpha: float | None = 0.65
    # With int8 weights and int8 activations: a GGUF's Q8_0 projections keep their own int8 codes and block
    # scales (one per 32 inputs, no re-quantization), multiplied by activations quantized per (token, block)
    # as llama.cpp does; smoothing is then skipped. False: Q8_0 weights are re-quantized per row (and
    # smoothed) like any other. (CUDA has no block kernel: there the blocks become per-row int8 at load.)
    int8_gguf_blocks: bool = True
    # With quantization="gguf": a GGUF's Q5_0, Q5_1 and Q5_K projections kept in their code blocks (on the CPU the 4-bit
    # product's kernel with a plane of fifth bits: 6 bits a weight with the scales, 1.2-1.6x bf16's speed,
    # docs/quantization.md) instead of dequantized at load. False dequantizes them, for comparison.
    gguf_5bit_blocks: bool = True
    # With quantization="gguf": a GGUF's Q6_K projections (Q4_K_M's and Q5_K_M's v and down in half the layers, a
    # Q6_K file's all) kept as 6-bit codes with a scale per 16 inputs (the same kernel, two bit planes) instead of
    # dequantized at load. False dequantizes them.
    gguf_6bit_blocks: bool = True
    # With quantization="gguf" on a CPU: a GGUF's Q4_K and Q6_K projections kept in the file's own super-blocks (4.5
    # and 6.5625 bits a weight) for the k-quant product (ops/q4k.py; the same results bit for bit as the code-block
    # product it replaces, which held 4.625 and 6.625, but for a layer of both: q and k beside a Q6_K v, which that
    # held at 7.125). False decodes them into code blocks (ops/q4.py), for comparison. None (the default) is on at
    # every ISA level (on AVX-512 with VNNI kernels of its own, and AMX-INT8 tiles from 16 rows: csrc/gemm_q4k.cpp).
    gguf_super_blocks: bool | None = None
    # With a checkpoint kept in its blocks (quantization "gguf", "gptq", "awq"): the LM head's table (and a tied
    # embedding's, SmolLM2's Q8_0 one) re-quantized at load to 4- or 5-bit code blocks, a scale and an offset per
    # 32 inputs (Q4_1's / Q5_1's), multiplied by the 4-bit product. None keeps the file's values. It changes
    # them: docs/quantization.md has the perplexity and the speed and memory it buys.
    requantize_lm_head: int | None = None
    # With data_parallel_size >= 2: how the router picks a replica for each request. "prefix": the one holding the
    # longest cached prefix of the prompt, within a load cap, else the least loaded; "least_loaded"; "round_robin"
    # (kvloom/engine/data_parallel/router.py).
    data_parallel_routing: str = "prefix"

    @classmethod
    def from_overrides(cls, overrides: dict[str, Any] | str | None) -> BackendConfig:
        """Defaults, then KVLOOM_* variables, then the explicit overrides (highest)."""
        values: dict[str, Any] = {}
        if envs.get("KVLOOM_NUM_THREADS"):
            values["num_threads"] = envs.get_int("KVLOOM_NUM_THREADS")
        for key in ("token_gen_buckets", "context_length_buckets"):
            buckets = envs.get_int_list(f"KVLOOM_{key.upper()}")
            if buckets is not None:
                values[key] = buckets
        if envs.get("KVLOOM_COMPILED_ARTIFACTS"):
            values["compiled_artifacts"] = envs.get("KVLOOM_COMPILED_ARTIFACTS")
        if envs.get("KVLOOM_QUANT_DTYPE"):
            values["quantized"] = True
            values["quantization_dtype"] = envs.get("KVLOOM_QUANT_DTYPE")
        values.update(parse_overrides(overrides))
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - allowed)
        if unknown:
            raise ValueError(f"override_backend_config: unknown key(s) {unknown}; "
                             f"allowed: {sorted(allowed)}")
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        """Each key's type and range (ValueError naming the key); normalizes buckets and dtype names."""
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"override_backend_config: attention_backend must be one of "
                             f"{list(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if self.num_threads is not None and (not isinstance(self.num_threads, int)
                                             or isinstance(self.num_threads, bool) or self.num_threads < 1):
            raise ValueError(f"override_backend_config: num_threads must be a positive integer, "
                             f"got {self.num_threads!r}")
        if self.enable_bucketing is not None and not isinstance(self.enable_bucketing, bool):
            raise ValueError(f"override_backend_config: enable_bucketing must be true or false, "
                             f"got {self.enable_bucketing!r}")
        for name in ("token_gen_buckets", "context_length_buckets"):
            buckets = getattr(self, name)
            if buckets is None:
                continue
            if (not isinstance(buckets, list) or not buckets
                    or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in buckets)):
                raise ValueError(f"override_backend_config: {name} must be a non-empty list of positive "
                                 f"integers, e.g. [1, 2, 4, 8], got {buckets!r}")
            setattr(self, name, sorted(set(buckets)))
        if self.graph_capture not in ("lazy", "start"):
            raise ValueError(f"override_backend_config: graph_capture must be 'lazy' or 'start', "
                             f"got {self.graph_capture!r}")
        if self.compiled_artifacts is not None and not isinstance(self.compiled_artifacts, str):
            raise ValueError(f"override_backend_config: compiled_artifacts must be a folder path, "
                             f"got {self.compiled_artifacts!r}")
        for name in ("quantized", "quantize_lm_head", "int8_activations", "int8_gguf_blocks",
                     "gguf_5bit_blocks", "gguf_6bit_blocks"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"override_backend_config: {name} must be true or false, got {getattr(self, name)!r}")
        if self.q4_activations not in (None, "int8", "bf16"):
            raise ValueError(f"override_backend_config: q4_activations must be 'int8', 'bf16' or None "
                             f"(KVLOOM_Q4_ACTIVATIONS, else int8), got {self.q4_activations!r}")
        if self.gguf_super_blocks is not None and not isinstance(self.gguf_super_blocks, bool):
            raise ValueError(f"override_backend_config: gguf_super_blocks must be true, false or None (where "
                             f"measured), got {self.gguf_super_blocks!r}")
        bits = self.requantize_lm_head
        if bits is not None and (isinstance(bits, bool) or bits not in (4, 5)):
            raise ValueError(f"override_backend_config: requantize_lm_head must be 4 or 5 (bits of the LM head's "
                             f"code blocks) or None (the checkpoint's own values), got {bits!r}")
        if self.data_parallel_routing not in DATA_PARALLEL_ROUTING:
            raise ValueError(f"override_backend_config: data_parallel_routing must be one of "
                             f"{list(DATA_PARALLEL_ROUTING)}, got {self.data_parallel_routing!r}")
        alpha = self.int8_smoothing_alpha
        if alpha is not None:
            if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
                raise ValueError(f"override_backend_config: int8_smoothing_alpha must be a number in [0, 1] "
                                 f"(SmoothQuant's alpha, e.g. 0.5) or None, got {alpha!r}")
            self.int8_smoothing_alpha = float(alpha)
        self.quantization_dtype = canonical_quantization(self.quantization_dtype,
                                                         "override_backend_config: quantization_dtype")

    def sets_buckets(self) -> bool:
        """Whether bucketing was asked for (turned on, or buckets named) rather than left to the platform."""
        return self.enable_bucketing is True or (self.enable_bucketing is None and (
            self.token_gen_buckets is not None or self.context_length_buckets is not None))


def parse_overrides(overrides: dict[str, Any] | str | None) -> dict[str, Any]:
    """A dict, a JSON object, or the seeds' ``key:value,key:value`` shorthand."""
    if overrides is None or overrides == "":
        return {}
    if isinstance(overrides, dict):
        return dict(overrides)
    if not isinstance(overrides, str):
        raise ValueError(f"override_backend_config must be a dict or a JSON string, "
                         f"got {type(overrides).__name__}")
    text = overrides.strip()
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        parsed = None
        if ":" in text and not text.startswith("{"):
            parsed = {}
            for item in text.split(","):
                key, _, raw = item.partition(":")
                try:
                    parsed[key.strip()] = json.loads(raw.strip().lower()
                                                     if raw.strip() in ("True", "False") else raw)
                except json.JSONDecodeError:
                    parsed[key.strip()] = raw.strip()
    if not isinstance(parsed, dict):
        raise ValueError(f"override_backend_config must be a JSON object such as "
                         f'\'{{"attention_backend": "reference"}}\', got {overrides!r}')
    return parsed

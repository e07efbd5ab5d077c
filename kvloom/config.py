"""The one engine configuration.

``EngineConfig`` is a dataclass that validates itself. ``LLM(**kwargs)``, the CLI flags of
``kvloom serve`` / ``kvloom generate`` and the server all come from its fields, so a knob is
declared once. Backend knobs (the attention backend, CPU threads) live in
``BackendConfig`` and are set through ``override_backend_config`` (a dict, or JSON on the command
line) — the seeds' ``override_neuron_config``; documented ``KVLOOM_*`` variables are aliases.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from kvloom import cpu_affinity, envs
from kvloom.ops import ATTENTION_BACKENDS

if TYPE_CHECKING:
    import torch

    from kvloom.loader.model_config import ModelConfig
    from kvloom.loader.weights import ModelSource

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16"}
# Weight quantization names: vLLM's "int8" and the seeds' "s8" (NEURON_QUANT_DTYPE) mean the same.
QUANTIZATION_ALIASES = {"int8": "int8", "s8": "int8"}
EXECUTOR_BACKENDS = ("mp", "ray")


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
        if self.compiled_artifacts is not None and not isinstance(self.compiled_artifacts, str):
            raise ValueError(f"override_backend_config: compiled_artifacts must be a folder path, "
                             f"got {self.compiled_artifacts!r}")
        for name in ("quantized", "quantize_lm_head", "int8_activations", "int8_gguf_blocks"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"override_backend_config: {name} must be true or false, got {getattr(self, name)!r}")
        alpha = self.int8_smoothing_alpha
        if alpha is not None:
            if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
                raise ValueError(f"override_backend_config: int8_smoothing_alpha must be a number in [0, 1] "
                                 f"(SmoothQuant's alpha, e.g. 0.5) or None, got {alpha!r}")
            self.int8_smoothing_alpha = float(alpha)
        dtype = QUANTIZATION_ALIASES.get(str(self.quantization_dtype).lower())
        if dtype is None:
            raise ValueError(f"override_backend_config: quantization_dtype must be one of "
                             f"{sorted(QUANTIZATION_ALIASES)}, got {self.quantization_dtype!r}")
        self.quantization_dtype = dtype


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``): which proposer, and how many tokens it drafts.

    ``ngram`` looks drafts up in the request's own tokens (the scheduler proposes them); ``draft_model``,
    ``eagle`` and ``eagle3`` run a second model (``model``) in the model runner after each step.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 1
    model: str | None = None  # the draft model or EAGLE head (a HF directory or .gguf file)
    max_model_len: int | None = None  # no drafts proposed at or past this position (the draft's own limit)
    # No drafts in a step while this many requests (or more) are running (vLLM's key). Without it the
    # measured cost of a verified token decides (spec_decode/adaptive.py), which at large batches is the same.
    disable_by_batch_size: int | None = None
    # "int8": the draft model's or EAGLE head's projections (and a head's own LM head) stored as int8 per row,
    # quantized as loaded: a guess at batch 1 reads half the bytes.
    quantization: str | None = None

    METHODS = ("ngram", "draft_model", "eagle", "eagle3")
    MODEL_METHODS = ("draft_model", "eagle", "eagle3")
    NOT_YET = ("medusa", "mtp")

    @property
    def uses_draft_model(self) -> bool:
        """True when the runner proposes the drafts (with a second model), not the scheduler."""
        return self.method in self.MODEL_METHODS

    @classmethod
    def from_engine_args(cls, config: dict[str, Any] | str | None, speculative_model: str | None,
                         num_speculative_tokens: int | None, speculative_max_model_len: int | None = None,
                         speculative_disable_by_batch_size: int | None = None) -> SpeculativeConfig | None:
        """vLLM's dict / JSON, or the seeds' ``speculative_model`` + ``num_speculative_tokens`` (+
        ``speculative_max_model_len``, ``speculative_disable_by_batch_size``); None: off."""
        if isinstance(config, str):
            try:
                config = json.loads(config) if config.strip() else None
            except json.JSONDecodeError:
                raise ValueError(f"speculative_config must be a JSON object such as "
                                 f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}', "
                                 f"got {config!r}") from None
        if config is not None and not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict or a JSON object, got {type(config).__name__}")
        values = dict(config or {})
        if speculative_model is not None:
            if values:
                raise ValueError("give speculative_config or speculative_model, not both")
            if speculative_model == "[ngram]":
                values["method"] = "ngram"
            else:
                values["model"] = speculative_model
        if num_speculative_tokens is not None:
            if not values:
                raise ValueError("num_speculative_tokens needs a speculative method: speculative_model='[ngram]' "
                                 "or a draft model's path, or speculative_config={'method': ..., ...}")
            values.setdefault("num_speculative_tokens", num_speculative_tokens)
        if speculative_max_model_len is not None:
            if not values:
                raise ValueError("speculative_max_model_len needs a speculative method (speculative_model or "
                                 "speculative_config)")
            values.setdefault("max_model_len", speculative_max_model_len)
        if speculative_disable_by_batch_size is not None:
            if not values:
                raise ValueError("speculative_disable_by_batch_size needs a speculative method (speculative_model "
                                 "or speculative_config)")
            values.setdefault("disable_by_batch_size", speculative_disable_by_batch_size)
        if not values:
            return None
        allowed = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
                   "max_model_len", "disable_by_batch_size", "quantization"}
        unknown = sorted(set(values) - allowed)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
        model = values.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError(f"speculative_config: model must be a path to a draft model or EAGLE head, got {model!r}")
        method = values.get("method")
        if method is None and model is not None:
            method = _method_from_model_name(model)  # vLLM's shorthand: a model without a method
        if method in cls.NOT_YET:
            raise ValueError(f"speculative_config: method {method!r} is not supported yet; supported: "
                             f"{list(cls.METHODS)}")
        if method not in cls.METHODS:
            raise ValueError(f"speculative_config: method must be one of {list(cls.METHODS)}, got {method!r}")
        k = values.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        max_len = values.get("max_model_len")
        if max_len is not None and (not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1):
            raise ValueError(f"speculative_config: max_model_len (speculative_max_model_len) must be an integer "
                             f">= 1, got {max_len!r}")
        disable = values.get("disable_by_batch_size")
        if disable is not None and (not isinstance(disable, int) or isinstance(disable, bool) or disable < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size (speculative_disable_by_batch_size) must "
                             f"be an integer >= 1, got {disable!r}")
        quantization = values.get("quantization")
        if quantization is not None and quantization != "int8":
            raise ValueError(f"speculative_config: quantization must be 'int8' (the draft's projections stored as "
                             f"int8 per row) or absent, got {quantization!r}")
        if method != "ngram":
            if model is None:
                raise ValueError(f"speculative_config: method {method!r} needs 'model', the path of the "
                                 f"{'draft model' if method == 'draft_model' else 'EAGLE head'}")
            for key in ("prompt_lookup_max", "prompt_lookup_min"):
                if key in values:
                    raise ValueError(f"speculative_config: {key} is for method 'ngram' only, not {method!r}")
            return cls(method, k, model=model, max_model_len=max_len, disable_by_batch_size=disable,
                       quantization=quantization)
        if model is not None or quantization is not None:
            raise ValueError(f"speculative_config: method 'ngram' takes no {'model' if model else 'quantization'!r} "
                             f"(it looks drafts up in the request's own tokens)")
        lookup_max = values.get("prompt_lookup_max", k)
        lookup_min = values.get("prompt_lookup_min", 1)
        for name, value in (("prompt_lookup_max", lookup_max), ("prompt_lookup_min", lookup_min)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
        if lookup_min > lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lookup_min}) must not exceed "
                             f"prompt_lookup_max ({lookup_max})")
        return cls(method, k, lookup_max, lookup_min, max_model_len=max_len, disable_by_batch_size=disable)


def _method_from_model_name(model: str) -> str:
    """vLLM's guess when only a model is named: an EAGLE-3 or EAGLE head by its name, else a draft model."""
    name = model.lower()
    if "eagle3" in name or "eagle-3" in name:
        return "eagle3"
    if "eagle" in name:
        return "eagle"
    return "draft_model"


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


def parse_memory(value: int | float | str | None) -> int | None:
    """Bytes from an int, or a string such as '2GiB', '512MiB', '1.5GB'."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"kv_cache_memory must be a byte count or a size like '2GiB', got {value!r}")
    if isinstance(value, (int, float)):
        number = int(value)
    else:
        match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B?|B)?\s*", str(value), re.IGNORECASE)
        if not match:
            raise ValueError(f"kv_cache_memory must be a byte count or a size like '2GiB', "
                             f"got {value!r}")
        unit = (match.group(2) or "B").upper().rstrip("B").rstrip("I")
        scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
        number = int(float(match.group(1)) * scale)
    if number <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {value!r}")
    return number


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class EngineConfig:
    """What ``LLM(...)`` and ``kvloom serve`` accept, with vLLM's names and meanings."""

    model: str = field(default=DEFAULT_MODEL, metadata=_help(
        "a HF model directory, a .gguf file, or 'SmolLM2-135M-Instruct' (the default model)"))
    tokenizer: str | None = field(default=None, metadata=_help(
        "tokenizer directory or .gguf file (default: the model's)"))
    dtype: str = field(default="auto", metadata=_help(
        "weight and activation dtype: auto, float32, bfloat16, float16 (auto: bfloat16 on the CPU "
        "when the model is stored in 16 bits, else the checkpoint's dtype)"))
    device: str = field(default="auto", metadata=_help("auto, cpu, cuda or cuda:N"))
    seed: int = field(default=0, metadata=_help("seed of the global sampling generator"))
    max_model_len: int | None = field(default=None, metadata=_help(
        "longest sequence (prompt + output) in tokens (default: the model's context length)"))
    max_num_seqs: int = field(default=256, metadata=_help("most requests in one batch"))
    max_num_batched_tokens: int | None = field(default=None, metadata=_help(
        "most tokens computed in one step (default: max(2048, max_model_len) capped at 8192)"))
    block_size: int = field(default=16, metadata=_help(
        "tokens per KV cache block; block_size == max_model_len gives one contiguous block per "
        "sequence"))
    enable_prefix_caching: bool = field(default=True, metadata=_help(
        "reuse the KV blocks of shared prompt prefixes"))
    kv_cache_memory: int | str | None = field(default=None, metadata=_help(
        "bytes for the KV cache, e.g. 2GiB (default: 2 GiB on the CPU, 90%% of free memory on "
        "CUDA, never less than one full-length sequence)"))
    gpu_memory_utilization: float = field(default=0.9, metadata=_help(
        "fraction of GPU memory kvloom may use on CUDA"))
    tensor_parallel_size: int = field(default=1, metadata=_help("number of tensor-parallel ranks"))
    distributed_executor_backend: str = field(default="mp", metadata=_help(
        "how tensor-parallel ranks run: 'mp' (processes on this machine) or 'ray' (Ray actors, across machines)"))
    data_parallel_size: int = field(default=1, metadata=_help(
        "engine replicas behind one server, each with its own tensor-parallel group"))
    # None: KVLOOM_CPU_OMP_THREADS_BIND, else "auto" (validate() settles it, so an explicit "auto" wins too).
    cpu_omp_threads_bind: str | None = field(default=None, metadata=_help(
        "on the CPU, the cores of each engine process on this host (tensor-parallel ranks, data-parallel "
        "replicas; vLLM's VLLM_CPU_OMP_THREADS_BIND): 'auto' (several processes: equal shares of the usable "
        "cores), 'nobind', or one CPU list per process separated by '|', e.g. '0-3|4-7' "
        "(default: KVLOOM_CPU_OMP_THREADS_BIND, else auto)"))
    quantization: str | None = field(default=None, metadata=_help(
        "weight quantization: 'int8' (per-channel int8 weights, quantized at load; 's8' is the seeds' name)"))
    quantized_checkpoint_path: str | None = field(default=None, metadata=_help(
        "with quantization: a safetensors file of the quantized weights, written at the first load and "
        "read (without quantizing again) at later ones"))
    enforce_eager: bool = field(default=False, metadata=_help(
        "run every step eagerly: no CUDA graphs for the decode buckets (CUDA only; the CPU always runs eagerly)"))
    override_backend_config: dict[str, Any] | str | None = field(default=None, metadata=_help(
        "backend knobs as JSON, e.g. '{\"attention_backend\": \"reference\"}'"))
    trust_remote_code: bool = field(default=False, metadata=_help(
        "accepted for vLLM compatibility; kvloom never runs model code from a checkpoint"))

    speculative_config: dict[str, Any] | str | None = field(default=None, metadata=_help(
        "speculative decoding as vLLM's JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4}'"))
    speculative_model: str | None = field(default=None, metadata=_help(
        "the seeds' spelling: a draft model's path, or '[ngram]' for n-gram prompt lookup (with "
        "--num-speculative-tokens)"))
    num_speculative_tokens: int | None = field(default=None, metadata=_help(
        "draft tokens proposed per step (the seeds' spelling, with --speculative-model)"))
    speculative_max_model_len: int | None = field(default=None, metadata=_help(
        "no drafts are proposed at or past this many tokens (the seeds' spelling; the draft model's own "
        "context length caps it too)"))
    speculative_disable_by_batch_size: int | None = field(default=None, metadata=_help(
        "no drafts while this many requests or more are running (the seeds' spelling of speculative_config's "
        "disable_by_batch_size; without it the measured cost of verifying decides)"))

    backend: BackendConfig = field(init=False, repr=False, default_factory=BackendConfig)
    speculative: SpeculativeConfig | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a path or a model name, got {self.model!r}")
        dtype = str(self.dtype).replace("torch.", "").lower()
        dtype = _DTYPE_ALIASES.get(dtype, dtype)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {self.dtype!r}")
        self.dtype = dtype
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device {self.device!r} is not supported: kvloom runs on 'cpu' or "
                             f"'cuda' (or 'auto'); hardware such as 'neuron' is not available here")
        _check_int("seed", self.seed, minimum=0)
        _check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        _check_int("block_size", self.block_size, minimum=1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, minimum=1)
        if self.max_num_batched_tokens is not None:
            _check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        _check_int("data_parallel_size", self.data_parallel_size, minimum=1)
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {list(EXECUTOR_BACKENDS)}, "
                             f"got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray":
            from kvloom.ray_cluster import INSTALL_HINT, ray_installed

            if not ray_installed():
                raise ValueError(f"distributed_executor_backend='ray' needs Ray, which is not installed; "
                                 f"{INSTALL_HINT}")
        self._settle_cpu_omp_threads_bind()
        self.kv_cache_memory = parse_memory(self.kv_cache_memory)
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not (
                0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization!r}")
        for name in ("enable_prefix_caching", "enforce_eager", "trust_remote_code"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        self.backend = BackendConfig.from_overrides(self.override_backend_config)
        if self.quantization is not None:
            quantization = QUANTIZATION_ALIASES.get(str(self.quantization).lower())
            if quantization is None:
                raise ValueError(f"quantization must be one of {sorted(QUANTIZATION_ALIASES)} or None, "
                                 f"got {self.quantization!r}")
            self.quantization = quantization
        elif self.backend.quantized:
            self.quantization = self.backend.quantization_dtype
        if self.quantized_checkpoint_path is not None and self.quantization is None:
            raise ValueError("quantized_checkpoint_path needs quantization='int8' (or override_backend_config "
                             "{\"quantized\": true})")
        self.speculative = SpeculativeConfig.from_engine_args(self.speculative_config, self.speculative_model,
                                                              self.num_speculative_tokens,
                                                              self.speculative_max_model_len,
                                                              self.speculative_disable_by_batch_size)

    def _settle_cpu_omp_threads_bind(self) -> None:
        """The argument, else KVLOOM_CPU_OMP_THREADS_BIND, else "auto"; its syntax checked (whether its
        cores exist and its lists match the engine processes is checked at start, cpu_affinity.plan)."""
        if self.cpu_omp_threads_bind is None:
            variable = envs.get("KVLOOM_CPU_OMP_THREADS_BIND")
            try:
                cpu_affinity.parse_setting(variable or cpu_affinity.AUTO)
            except ValueError as error:
                raise ValueError(f"KVLOOM_CPU_OMP_THREADS_BIND: {error}") from None
            self.cpu_omp_threads_bind = variable or cpu_affinity.AUTO
        if cpu_affinity.parse_setting(self.cpu_omp_threads_bind) is None:  # a keyword: one spelling
            self.cpu_omp_threads_bind = self.cpu_omp_threads_bind.strip().lower()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        allowed = sorted(cls.field_names())
        unknown = sorted(set(kwargs) - set(allowed))
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; allowed: {allowed}")
        return cls(**kwargs)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.init]

    def resolve_max_num_batched_tokens(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return min(max(2048, max_model_len), 8192)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.field_names()}


@dataclass(frozen=True)
class ResolvedConfig:
    """Everything settled once at start-up (the model found, its facts read, device and dtype chosen,
    lengths defaulted): built by ``resolve_config`` and handed whole to the executor, the workers and
    the model runner, so no layer re-derives a setting."""

    engine: EngineConfig
    model: ModelConfig
    source: ModelSource
    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


def resolve_config(config: EngineConfig) -> ResolvedConfig:
    """Find the model and read its config; ValueError when a setting does not fit the model or machine."""
    from kvloom.loader.weights import load_model_config, resolve_model
    from kvloom.platform import resolve_device, resolve_dtype

    source = resolve_model(config.model)
    model_config = load_model_config(source)
    device = resolve_device(config.device)
    model_max = model_config.max_position_embeddings
    max_model_len = config.max_model_len or model_max
    if max_model_len > model_max:
        raise ValueError(f"max_model_len={max_model_len} is longer than the model's context "
                         f"length ({model_max} tokens); use max_model_len <= {model_max}")
    return ResolvedConfig(
        engine=config, model=model_config, source=source, device=device,
        dtype=resolve_dtype(config.dtype, model_config.torch_dtype, device),
        block_size=config.block_size, max_model_len=max_model_len,
        max_num_batched_tokens=config.resolve_max_num_batched_tokens(max_model_len))


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_engine_args(parser: argparse.ArgumentParser, include_model: bool = True) -> None:
    """Add a vLLM-named flag (``--max-num-seqs``, ...) for every EngineConfig field."""
    for f in fields(EngineConfig):
        if not f.init or (f.name == "model" and not include_model):
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.name == "override_backend_config":
            parser.add_argument(flag, "--override-neuron-config", dest=f.name, default=None,
                                help=help_text)
        elif isinstance(default, bool):
            parser.add_argument(flag, dest=f.name, nargs="?", const=True, default=default,
                                type=_parse_bool, help=f"{help_text} (default {default})")
            if default:
                parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name,
                                    action="store_false", help=f"turn off {f.name}")
        else:
            parser.add_argument(flag, dest=f.name, type=_flag_type(f), default=default, help=help_text)


def _flag_type(f: dataclasses.Field) -> type:
    """int or float for fields declared so (optional or not); str for the rest (sizes, paths, JSON)."""
    declared = str(f.type).replace(" ", "")
    for name, kind in (("int", int), ("float", float)):
        if declared in (name, f"{name}|None"):
            return kind
    return str


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {name: getattr(args, name) for name in EngineConfig.field_names() if hasattr(args, name)}
    return EngineConfig.from_kwargs(**values)

"""``EngineConfig``: every engine knob, with vLLM's names, grouped by concern, validated once.

The fields are flat (``LLM(max_num_seqs=8)``, ``--max-num-seqs 8``, as vLLM) and each carries its group
in its metadata: model, cache, scheduler, parallel, speculative, backend. ``GROUPS`` orders them; the CLI's
``--help`` shows one section per group and docs/configuration.md one table per group.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field, fields
from typing import Any

from kvloom import cpu_affinity, envs
from kvloom.config.backend import BackendConfig
from kvloom.config.compat import (
    canonical_arguments,
    canonical_dtype,
    canonical_quantization,
    check_vllm_arguments,
    quantization_from_backend,
)
from kvloom.config.parsing import check_int, parse_memory
from kvloom.config.speculative import SpeculativeConfig
from kvloom.config.structured_outputs import StructuredOutputsConfig
from kvloom.reasoning import check_reasoning_parser
from kvloom.sampling_params import MAX_LOGPROBS

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
EXECUTOR_BACKENDS = ("mp", "ray")

# Group name -> its title in --help and the docs.
GROUPS: dict[str, str] = {
    "model": "Model: the checkpoint, its tokenizer, dtype and weights",
    "cache": "KV cache: blocks and the memory they take",
    "scheduler": "Scheduler: what one engine step may hold",
    "parallel": "Parallelism: tensor-parallel ranks, data-parallel replicas, CPU cores",
    "speculative": "Speculative decoding",
    "backend": "Backend: the device and how it runs the model",
}


def knob(group: str, default: Any, text: str, flag: bool = True) -> Any:
    """A field of ``group`` with its help ``text``; ``flag=False``: no CLI flag of its own (the server has one)."""
    if group not in GROUPS:
        raise KeyError(f"unknown config group {group!r}")
    return field(default=default, metadata={"group": group, "help": text, "flag": flag})


def parse_hf_overrides(value: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """vLLM's hf_overrides: a dict of config.json keys, or its JSON (the command line's)."""
    overrides = value
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError:
            raise ValueError(f"hf_overrides must be a JSON object such as '{{\"architectures\": "
                             f"[\"Qwen3ForSequenceClassification\"]}}', got {value!r}") from None
    if overrides is not None and not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a dict of config.json keys, got {value!r}")
    return overrides


@dataclass
class EngineConfig:
    """What ``LLM(...)`` and ``kvloom serve`` accept, with vLLM's names and meanings."""

    # ---- model -------------------------------------------------------------------------------------------
    model: str = knob("model", DEFAULT_MODEL,
                      "a HF model directory, a .gguf file, or 'SmolLM2-135M-Instruct' (the default model)")
    tokenizer: str | None = knob("model", None, "tokenizer directory or .gguf file (default: the model's)")
    dtype: str = knob("model", "auto",
                      "weight and activation dtype: auto, float32, bfloat16, float16 (auto: bfloat16 on the CPU "
                      "when the model is stored in 16 bits, else the checkpoint's dtype)")
    seed: int = knob("model", 0, "seed of the global sampling generator")
    max_model_len: int | None = knob("model", None,
                                     "longest sequence (prompt + output) in tokens (default: the model's context "
                                     "length)")
    quantization: str | None = knob("model", None,
                                    "weight quantization: 'int8' (per-channel int8 weights, quantized at load; "
                                    "'s8' is the seeds' name), 'gguf' / 'gptq' / 'awq' (a checkpoint's 4-bit "
                                    "weights kept 4-bit: the default for such a checkpoint) or 'none' (every "
                                    "weight dequantized at load)")
    quantized_checkpoint_path: str | None = knob(
        "model", None, "with quantization: a safetensors file of the quantized weights, written at the first load "
        "and read (without quantizing again) at later ones")
    limit_mm_per_prompt: dict[str, int] | str | None = knob(
        "model", None, "most images a prompt of a vision-language model may hold, {\"image\": N} (JSON on the "
        "command line; default 1)")
    allowed_local_media_path: str | None = knob(
        "model", None, "a directory whose files chat image_url parts may name (file:// URLs); none: no local files")
    allowed_media_domains: list[str] | str | None = knob(
        "model", None, "hosts whose http(s) image URLs may be fetched (comma-separated on the command line); none: "
        "no remote fetches")
    max_logprobs: int = knob("model", MAX_LOGPROBS, "most logprobs / prompt_logprobs per position a request may "
                             "ask for (vLLM's; the server's flag is --max-logprobs)", flag=False)
    runner: str = knob("model", "auto", "vLLM's runner: 'auto' (generation and embeddings from one engine), "
                       "'generate' (no embeddings) or 'pooling' (embeddings only: LLM.embed, /v1/embeddings)")
    task: str | None = knob("model", None, "vLLM's older spelling of runner: 'embed' / 'embedding' mean "
                            "runner='pooling', 'generate' means runner='generate'")
    pooling_type: str | None = knob("model", None, "how embeddings pool the prompt's hidden states: 'LAST', "
                                    "'MEAN' or 'CLS' (default: the model directory's sentence-transformers "
                                    "pooling config, else LAST, vLLM's default for decoder models)")
    hf_overrides: dict[str, Any] | str | None = knob(
        "model", None, "keys replacing the model's config.json ones, as vLLM's JSON; e.g. a Qwen3-Reranker as "
        "a classifier: '{\"architectures\": [\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": "
        "[\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}' (see docs/serving.md, Scoring)")
    trust_remote_code: bool = knob("model", False,
                                   "accepted for vLLM compatibility; kvloom never runs model code from a checkpoint")
    revision: str | None = knob("model", None, "vLLM's hub revision: only None (kvloom loads local checkpoints)")
    tokenizer_revision: str | None = knob("model", None,
                                          "vLLM's hub revision of the tokenizer: only None (local tokenizers only)")
    tokenizer_mode: str = knob("model", "auto", "vLLM's tokenizer choice: only 'auto' (the fast tokenizers library)")
    load_format: str = knob("model", "auto", "vLLM's weight format: only 'auto' (what the model path holds)")
    download_dir: str | None = knob("model", None, "vLLM's download folder: only None (nothing is downloaded)")
    enable_lora: bool = knob("model", False, "serve LoRA adapters (PEFT directories) on the base model; a request "
                             "names one with lora_request (the server: its model field); see docs/lora.md")
    max_loras: int = knob("model", 1, "with enable_lora: most distinct adapters in one batch (their compute slots)")
    max_lora_rank: int = knob("model", 16, "with enable_lora: the highest adapter rank accepted")
    max_cpu_loras: int | None = knob("model", None, "with enable_lora: adapters kept in host memory, least "
                                     "recently used dropped (default: max_loras; at least max_loras)")

    # ---- cache -------------------------------------------------------------------------------------------
    block_size: int = knob("cache", 16, "tokens per KV cache block; block_size == max_model_len gives one "
                           "contiguous block per sequence")
    enable_prefix_caching: bool = knob("cache", True, "reuse the KV blocks of shared prompt prefixes")
    kv_cache_memory: int | str | None = knob(
        "cache", None, "bytes for the KV cache, e.g. 2GiB (default: 2 GiB on the CPU, 90%% of free memory on "
        "CUDA, never less than one full-length sequence)")
    gpu_memory_utilization: float = knob("cache", 0.9, "fraction of GPU memory kvloom may use on CUDA")
    kv_cache_dtype: str = knob("cache", "auto", "vLLM's KV cache dtype: 'auto' (the model's dtype), 'int8' (codes "
                               "with a scale per token and head, about half the bytes of bf16; CPU and CUDA) or "
                               "'fp8' / 'fp8_e4m3' (float8 e4m3, half the bytes; CUDA)")
    swap_space: float | None = knob("cache", None, "vLLM's CPU swap space in GiB: accepted, unused (kvloom "
                                    "preempts by recomputation)")
    cpu_offload_gb: float = knob("cache", 0, "vLLM's weight offload to the CPU: only 0")

    # ---- scheduler ---------------------------------------------------------------------------------------
    max_num_seqs: int = knob("scheduler", 256, "most requests in one batch")
    max_num_batched_tokens: int | None = knob(
        "scheduler", None, "most tokens computed in one step (default: max(2048, max_model_len) capped at 8192)")
    enable_chunked_prefill: bool | None = knob(
        "scheduler", None, "prompts longer than a step's token budget are split into chunks: always on in "
        "kvloom (True or unset; False is refused)")
    use_v2_block_manager: bool | None = knob("scheduler", None, "accepted for the seeds and old vLLM; no effect "
                                             "(kvloom has one block manager)")
    async_scheduling: bool | None = knob(
        "scheduler", None, "schedule and prepare step N+1 while step N runs on the device (vLLM's async scheduling; "
        "one engine rank, no speculative decoding); default: on for CUDA, off on a CPU")
    disable_log_stats: bool = knob("scheduler", False, "no periodic engine stats log line (offline, LLM logs "
                                   "none anyway; the server's --stats-interval 0 does the same)")

    # ---- parallel ----------------------------------------------------------------------------------------
    tensor_parallel_size: int = knob("parallel", 1, "number of tensor-parallel ranks")
    pipeline_parallel_size: int = knob("parallel", 1, "vLLM's pipeline stages: only 1 (no pipeline parallelism)")
    data_parallel_size: int = knob("parallel", 1,
                                   "engine replicas behind one server, each with its own tensor-parallel group")
    distributed_executor_backend: str = knob(
        "parallel", "mp",
        "how tensor-parallel ranks run: 'mp' (processes on this machine) or 'ray' (Ray actors, across machines)")
    disable_custom_all_reduce: bool = knob("parallel", False, "accepted, no effect: ranks always reduce through "
                                           "torch.distributed (gloo / NCCL)")
    # None: KVLOOM_CPU_OMP_THREADS_BIND, else "auto" (validate() settles it, so an explicit "auto" wins too).
    cpu_omp_threads_bind: str | None = knob(
        "parallel", None,
        "on the CPU, the cores of each engine process on this host (tensor-parallel ranks, data-parallel "
        "replicas; vLLM's VLLM_CPU_OMP_THREADS_BIND): 'auto' (several processes: equal shares of the usable "
        "cores), 'nobind', or one CPU list per process separated by '|', e.g. '0-3|4-7' "
        "(default: KVLOOM_CPU_OMP_THREADS_BIND, else auto)")

    # ---- speculative -------------------------------------------------------------------------------------
    speculative_config: dict[str, Any] | str | None = knob(
        "speculative", None, "speculative decoding as vLLM's JSON, e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'")
    speculative_model: str | None = knob(
        "speculative", None, "the seeds' spelling: a draft model's path, or '[ngram]' for n-gram prompt lookup "
        "(with --num-speculative-tokens)")
    num_speculative_tokens: int | None = knob(
        "speculative", None, "draft tokens proposed per step (the seeds' spelling, with --speculative-model)")
    speculative_max_model_len: int | None = knob(
        "speculative", None, "no drafts are proposed at or past this many tokens (the seeds' spelling; the draft "
        "model's own context length caps it too)")
    speculative_disable_by_batch_size: int | None = knob(
        "speculative", None, "no drafts while this many requests or more are running (the seeds' spelling of "
        "speculative_config's disable_by_batch_size; without it the measured cost of verifying decides)")

    # ---- backend -----------------------------------------------------------------------------------------
    device: str = knob("backend", "auto", "auto, cpu, cuda or cuda:N")
    enforce_eager: bool = knob("backend", False, "run every step eagerly: no CUDA graphs for the decode buckets "
                               "(CUDA only; the CPU always runs eagerly)")
    max_seq_len_to_capture: int | None = knob("backend", None, "vLLM's CUDA-graph length limit: accepted, unused "
                                              "(kvloom's decode graphs cover every length)")
    structured_outputs_config: dict[str, Any] | str | None = knob(
        "backend", None, "structured outputs as vLLM's dict or JSON: {\"backend\": \"auto\" | \"xgrammar\", "
        "\"compile_timeout\": seconds, \"disable_any_whitespace\": bool} (also "
        "--structured-outputs-config.backend NAME); see docs/structured_outputs.md")
    reasoning_parser: str | None = knob(
        "backend", None, "how a reasoning model's thinking is read from its replies: 'qwen3' or 'deepseek_r1' "
        "(the text between <think> and </think> goes to the chat message's reasoning_content, and a "
        "request's grammar applies after </think>); see docs/serving.md")
    override_backend_config: dict[str, Any] | str | None = knob(
        "backend", None, "backend knobs as JSON, e.g. '{\"attention_backend\": \"reference\"}' (the seeds' "
        "--override-neuron-config)")

    # Settled by validate(): the backend knobs and the speculative settings as objects.
    backend: BackendConfig = field(init=False, repr=False, default_factory=BackendConfig)
    speculative: SpeculativeConfig | None = field(init=False, repr=False, default=None)
    structured_outputs: StructuredOutputsConfig = field(init=False, repr=False,
                                                        default_factory=StructuredOutputsConfig)

    def __post_init__(self) -> None:
        self.validate()

    def _settle_runner(self) -> None:
        """runner from vLLM's older task where that is given; pooling_type checked."""
        tasks = {"embed": "pooling", "embedding": "pooling", "generate": "generate", "auto": "auto"}
        if self.task is not None:
            if self.task not in tasks:
                raise ValueError(f"task must be one of {sorted(tasks)}, got {self.task!r}")
            if self.runner not in ("auto", tasks[self.task]):
                raise ValueError(f"task={self.task!r} asks for runner={tasks[self.task]!r}, but runner="
                                 f"{self.runner!r} was given; give one of them")
            self.runner = tasks[self.task]
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be 'auto', 'generate' or 'pooling', got {self.runner!r}")
        if self.pooling_type is not None and str(self.pooling_type).upper() not in ("LAST", "MEAN", "CLS"):
            raise ValueError(f"pooling_type must be 'LAST', 'MEAN' or 'CLS', got {self.pooling_type!r}")

    def validate(self) -> None:
        """Check every knob (ValueError naming it and what is allowed) and settle the derived ones."""
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a path or a model name, got {self.model!r}")
        self.dtype = canonical_dtype(self.dtype)
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device {self.device!r} is not supported: kvloom runs on 'cpu' or "
                             f"'cuda' (or 'auto'); hardware such as 'neuron' is not available here")
        check_int("seed", self.seed, minimum=0)
        check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        check_int("block_size", self.block_size, minimum=1)
        check_int("max_logprobs", self.max_logprobs, minimum=0)
        for name in ("max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=1)
        check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        check_int("data_parallel_size", self.data_parallel_size, minimum=1)
        check_vllm_arguments(self.to_dict())
        self._settle_runner()
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
        for name in ("enable_prefix_caching", "enforce_eager", "trust_remote_code", "disable_log_stats",
                     "disable_custom_all_reduce", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        self._settle_media_knobs()
        self._settle_hf_overrides()
        self.backend = BackendConfig.from_overrides(self.override_backend_config)
        self.structured_outputs = StructuredOutputsConfig.from_value(self.structured_outputs_config)
        if self.reasoning_parser is not None:
            check_reasoning_parser(self.reasoning_parser)
        if self.quantization is not None:
            self.quantization = canonical_quantization(self.quantization, checkpoint_formats=True)
        else:
            self.quantization = quantization_from_backend(self.backend.quantized,
                                                                 self.backend.quantization_dtype)
        if self.quantized_checkpoint_path is not None and self.quantization != "int8":
            raise ValueError("quantized_checkpoint_path needs quantization='int8' (or override_backend_config "
                             "{\"quantized\": true})")
        self._check_lora()
        self.speculative = SpeculativeConfig.from_engine_args(self.speculative_config, self.speculative_model,
                                                              self.num_speculative_tokens,
                                                              self.speculative_max_model_len,
                                                              self.speculative_disable_by_batch_size)

    def _check_lora(self) -> None:
        """max_loras, max_lora_rank and max_cpu_loras (None: max_loras); what LoRA does not run with."""
        check_int("max_loras", self.max_loras, minimum=1)
        check_int("max_lora_rank", self.max_lora_rank, minimum=1)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        check_int("max_cpu_loras", self.max_cpu_loras, minimum=1)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora does not run with tensor_parallel_size > 1: the adapters' A and B are "
                             "not sharded across ranks; serve LoRA adapters on one rank")
        if self.enable_lora and self.data_parallel_size > 1:
            raise ValueError("enable_lora does not run with data_parallel_size > 1 (adapters are not routed to "
                             "replicas); serve LoRA adapters from one engine")

    def _settle_media_knobs(self) -> None:
        """limit_mm_per_prompt from JSON, allowed_media_domains from a comma-separated string."""
        limit = self.limit_mm_per_prompt
        if isinstance(limit, str):
            try:
                limit = json.loads(limit)
            except json.JSONDecodeError:
                raise ValueError(f"limit_mm_per_prompt must be JSON such as '{{\"image\": 2}}', "
                                 f"got {limit!r}") from None
        if limit is not None:
            if not isinstance(limit, dict) or set(limit) - {"image"} or not all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in limit.values()):
                raise ValueError(f"limit_mm_per_prompt must map 'image' to an integer >= 0, got {limit!r}")
        self.limit_mm_per_prompt = limit
        domains = self.allowed_media_domains
        if isinstance(domains, str):
            domains = [d.strip() for d in domains.split(",") if d.strip()]
        if domains is not None and (not isinstance(domains, (list, tuple))
                                    or not all(isinstance(d, str) and d for d in domains)):
            raise ValueError(f"allowed_media_domains must be a list of host names, got {domains!r}")
        self.allowed_media_domains = None if domains is None else [d.lower() for d in domains]
        if self.allowed_local_media_path is not None and not isinstance(self.allowed_local_media_path, str):
            raise ValueError(f"allowed_local_media_path must be a directory path, "
                             f"got {self.allowed_local_media_path!r}")

    def _settle_hf_overrides(self) -> None:
        self.hf_overrides = parse_hf_overrides(self.hf_overrides)

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
        """The config from ``LLM(...)``-style keywords: the seeds' spellings mapped (compat.ARGUMENT_ALIASES),
        an unknown name a ValueError listing the known ones."""
        kwargs = canonical_arguments(kwargs)
        allowed = sorted(cls.field_names())
        unknown = sorted(set(kwargs) - set(allowed))
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; allowed: {allowed}")
        return cls(**kwargs)

    @classmethod
    def field_names(cls) -> list[str]:
        """Every knob: the fields a caller sets (not the derived ``backend`` and ``speculative``)."""
        return [f.name for f in fields(cls) if f.init]

    @classmethod
    def fields_by_group(cls) -> dict[str, list[dataclasses.Field]]:
        """The knobs of each group, in GROUPS' order and declaration order within a group."""
        groups: dict[str, list[dataclasses.Field]] = {name: [] for name in GROUPS}
        for f in fields(cls):
            if f.init:
                groups[f.metadata["group"]].append(f)
        return groups

    def resolve_max_num_batched_tokens(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return min(max(2048, max_model_len), 8192)

    def to_dict(self) -> dict[str, Any]:
        """The knobs as keywords that ``from_kwargs`` takes back."""
        return {name: getattr(self, name) for name in self.field_names()}

"""GPU offline throughput (issue 9): kvloom against HF transformers on a generated Llama-3.2-1B-shaped model.

The model has Llama-3.2-1B's shapes (hidden 2048, 16 layers, 32 heads, 8 KV heads, head_dim 64, MLP 8192,
vocabulary 128,256, tied embeddings, llama3 rope scaling) and random bf16 weights (seed 0). It is saved once as
a HF checkpoint (config.json, model.safetensors and the tests' tiny tokenizer: prompts are token ids, so the
tokenizer only has to load) into a temporary folder, or into ``--checkpoint-dir`` to keep it for the next run.

Workload ``--workload N``: N prompts of uniform random length in 128..512 tokens with ids uniform over the
vocabulary (``kvloom.bench.workload.make_workload``, seed 0), 128 greedy output tokens each (EOS ignored).
Every engine is built once, runs the workload once as a warm-up, then the engines alternate (kvloom, hf,
kvloom, hf, ...) for ``--repeats`` timed runs in this one process.

- kvloom: ``LLM.generate`` over all prompts; continuous batching decides the batches.
- hf: ``model.generate`` on static batches of ``--hf-batch-size`` prompts in input order (default: all of
  them in one batch), left-padded, ``min_new_tokens = max_new_tokens`` so every row makes 128 tokens.
- kvloom variants, each its own engine in this process: ``kvloom-gptq`` (a GPTQ copy of the checkpoint, 4-bit
  codes in groups of 128, random, written once beside it: the Triton 4-bit product), ``kvloom-int8``
  (``quantization="int8"``), ``kvloom-kv-int8`` / ``kvloom-kv-fp8`` (``kv_cache_dtype``). With more than one
  kvloom engine each takes a fixed ``--kv-cache-memory`` (two engines' memory profiles would count each other).

Prints output tok/s per engine (median, min..max), the ratio kvloom / hf of the medians, and the HBM
bandwidth bound of one decode step at the workload's batch size. ``--profile`` adds kvloom's decode step:
mean wall time at full batch and torch.profiler's top kernels.

    PYTHONPATH=. python benchmarks/gpu_throughput.py --workload 256 --json bench_results/gpu-256.json
    PYTHONPATH=. python benchmarks/gpu_throughput.py --workload 64 --profile
    .venv/bin/python benchmarks/gpu_throughput.py --device cpu --layers 2 --hidden 128 --heads 4 \\
        --kv-heads 2 --intermediate 256 --vocab 1000 --workload 8 --output-tokens 8 --repeats 1   # smoke

Only torch, transformers, safetensors, tokenizers and kvloom are imported, kvloom lazily: with
``--engines hf`` it is never imported, and an engine that fails is reported while the others go on.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
import statistics
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvloom.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
H100_SXM_BANDWIDTH = 3.35e12  # bytes/s of HBM3 on an H100 SXM
ENGINES = ("kvloom", "kvloom-sync", "hf", "kvloom-gptq", "kvloom-int8", "kvloom-kv-int8", "kvloom-kv-fp8")
# Each kvloom variant: its LLM(...) arguments beside the plain engine's ("model": the GPTQ copy).
VARIANTS: dict[str, dict[str, Any]] = {
    "kvloom-gptq": {"model": "gptq"}, "kvloom-int8": {"quantization": "int8"},
    "kvloom-kv-int8": {"kv_cache_dtype": "int8"}, "kvloom-kv-fp8": {"kv_cache_dtype": "fp8"},
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The config.json keys that must match for a --checkpoint-dir to be reused.
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_checkout_module(relative_path: str) -> ModuleType:
    """A stdlib-only module of this checkout, loaded by path: importing ``kvloom.bench`` or ``tests`` by name
    would run kvloom's package __init__ (the engine) or could find another installed ``tests`` package."""
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(f"_gpu_throughput_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# The checkpoint
# ---------------------------------------------------------------------------------------------

def llama_config(args: argparse.Namespace) -> dict[str, Any]:
    """Llama-3.2-1B's config.json with the size arguments; special ids are those of the tiny tokenizer."""
    tiny = load_checkout_module("tests/tiny_models.py")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim or args.hidden // args.heads,
        "intermediate_size": args.intermediate,
        "vocab_size": args.vocab,
        "max_position_embeddings": args.max_position_embeddings,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": tiny.BOS_ID,
        "eos_token_id": tiny.EOS_ID,
        "pad_token_id": tiny.EOS_ID,
    }


def build_checkpoint(directory: Path, config_dict: dict[str, Any], device: str) -> None:
    """Random bf16 weights (seed 0, transformers' own init) and the tests' tokenizer, saved as a HF checkpoint."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = load_checkout_module("tests/tiny_models.py")
    start = time.perf_counter()
    # transformers writes into the dicts it is given (rope_scaling): hand it a copy.
    config = LlamaConfig(**json.loads(json.dumps(config_dict)))
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(directory)
    tiny.save_tokenizer(str(directory))
    # Engines read the stored dtype from config.json; say bf16 under both spellings.
    config_path = directory / "config.json"
    saved = json.loads(config_path.read_text())
    saved["torch_dtype"] = saved["dtype"] = "bfloat16"
    config_path.write_text(json.dumps(saved, indent=2) + "\n")
    num_params = sum(p.numel() for p in model.parameters())
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    log(f"wrote {directory}: {num_params / 1e6:,.1f} M parameters, bf16, in {time.perf_counter() - start:.1f} s")


def prepare_checkpoint(args: argparse.Namespace) -> tuple[Path, tempfile.TemporaryDirectory[str] | None]:
    """The checkpoint folder (reused when --checkpoint-dir holds one of the same shape) and its temp dir."""
    wanted = llama_config(args)
    if args.checkpoint_dir is None:
        temp = tempfile.TemporaryDirectory(prefix="kvloom-gpu-bench-")
        build_checkpoint(Path(temp.name), wanted, args.device)
        return Path(temp.name), temp
    directory = Path(args.checkpoint_dir)
    config_path = directory / "config.json"
    if config_path.is_file():
        saved = json.loads(config_path.read_text())
        different = {key: (saved.get(key), wanted[key]) for key in SHAPE_KEYS if saved.get(key) != wanted[key]}
        if different:
            raise SystemExit(f"{directory} holds a model of another shape (key: saved, asked) {different}; "
                             f"give another --checkpoint-dir or the same size arguments")
        log(f"reusing {directory}")
        return directory, None
    directory.mkdir(parents=True, exist_ok=True)
    build_checkpoint(directory, wanted, args.device)
    return directory, None


def build_gptq_copy(checkpoint: Path, group_size: int) -> Path:
    """A GPTQ copy of the checkpoint (written once, beside it): every projection as 4-bit codes in groups of
    ``group_size`` along K (random codes, zero point 8, fp16 scales that give the bf16 init's spread), the rest
    as it is. For speed only: its weights are not the bf16 ones."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    target = checkpoint.parent / f"{checkpoint.name}-gptq{group_size}"
    if (target / "config.json").is_file():
        return target
    start = time.perf_counter()
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(checkpoint, partial, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    generator = torch.Generator().manual_seed(0)
    scale = 0.02 / 4.6  # codes - 8 spread ~4.6: weights of std ~0.02, as transformers' init
    for path in sorted(checkpoint.glob("*.safetensors")):
        packed = {}
        for name, weight in load_file(path).items():
            prefix = name.removesuffix(".weight")
            if not prefix.endswith(PROJECTIONS):
                packed[name] = weight
                continue
            n, k = weight.shape
            packed[f"{prefix}.qweight"] = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32,
                                                        generator=generator)  # 8 random codes a word
            packed[f"{prefix}.qzeros"] = torch.full((k // group_size, n // 8), 0x77777777, dtype=torch.int32)
            packed[f"{prefix}.scales"] = torch.full((k // group_size, n), scale, dtype=torch.float16)
            packed[f"{prefix}.g_idx"] = torch.arange(k, dtype=torch.int32) // group_size
        save_file(packed, partial / path.name)
    config = json.loads((partial / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False,
                                     "sym": False, "checkpoint_format": "gptq"}
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    partial.rename(target)
    log(f"wrote {target} (GPTQ, group {group_size}) in {time.perf_counter() - start:.1f} s")
    return target


def weight_bytes(directory: Path) -> int:
    """Bytes of every stored tensor (tied embeddings once), from the safetensors headers."""
    total = 0
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        total += sum(end - begin for name, info in header.items() if name != "__metadata__"
                     for begin, end in [info["data_offsets"]])
    return total


# ---------------------------------------------------------------------------------------------
# The engines
# ---------------------------------------------------------------------------------------------

def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


class KvloomRunner:
    """kvloom's LLM, built once; ``run`` is one ``generate`` over the whole workload."""

    name = "kvloom"

    def __init__(self, checkpoint: Path, args: argparse.Namespace, variant: str = "kvloom") -> None:
        from kvloom import LLM, SamplingParams

        self.device = args.device
        extra = dict(VARIANTS.get(variant, {}))
        if extra.pop("model", None) == "gptq":
            checkpoint = build_gptq_copy(checkpoint, args.gptq_group_size)
        if sum(name == "kvloom" or name in VARIANTS for name in args.engines) > 1:
            extra["kv_cache_memory"] = args.kv_cache_memory
        self.llm = LLM(model=str(checkpoint), dtype="bfloat16", device=args.device,
                       max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       enable_prefix_caching=False, gpu_memory_utilization=args.gpu_memory_utilization,
                       override_backend_config=args.override_backend_config, **extra)
        self.params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True,
                                     detokenize=args.detokenize)

    def run(self, prompts: list[list[int]], params: SamplingParams | None = None) -> int:
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params or self.params,
                                    use_tqdm=False)
        synchronize(self.device)
        return sum(len(output.outputs[0].token_ids) for output in outputs)


class HFRunner:
    """transformers' ``generate`` on static, left-padded batches in input order."""

    name = "hf"

    def __init__(self, checkpoint: Path, args: argparse.Namespace) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        major_minor = tuple(int(part) for part in transformers.__version__.split(".")[:2])
        # transformers >= 4.56 calls it dtype; older versions would take dtype= silently as a config attribute.
        dtype_key = "dtype" if major_minor >= (4, 56) else "torch_dtype"
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), **{dtype_key: torch.bfloat16})
        self.model = model.to(device=args.device, dtype=torch.bfloat16).eval()
        self.device = args.device
        self.pad_token_id = int(self.model.config.pad_token_id)
        self.batch_size = args.hf_batch_size
        self.output_tokens = args.output_tokens
        self.attn_implementation = getattr(self.model.config, "_attn_implementation", None)
        self.left_padded = load_checkout_module("kvloom/bench/workload.py").left_padded

    def run(self, prompts: list[list[int]]) -> int:
        import torch

        num_output_tokens = 0
        for first in range(0, len(prompts), self.batch_size):
            batch = prompts[first:first + self.batch_size]
            input_ids, attention_mask = self.left_padded(batch, self.pad_token_id)
            width = input_ids.shape[1]
            with torch.inference_mode():
                output = self.model.generate(
                    input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                    do_sample=False, max_new_tokens=self.output_tokens, min_new_tokens=self.output_tokens,
                    pad_token_id=self.pad_token_id)
            num_output_tokens += len(batch) * (output.shape[1] - width)
        synchronize(self.device)
        return num_output_tokens


class KvloomSyncRunner:
    """kvloom with async scheduling off (on is the CUDA default): the same engine as ``kvloom`` when that one runs
    too (two engines in one process would split the GPU memory), its ``async_scheduling`` switched off around
    each run."""

    name = "kvloom-sync"
    shared: KvloomRunner | None = None

    def __init__(self, checkpoint: Path, args: argparse.Namespace) -> None:
        self.base = KvloomSyncRunner.shared or KvloomRunner(checkpoint, args)
        self.default = self.base.llm.llm_engine.async_scheduling

    def run(self, prompts: list[list[int]]) -> int:
        set_async_scheduling(self.base.llm, False)
        try:
            return self.base.run(prompts)
        finally:
            set_async_scheduling(self.base.llm, self.default)


def set_async_scheduling(llm: Any, on: bool) -> None:
    """Between generate calls (no step in flight): the engine, its scheduler and its runner switch together."""
    engine = llm.llm_engine
    engine.async_scheduling = engine.scheduler.async_scheduling = engine.executor.driver.async_scheduling = on


RUNNERS = {"kvloom": KvloomRunner, "kvloom-sync": KvloomSyncRunner, "hf": HFRunner,
           **{name: lambda checkpoint, args, name=name: KvloomRunner(checkpoint, args, name) for name in VARIANTS}}


def timed_run(runner: KvloomRunner | HFRunner, prompts: list[list[int]], expected_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    output_tokens = runner.run(prompts)
    elapsed = time.perf_counter() - start
    if output_tokens != expected_tokens:
        log(f"  warning: {runner.name} made {output_tokens} output tokens, expected {expected_tokens}")
    return {"elapsed_s": elapsed, "output_tokens": output_tokens, "output_tok_s": output_tokens / elapsed}


# ---------------------------------------------------------------------------------------------
# kvloom's decode step under the profiler
# ---------------------------------------------------------------------------------------------

def profile_kvloom_decode(runner: KvloomRunner, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """Wall time of a decode step with the whole workload decoding, and torch.profiler's top kernels.

    Wall time: ``generate`` with ``extra`` more output tokens per prompt runs ``extra`` more decode steps
    over the whole batch (prefill ends long before the first request does), so the difference of the two
    runs' times (medians of two pairs) / extra is one such step, on the very path the benchmark times.

    Kernels: the requests are queued with ``add_request`` and stepped with ``step`` (vLLM's engine API;
    kvloom's internals are moving, so nothing else is touched). With DELTA outputs, a step returns one
    output per request that made a token; once every request has made one, every later step is a decode
    step over the whole batch, and a few of those are traced.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvloom.sampling_params import RequestOutputKind, SamplingParams

    on_cuda = args.device.startswith("cuda")
    batch = min(len(prompts), args.max_num_seqs)
    longest = max(len(ids) for ids in prompts)
    extra = min(64, args.max_model_len - longest - args.output_tokens)
    step_ms = None
    if extra >= 4:
        longer = SamplingParams(temperature=0.0, max_tokens=args.output_tokens + extra, ignore_eos=True,
                                detokenize=args.detokenize)
        runner.run(prompts, longer)  # warm-up: longer contexts than the timed runs had
        base, more = [], []
        for _ in range(2):  # pairs, so that drift falls on both alike
            for params, times in ((None, base), (longer, more)):
                start = time.perf_counter()
                runner.run(prompts, params)
                times.append(time.perf_counter() - start)
        step_ms = 1000 * (statistics.median(more) - statistics.median(base)) / extra
    else:
        log(f"  no room for extra decode steps (max_model_len {args.max_model_len}); wall time skipped")

    engine = runner.llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=args.max_model_len - longest, ignore_eos=True,
                            detokenize=args.detokenize, output_kind=RequestOutputKind.DELTA)
    request_ids = [f"profile-{i}" for i in range(len(prompts))]
    for request_id, ids in zip(request_ids, prompts):
        engine.add_request(request_id, {"prompt_token_ids": ids}, params)
    try:
        started: set[str] = set()
        prefill_steps = 0
        while len(started) < len(prompts):
            outputs = engine.step()
            if not outputs and not engine.has_unfinished_requests():
                raise RuntimeError("the profiled requests finished before they all decoded")
            started.update(output.request_id for output in outputs)
            prefill_steps += 1
        for _ in range(3):  # the first steps at a new batch size may compile or capture
            engine.step()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        sequences = 0
        with profile(activities=activities) as prof:
            for _ in range(args.profile_steps):
                sequences += len(engine.step())
            synchronize(args.device)
    finally:
        engine.abort_request(request_ids)
    if sequences != args.profile_steps * len(prompts):
        log(f"  warning: the traced steps decoded {sequences} sequences, not {args.profile_steps} x {len(prompts)}")

    events = prof.key_averages()
    if on_cuda:
        # Kernels (and memcpy/memset) are the events that run on the device.
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        time_of = lambda e: e.self_device_time_total
    else:
        kernels = list(events)
        time_of = lambda e: e.self_cpu_time_total
    busy_us = sum(time_of(e) for e in kernels)
    top = sorted(kernels, key=time_of, reverse=True)[:15]
    return {
        "batch": batch,
        "extra_decode_steps": extra,
        "decode_step_ms": step_ms,
        "prefill_steps": prefill_steps,
        "traced_steps": args.profile_steps,
        "busy_ms_per_step": busy_us / 1000 / args.profile_steps,
        "launches_per_step": sum(e.count for e in kernels) / args.profile_steps if on_cuda else None,
        "top": [{"name": e.key, "calls": e.count, "total_ms": time_of(e) / 1000,
                 "share": time_of(e) / busy_us if busy_us else 0.0} for e in top],
    }


def print_profile(result: dict[str, Any], on_cuda: bool, bound_ms: float) -> None:
    print(f"\n== kvloom decode step at {result['batch']} sequences ==")
    if result["decode_step_ms"] is not None:
        print(f"wall time {result['decode_step_ms']:.2f} ms a step (generate with {result['extra_decode_steps']} "
              f"more output tokens against without) = {result['decode_step_ms'] / bound_ms:.1f}x the bound")
    what = "GPU kernel" if on_cuda else "CPU op (self time)"
    busy = (f"{result['traced_steps']} steps traced after {result['prefill_steps']} steps of prefill: "
            f"{what} time {result['busy_ms_per_step']:.2f} ms a step")
    if on_cuda:
        if result["decode_step_ms"]:
            busy += f" ({100 * result['busy_ms_per_step'] / result['decode_step_ms']:.0f}% of the wall time)"
        busy += f", {result['launches_per_step']:.0f} kernels a step"
    print(busy)
    print(f"  {'total ms':>9} {'share':>6} {'calls':>6}  top {len(result['top'])} by {what} time")
    for k in result["top"]:
        print(f"  {k['total_ms']:>9.2f} {100 * k['share']:>5.1f}% {k['calls']:>6}  {k['name'][:120]}")


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def machine_info(device: str) -> dict[str, Any]:
    import torch

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else (platform.processor() or "cpu")
    return {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": version("transformers"), "triton": version("triton"), "python": platform.python_version()}


def decode_bound(directory: Path, config: dict[str, Any], batch: int, mean_context: float,
                 bandwidth: float) -> dict[str, float]:
    """Bytes one decode step must read from HBM, once each: every weight, and the K and V of every context token."""
    kv_bytes_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 2
    weights = weight_bytes(directory)
    kv = kv_bytes_per_token * mean_context * batch
    return {"batch": batch, "mean_context": mean_context, "weight_bytes": weights, "kv_bytes": kv,
            "bytes": weights + kv, "bandwidth": bandwidth, "ms": 1000 * (weights + kv) / bandwidth}


def summarize(runs: list[dict[str, Any]]) -> dict[str, float]:
    rates = [r["output_tok_s"] for r in runs]
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)} if rates else {}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", type=int, default=256, help="number of prompts (issue 9: 256 or 64)")
    p.add_argument("--engines", default="kvloom,hf", help=f"comma-separated, from {','.join(ENGINES)}")
    p.add_argument("--kv-cache-memory", default="12GiB",
                   help="each kvloom engine's KV cache where several run in this process")
    p.add_argument("--gptq-group-size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per engine, after one warm-up")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--min-prompt-len", type=int, default=128)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--hf-batch-size", type=int, help="prompts per static HF batch (default: all of them)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                   help="kvloom's share of the GPU; the rest stays free for the HF model in this process")
    p.add_argument("--override-backend-config", metavar="JSON", type=json.loads,
                   help="passed to kvloom's LLM(override_backend_config=...)")
    p.add_argument("--detokenize", action="store_true",
                   help="let kvloom detokenize its output (HF's generate does not, so off by default)")
    p.add_argument("--profile", action="store_true", help="kvloom's decode step: wall time and top kernels")
    p.add_argument("--profile-steps", type=int, default=10, help="decode steps traced by --profile")
    p.add_argument("--bandwidth", type=float, default=H100_SXM_BANDWIDTH, help="HBM bytes/s for the bound")
    p.add_argument("--checkpoint-dir", help="build the model here once and reuse it (default: a temp dir)")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    size = p.add_argument_group("model size (default: Llama-3.2-1B)")
    size.add_argument("--hidden", type=int, default=2048)
    size.add_argument("--layers", type=int, default=16)
    size.add_argument("--heads", type=int, default=32)
    size.add_argument("--kv-heads", type=int, default=8)
    size.add_argument("--head-dim", type=int, help="default: hidden / heads")
    size.add_argument("--intermediate", type=int, default=8192)
    size.add_argument("--vocab", type=int, default=128256)
    size.add_argument("--max-position-embeddings", type=int, default=131072)
    args = p.parse_args(argv)
    args.engines = [name.strip() for name in args.engines.split(",") if name.strip()]
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown or not args.engines:
        p.error(f"--engines: unknown {unknown}; choose from {','.join(ENGINES)}")
    for name in ("workload", "repeats", "output_tokens", "min_prompt_len", "profile_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_prompt_len < args.min_prompt_len:
        p.error("--max-prompt-len must be at least --min-prompt-len")
    if args.max_prompt_len + args.output_tokens > args.max_model_len:
        p.error(f"--max-model-len {args.max_model_len} is shorter than the longest prompt plus the output "
                f"({args.max_prompt_len} + {args.output_tokens})")
    args.hf_batch_size = args.hf_batch_size or args.workload
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = machine_info(args.device)
    log(f"{info['device']}: torch {info['torch']} (CUDA {info['cuda']}), transformers {info['transformers']}, "
        f"triton {info['triton']}")
    checkpoint, temp = prepare_checkpoint(args)
    try:
        return run_benchmark(args, checkpoint, info)
    finally:
        if temp is not None:
            temp.cleanup()


def run_benchmark(args: argparse.Namespace, checkpoint: Path, info: dict[str, Any]) -> int:
    config = json.loads((checkpoint / "config.json").read_text())
    workload = load_checkout_module("kvloom/bench/workload.py")
    prompts = workload.make_workload(args.workload, seed=args.seed, min_len=args.min_prompt_len,
                                     max_len=args.max_prompt_len, id_lo=0, id_hi=config["vocab_size"] - 1)
    prompt_tokens = sum(len(ids) for ids in prompts)
    expected_tokens = len(prompts) * args.output_tokens

    runners: dict[str, KvloomRunner | HFRunner] = {}
    engines: dict[str, dict[str, Any]] = {}
    for name in args.engines:
        log(f"{name}: building")
        try:
            start = time.perf_counter()
            runners[name] = RUNNERS[name](checkpoint, args)
            if name == "kvloom":
                KvloomSyncRunner.shared = runners[name]
            build_s = time.perf_counter() - start
            warmup = timed_run(runners[name], prompts, expected_tokens)
            engines[name] = {"build_s": build_s, "warmup_s": warmup["elapsed_s"], "runs": []}
            if isinstance(runners[name], HFRunner):
                engines[name]["attn_implementation"] = runners[name].attn_implementation
            log(f"{name}: built in {build_s:.1f} s, warm-up run {warmup['elapsed_s']:.2f} s "
                f"({warmup['output_tok_s']:,.0f} output tok/s)")
        except Exception:
            log(f"{name} failed to start:\n{traceback.format_exc()}")
            runners.pop(name, None)
            engines[name] = {"error": traceback.format_exc(limit=3), "runs": []}

    for repeat in range(args.repeats):
        for name in list(runners):
            try:
                result = timed_run(runners[name], prompts, expected_tokens)
            except Exception:
                log(f"{name} failed in repeat {repeat + 1}:\n{traceback.format_exc()}")
                engines[name]["error"] = traceback.format_exc(limit=3)
                del runners[name]
                continue
            engines[name]["runs"].append(result)
            log(f"repeat {repeat + 1}/{args.repeats} {name}: {result['elapsed_s']:.2f} s, "
                f"{result['output_tok_s']:,.0f} output tok/s")

    mean_context = prompt_tokens / len(prompts) + args.output_tokens / 2
    bound = decode_bound(checkpoint, config, len(prompts), mean_context, args.bandwidth)
    profile_result = None
    if args.profile and "kvloom" in runners:
        log("kvloom: profiling decode steps")
        try:
            profile_result = profile_kvloom_decode(runners["kvloom"], prompts, args)
        except Exception:
            log(f"kvloom profile failed:\n{traceback.format_exc()}")

    for name in engines:
        engines[name].update(summarize(engines[name]["runs"]))
    print(f"\n== {info['device']}: torch {info['torch']}, transformers {info['transformers']}, "
          f"triton {info['triton']} ==")
    print(f"model: random Llama, hidden {config['hidden_size']}, "
          f"{config['num_hidden_layers']} layers, {config['num_attention_heads']}/{config['num_key_value_heads']} "
          f"heads, vocab {config['vocab_size']}, bf16")
    print(f"workload: {len(prompts)} prompts of {args.min_prompt_len}..{args.max_prompt_len} tokens "
          f"({prompt_tokens:,} prompt tokens), {args.output_tokens} greedy output tokens each; "
          f"HF static batches of {args.hf_batch_size}")
    print(f"{'engine':<15} {'output tok/s':>13} {'min .. max':>21} {'runs':>5} {'start-up s':>11} {'warm-up s':>10}")
    for name, result in engines.items():
        if not result["runs"]:
            print(f"{name:<15} {'failed':>13}")
            continue
        spread = f"{result['min']:,.0f} .. {result['max']:,.0f}"
        print(f"{name:<15} {result['median']:>13,.1f} {spread:>21} {len(result['runs']):>5} "
              f"{result['build_s']:>11.1f} {result['warmup_s']:>10.2f}")
    ratio = None
    if engines.get("kvloom", {}).get("runs") and engines.get("hf", {}).get("runs"):
        ratio = engines["kvloom"]["median"] / engines["hf"]["median"]
        print(f"kvloom / hf: {ratio:.2f}x (medians)")
    for variant in VARIANTS:
        if engines.get(variant, {}).get("runs") and engines.get("kvloom", {}).get("runs"):
            print(f"{variant} / kvloom: {engines[variant]['median'] / engines['kvloom']['median']:.2f}x (medians)")
    if engines.get("kvloom-sync", {}).get("runs"):
        for other in ("hf", "kvloom"):
            if engines.get(other, {}).get("runs"):
                print(f"kvloom-sync / {other}: {engines['kvloom-sync']['median'] / engines[other]['median']:.2f}x "
                      f"(medians)")
    label = " (H100 SXM)" if args.bandwidth == H100_SXM_BANDWIDTH else ""
    print(f"a decode step at {bound['batch']} sequences reads {bound['bytes'] / 1e9:.3g} GB "
          f"({bound['weight_bytes'] / 1e9:.3g} GB weights + {bound['kv_bytes'] / 1e9:.3g} GB KV at a mean context "
          f"of {mean_context:.0f}): {bound['ms']:.3g} ms at {args.bandwidth / 1e12:.3g} TB/s{label}")
    if profile_result is not None:
        print_profile(profile_result, args.device.startswith("cuda"), bound["ms"])

    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "machine": info, "arguments": vars(args), "model_config": config,
            "workload": {"num_prompts": len(prompts), "prompt_tokens": prompt_tokens,
                         "output_tokens_per_prompt": args.output_tokens},
            "engines": engines, "kvloom_over_hf": ratio, "decode_bound": bound, "profile": profile_result,
        }, indent=2, default=str) + "\n")
        log(f"wrote {path}")
    failed = [name for name, result in engines.items() if len(result["runs"]) < args.repeats]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

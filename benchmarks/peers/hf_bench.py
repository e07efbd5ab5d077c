"""HF transformers ``generate`` on kvloom's offline benchmarks: the same flags, workload and result.

    .venv/bin/python benchmarks/peers/hf_bench.py throughput [-n 64] [--threads 2] [--json out.json]
    .venv/bin/python benchmarks/peers/hf_bench.py latency --batch-sizes 1,8     # --method generate only

All prompts go as one left-padded batch, greedy, with no end-of-sequence id (so every row generates
exactly ``--output-len`` tokens), in bf16 unless ``--dtype`` says otherwise. transformers is in the main
venv (a test dependency), so this imports ``kvloom.bench`` directly. The model defaults to
``.peers/smollm2-hf`` (``bash benchmarks/peers/setup_transformers.sh``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from kvloom.bench import common, latency, throughput
from kvloom.bench.workload import left_padded, load_prompts, warmup_prompt


class HfEngine:
    """transformers ``generate``: all prompts as one left-padded batch, greedy, no early stop."""

    name = "hf"

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        if args.threads:
            torch.set_num_threads(args.threads)
        self.torch = torch
        self.version = transformers.__version__
        dtype = getattr(torch, args.dtype) if args.dtype != "auto" else "auto"
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype,
                                                          **common.parse_engine_args(args.engine_arg))
        self.model.eval()
        # ignore_eos: no end-of-sequence id at all, so every row generates exactly max_tokens.
        config = self.model.generation_config
        eos = config.eos_token_id
        config.eos_token_id = None
        pad = config.pad_token_id
        if pad is None:
            pad = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)
        self.pad_token_id = int(pad)
        self.engine_kwargs = {"model": args.model, "dtype": args.dtype, "torch_threads": torch.get_num_threads()}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        torch = self.torch
        input_ids, attention_mask = left_padded(prompts, self.pad_token_id)
        width = input_ids.shape[1]
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                      max_new_tokens=max_tokens, do_sample=False, pad_token_id=self.pad_token_id)
        return [int(out.shape[1] - width)] * len(prompts)


def peer_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.set_defaults(model=str(common.PEER_HF_CHECKPOINT))
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    return parser


def load_engine(args: argparse.Namespace) -> HfEngine:
    if not Path(args.model).exists():
        raise SystemExit(f"{args.model} does not exist: make it with 'bash benchmarks/peers/setup_transformers.sh'")
    return HfEngine(args)


def cmd_throughput(argv: list[str]) -> int:
    args = peer_parser(throughput.build_parser(prog="hf_bench.py throughput")).parse_args(argv)
    throughput.check_args(args)
    start = common.process_start_time()
    machine = common.machine_info()
    prompts = load_prompts(args, args.num_prompts, seed=args.seed)
    engine = load_engine(args)
    ready = time.time()
    first_token = None
    if args.first_token:
        engine.generate([warmup_prompt(args, prompts, seed=args.seed)], 1)
        first_token = time.time()
    t0 = time.perf_counter()
    generated = engine.generate(prompts, args.output_len)
    elapsed = time.perf_counter() - t0
    result = throughput.throughput_result(
        engine=engine.name, version=engine.version, engine_kwargs=engine.engine_kwargs, model=args.model,
        prompt_lens=[len(p) for p in prompts], generated=generated, output_len=args.output_len, elapsed=elapsed,
        startup_s=ready - start, startup_to_first_token_s=(first_token - start) if first_token else None,
        peak_rss_mib=common.peak_rss_mib(), peak_rss_tree_mib=common.process_tree_peak_rss_mib(),
        machine=machine)
    throughput.report(result)
    common.write_json(args.json, result)
    return 0


def cmd_latency(argv: list[str]) -> int:
    parser = peer_parser(latency.build_parser(prog="hf_bench.py latency"))
    parser.set_defaults(method="generate")
    args = parser.parse_args(argv)
    latency.check_args(args)
    if args.method != "generate":
        raise SystemExit("hf_bench.py latency: transformers has no step loop; only --method generate")
    start = common.process_start_time()
    machine = common.machine_info()
    sizes = latency.parse_batch_sizes(args.batch_sizes)
    workload = load_prompts(args, max(sizes), seed=args.seed)
    engine = load_engine(args)
    startup = time.time() - start
    batches: list[dict[str, Any]] = []
    for batch_size in sizes:
        prompts = workload[:batch_size]
        runs = [latency.measure_generate(engine.generate, prompts, args.output_len)
                for _ in range(args.num_warmup + args.num_iters)][args.num_warmup:]
        batches.append(latency.batch_result(batch_size, prompts, runs))
    result = {
        "benchmark": "latency", "engine": engine.name, "engine_version": engine.version, "model": args.model,
        "engine_kwargs": engine.engine_kwargs, "method": "generate", "output_len": args.output_len,
        "num_iters": args.num_iters, "startup_s": startup, "batches": batches,
        "peak_rss_mib": common.peak_rss_mib(), "machine": machine, "loadavg_end": common.machine_info()["loadavg"],
    }
    latency.report(result)
    common.write_json(args.json, result)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return common.run_subcommand("hf_bench.py", __doc__, {"throughput": cmd_throughput, "latency": cmd_latency},
                                 argv)


if __name__ == "__main__":
    sys.exit(main())

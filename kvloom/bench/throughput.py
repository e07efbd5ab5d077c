"""Offline throughput: one ``generate`` call over the standard workload, timed.

    kvloom bench throughput                                 # kvloom, N=64
    python benchmarks/throughput.py --engine kvloom -n 8
    .peers/vllm/bin/python benchmarks/throughput.py --engine vllm
    .venv/bin/python benchmarks/throughput.py --engine hf

The engines:
- ``kvloom``: ``kvloom.LLM(...).generate(prompts, SamplingParams(...), use_tqdm=False)``.
- ``vllm``: the same calls on ``vllm.LLM`` (run this file with the vLLM venv's python); environment
  ``VLLM_CPU_OMP_THREADS_BIND=0-1`` and ``VLLM_CPU_KVCACHE_SPACE=4`` unless already set.
- ``hf``: transformers ``generate`` on one left-padded batch of all prompts, greedy, bf16.

Prompts are token ids (``{"prompt_token_ids": [...]}``): make_workload(N), 128 output tokens each,
temperature 0, ignore_eos. Start-up is counted from process start (interpreter and imports
included) to the engine being ready; "first token" adds one 1-token request made after that, which
is also a small warm-up before the timed call (``--no-first-token`` skips it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from kvloom.bench import common
from kvloom.bench.workload import make_workload

ENGINES = ("kvloom", "vllm", "hf")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvloom bench throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_options(parser)
    parser.add_argument("-n", "--num-prompts", type=int, default=64,
                        help="requests: make_workload(N) (default 64: 9,202 prompt tokens)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--no-first-token", dest="first_token", action="store_false",
                        help="skip the 1-token request that measures process start -> first token")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON ('-': stdout)")
    return parser


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared with the latency benchmark."""
    parser.add_argument("--engine", choices=ENGINES, default="kvloom")
    parser.add_argument("--model", default=None,
                        help=f"kvloom: {common.DEFAULT_MODEL!r} (default), a HF directory or a .gguf; "
                             f"vllm/hf: a HF directory (default .peers/smollm2-hf)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="pass enforce_eager=True (vLLM: skip compilation)")
    parser.add_argument("--engine-arg", action="append", metavar="KEY=VALUE",
                        help="extra LLM(...) keyword argument (JSON value), repeatable")
    parser.add_argument("--threads", type=int, default=None,
                        help="hf: torch.set_num_threads (default: torch's choice)")


def default_model(engine: str) -> str:
    return common.DEFAULT_MODEL if engine == "kvloom" else str(common.PEER_HF_CHECKPOINT)


# ---------------------------------------------------------------------------------------------
# Engines: each gives the same small interface to the benchmarks.
# ---------------------------------------------------------------------------------------------

class Engine:
    """A loaded engine: ``generate`` returns the number of tokens generated per prompt."""

    name = ""
    version = ""

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class VllmApiEngine(Engine):
    """kvloom and vLLM: the same ``LLM`` / ``SamplingParams`` API."""

    def __init__(self, name: str, args: argparse.Namespace, max_num_seqs: int) -> None:
        self.name = name
        if name == "vllm":
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
            import vllm as package
            from vllm import LLM, SamplingParams
        else:
            try:
                import kvloom as package
                from kvloom import LLM, SamplingParams
            except ImportError as e:
                raise SystemExit(f"kvloom's engine cannot be imported yet ({e}); "
                                 f"--engine vllm or hf measure a peer") from None
        self.version = getattr(package, "__version__", "")
        self._sampling_params = SamplingParams
        kwargs: dict[str, Any] = dict(model=args.model, dtype=args.dtype,
                                      max_model_len=args.max_model_len, max_num_seqs=max_num_seqs,
                                      seed=args.seed)
        if args.enforce_eager:
            kwargs["enforce_eager"] = True
        kwargs.update(common.parse_engine_args(args.engine_arg))
        self.engine_kwargs = kwargs
        self.llm = LLM(**kwargs)

    def params(self, max_tokens: int) -> Any:
        return self._sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        inputs = [{"prompt_token_ids": ids} for ids in prompts]
        outputs = self.llm.generate(inputs, self.params(max_tokens), use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outputs]

    def shutdown(self) -> None:
        engine = getattr(self.llm, "llm_engine", None)
        for target in (self.llm, engine, getattr(engine, "engine_core", None)):
            stop = getattr(target, "shutdown", None)
            if callable(stop):
                try:
                    stop()
                except Exception:  # noqa: BLE001 - best effort at exit
                    pass
                return


class HfEngine(Engine):
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
        self.eos_token_id = config.eos_token_id
        config.eos_token_id = None
        pad = config.pad_token_id
        if pad is None:
            eos = self.eos_token_id
            pad = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)
        self.pad_token_id = int(pad)
        self.engine_kwargs = {"model": args.model, "dtype": args.dtype,
                              "torch_threads": torch.get_num_threads()}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        torch = self.torch
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, ids in enumerate(prompts):  # left padding: the prompt ends at the last column
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            attention_mask[i, width - len(ids):] = 1
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                      max_new_tokens=max_tokens, do_sample=False,
                                      pad_token_id=self.pad_token_id)
        return [int(out.shape[1] - width)] * len(prompts)


def load_engine(args: argparse.Namespace, max_num_seqs: int) -> Engine:
    if args.model is None:
        args.model = default_model(args.engine)
    if args.engine in ("vllm", "hf") and not os.path.exists(args.model):
        raise SystemExit(f"{args.model} does not exist: make it with "
                         f"'bash benchmarks/peers/setup_transformers.sh' (or make_hf_checkpoint.py)")
    if args.engine == "hf":
        return HfEngine(args)
    return VllmApiEngine(args.engine, args, max_num_seqs)


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
    start = common.process_start_time()
    machine = common.machine_info()
    prompts = make_workload(args.num_prompts)
    prompt_lens = [len(p) for p in prompts]
    max_num_seqs = args.max_num_seqs or args.num_prompts

    engine = load_engine(args, max_num_seqs)
    ready = time.time()
    first_token = None
    if args.first_token:
        engine.generate([make_workload(1, seed=1)[0]], 1)
        first_token = time.time()

    t0 = time.perf_counter()
    generated = engine.generate(prompts, args.output_len)
    elapsed = time.perf_counter() - t0

    # Memory before shutdown (vLLM's engine processes are gone after it) and before the GGUF
    # metadata read below, which maps the file.
    tree_rss = common.process_tree_peak_rss_mib()
    peak_rss = common.peak_rss_mib()
    engine.shutdown()

    return {
        "benchmark": "throughput",
        "engine": engine.name,
        "engine_version": engine.version,
        "model": args.model,
        "engine_kwargs": engine.engine_kwargs,
        **common.throughput_figures(args.model, prompt_lens, sum(generated), args.output_len, elapsed),
        "startup_s": ready - start,
        "startup_to_first_token_s": (first_token - start) if first_token else None,
        "peak_rss_mib": peak_rss,
        "peak_rss_tree_mib": tree_rss,
        "machine": machine,
        "loadavg_end": common.machine_info()["loadavg"],
    }


def report(result: dict[str, Any]) -> None:
    ok = result["output_tokens"] == result["expected_output_tokens"]
    rows = [
        ("engine", f"{result['engine']} {result['engine_version']}"),
        ("model", result["model"]),
        ("requests", result["requests"]),
        ("prompt tokens", result["prompt_tokens"]),
        ("generated tokens", result["output_tokens"] if ok else
         f"{result['output_tokens']} (expected {result['expected_output_tokens']})"),
        ("generate wall s", result["elapsed_s"]),
        ("output tok/s", result["output_tok_s"]),
        ("total tok/s", result["total_tok_s"]),
        ("GFLOP/s (matmul)", result["gflops"]),
        ("GFLOP/s (+attention)", result["gflops_with_attention"]),
        ("start-up s (-> ready)", result["startup_s"]),
        ("start-up s (-> 1st token)", result["startup_to_first_token_s"] or float("nan")),
        ("peak RSS MiB (process)", result["peak_rss_mib"]),
        ("peak RSS MiB (tree)", result["peak_rss_tree_mib"] or float("nan")),
        ("load average at start", result["machine"]["loadavg"]),
    ]
    common.print_result("throughput", rows)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1 or args.output_len < 1:
        raise SystemExit("--num-prompts and --output-len must be positive")
    result = run(args)
    report(result)
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

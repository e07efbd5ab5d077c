#!/usr/bin/env bash
# ik_llama.cpp, the llama.cpp fork tuned for CPUs (github.com/ikawrakow/ik_llama.cpp), as kvloom's second
# real-size peer: llama-bench, llama-batched-bench, llama-server and llama-sweep-bench built for this CPU.
# Idempotent: skips what exists. Output: .peers/ikllamacpp/bin/. Its best CPU flags, which
# benchmarks/peers/llamacpp_realsize.py passes (--peers llama.cpp,ik_llama.cpp): -rtr 1 (run-time repack
# into its row-interleaved types, Q4_K_R4 / Q8_0_R8 ...) and -fa 1.
#
#   bash benchmarks/peers/setup_ikllamacpp.sh
#   IKLLAMA_SRC=/path/to/a/clone bash benchmarks/peers/setup_ikllamacpp.sh     # an existing clone or mirror
#
# IKLLAMA_SRC: where to clone from (default the public repository); IKLLAMA_COMMIT: the commit built (pinned,
# so figures name one tree). Built as its README builds it for CPUs (OpenMP on), with
# GGML_IQK_FA_ALL_QUANTS=OFF: f16 KV only in its flash attention (no peer run here quantizes its KV cache,
# and the quantized-KV kernels would multiply the build time on 2 cores).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DEST="$ROOT/.peers/ikllamacpp"
SRC="${IKLLAMA_SRC:-https://github.com/ikawrakow/ik_llama.cpp}"
COMMIT="${IKLLAMA_COMMIT:-8337e4cd3861406fc04e0854b1409cd1b027fbc9}"
JOBS="${JOBS:-2}"
TOOLS="llama-bench llama-batched-bench llama-server llama-sweep-bench"
BIN="$DEST/bin"
BUILD="$DEST/build"
mkdir -p "$DEST"

missing_tool() { for t in $TOOLS; do [ -x "$BIN/$t" ] || return 0; done; return 1; }
if missing_tool; then
    if [ ! -d "$DEST/src/.git" ]; then
        rm -rf "$DEST/src"
        git clone --no-checkout "$SRC" "$DEST/src"
    fi
    git -C "$DEST/src" checkout -q "$COMMIT"
    # GGML_NATIVE: -march=native (AVX2, AVX-512, VNNI... as this CPU has them). LLAMA_CURL=OFF: no downloads.
    cmake -S "$DEST/src" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DGGML_IQK_FA_ALL_QUANTS=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF
    # shellcheck disable=SC2086
    cmake --build "$BUILD" --target $TOOLS -j "$JOBS"
    mkdir -p "$BIN"
    for t in $TOOLS; do cp "$BUILD/bin/$t" "$BIN/"; done
    git -C "$DEST/src" rev-parse HEAD > "$BIN/COMMIT"
fi
echo "ik_llama.cpp tools ($(cat "$BIN/COMMIT" 2>/dev/null || echo "$COMMIT")): $BIN ($TOOLS)"

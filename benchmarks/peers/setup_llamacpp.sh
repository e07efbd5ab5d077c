#!/usr/bin/env bash
# llama.cpp's llama-server and llama-quantize, built from the vendored sources of the llama-cpp-python sdist.
# Idempotent: skips what exists. Output: .peers/llamacpp/bin/llama-server, llama-quantize, llama-bench,
# llama-batched-bench (LLAMACPP_TOOLS_ONLY=1 stops there), the bf16 GGUF
# (.peers/smollm2-bf16.gguf), an F16 GGUF of the same checkpoint (.peers/smollm2-f16.gguf, llama.cpp's
# usual 16-bit float type), the Q8_0 made from the bf16 by llama-quantize (.peers/smollm2-q8_0.gguf,
# the peer of kvloom's int8) and its Q4_0, Q4_K_M, Q5_K_M and Q6_K; llama-perplexity and llama-tokenize in
# .peers/llamacpp/build/bin (benchmarks/gguf_perplexity.py).
#
#   bash benchmarks/peers/setup_llamacpp.sh
#   .peers/llamacpp/bin/llama-server -m .peers/smollm2-bf16.gguf -np 64 -cb -t 2 -c 65536 --port 8081
#   .venv/bin/kvloom bench throughput --peer llamacpp --gguf f16|q8_0|bf16|PATH
#
# The bf16 and F16 GGUFs are made by make_hf_checkpoint.py (HF checkpoint) and then llama.cpp's
# convert_hf_to_gguf.py (--outtype bf16 / f16): `bash benchmarks/peers/setup_llamacpp.sh` does both
# when the main venv exists.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DEST="$ROOT/.peers/llamacpp"
PIP="${PIP:-$ROOT/.venv/bin/pip}"
PY="${PY:-$ROOT/.venv/bin/python}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
mkdir -p "$DEST"

TOOLS="llama-server llama-quantize llama-bench llama-batched-bench"
# LLAMACPP_ISA=avx2: a second build for AVX2 alone (no AVX-512) in .peers/llamacpp/bin-avx2, the peer of
# kvloom at KVLOOM_CPU_ISA=avx2 on a CPU that has more (llamacpp_realsize.py --llamacpp-bin).
ISA="${LLAMACPP_ISA:-native}"
case "$ISA" in
    native) BIN="$DEST/bin"; BUILD="$DEST/build"
            ISA_FLAGS="-DGGML_NATIVE=ON" ;;
    avx2) BIN="$DEST/bin-avx2"; BUILD="$DEST/build-avx2"
          ISA_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF" ;;
    *) echo "LLAMACPP_ISA must be native or avx2, got $ISA" >&2; exit 2 ;;
esac
missing_tool() { for t in $TOOLS; do [ -x "$BIN/$t" ] || return 0; done; return 1; }
if missing_tool; then
    if [ ! -d "$DEST/src" ]; then
        rm -rf "$DEST/sdist" && mkdir -p "$DEST/sdist"
        "$PIP" download --no-deps --no-binary llama-cpp-python -d "$DEST/sdist" "llama-cpp-python==$VERSION"
        tar -xzf "$DEST"/sdist/llama_cpp_python-*.tar.gz -C "$DEST/sdist"
        mv "$DEST"/sdist/llama_cpp_python-*/vendor/llama.cpp "$DEST/src"
        rm -rf "$DEST/sdist"
    fi
    # LLAMA_CURL=OFF: no downloads at run time (and no libcurl needed). GGML_NATIVE builds for this
    # CPU's own instruction set (-march=native: AVX2 here, AVX-512 / bf16 where the CPU has them).
    # Built without AMX: on an Intel Xeon with AMX (2 cores of a VM) this version's AMX path segfaults in
    # ggml_backend_amx_mul_mat at llama-server's first batch of SmolLM2 (and so does llama-perplexity);
    # without it ggml runs its AVX-512 VNNI kernels. LLAMA_CPP_AMX=1 keeps AMX in.
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    if [ "${LLAMA_CPP_AMX:-0}" = 1 ]; then NO_AMX=""; fi
    # shellcheck disable=SC2086
    cmake -S "$DEST/src" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
        $ISA_FLAGS -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
        -DBUILD_SHARED_LIBS=OFF
    # shellcheck disable=SC2086
    cmake --build "$BUILD" --target $TOOLS -j "$JOBS"
    mkdir -p "$BIN"
    for t in $TOOLS; do cp "$BUILD/bin/$t" "$BIN/"; done
fi
echo "llama.cpp tools: $BIN ($TOOLS)"
if [ "$ISA" != native ]; then exit 0; fi
# LLAMACPP_TOOLS_ONLY=1: the binaries only (benchmarks/peers/llamacpp_realsize.py makes its own GGUFs).
if [ "${LLAMACPP_TOOLS_ONLY:-0}" = 1 ]; then exit 0; fi

# A GGUF of the HF checkpoint in one float type (convert_hf_to_gguf.py needs gguf-py from the same sources):
# bf16, and f16 (its bf16 weights fit f16's wider mantissa exactly, except magnitudes outside f16's normal
# range, below 6.1e-5 or above 65504).
HF="$ROOT/.peers/smollm2-hf"
convert() {  # convert OUTTYPE FILE
    [ -f "$2" ] && return
    [ -f "$HF/config.json" ] || bash "$ROOT/benchmarks/peers/setup_transformers.sh"
    # The converter imports sentencepiece before it looks for a tokenizer.model (SmolLM2 has none).
    "$PY" -c "import sentencepiece" 2>/dev/null || "$PY" -m pip install -q sentencepiece
    PYTHONPATH="$DEST/src/gguf-py" "$PY" "$DEST/src/convert_hf_to_gguf.py" "$HF" --outtype "$1" --outfile "$2"
}
GGUF="$ROOT/.peers/smollm2-bf16.gguf"
convert bf16 "$GGUF"
echo "bf16 GGUF: $GGUF"
F16="$ROOT/.peers/smollm2-f16.gguf"
convert f16 "$F16"
echo "F16 GGUF: $F16"

# llama.cpp's own quantizations of the same weights (Q8_0: what its users run when they quantize to 8 bits).
for TYPE in Q8_0 Q4_0 Q4_K_M Q5_K_M Q6_K; do
    OUTFILE="$ROOT/.peers/smollm2-$(echo "$TYPE" | tr 'A-Z' 'a-z').gguf"
    [ -f "$OUTFILE" ] || "$DEST/bin/llama-quantize" "$GGUF" "$OUTFILE" "$TYPE" "$JOBS"
    echo "$TYPE GGUF: $OUTFILE"
done

# llama.cpp's perplexity and tokenizer tools (benchmarks/gguf_perplexity.py compares kvloom against them).
if [ ! -x "$DEST/build/bin/llama-perplexity" ] || [ ! -x "$DEST/build/bin/llama-tokenize" ]; then
    cmake --build "$DEST/build" --target llama-perplexity llama-tokenize -j "$JOBS"
fi

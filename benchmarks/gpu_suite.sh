#!/usr/bin/env bash
# Everything a lent GPU machine should run, in one call: the GPU tests (the Triton kernels at model sizes, the
# engine and every feature on CUDA), then the GPU figures of docs/benchmarks.md (kvloom against HF
# transformers on a Llama-3.2-1B-shaped model, the decode step against the HBM bound, cold/warm start,
# n-gram speculation at batch 1). Each stage has its own time limit, so one that hangs costs only its share.
#
#   OUT=/tmp/gpu-out bash benchmarks/gpu_suite.sh [tests] [throughput] [step] [start] [spec] [variants]
#   (default: all; variants: 4-bit GPTQ weights, int8 weights and an fp8 KV cache against bf16, 256 prompts)
#
# Logs and JSON land in $OUT (default ./bench_results/gpu). The spec stage needs SmolLM2's GGUF: set SMOLLM2_GGUF
# to its path (it is skipped without one). Python: $PYTHON (default python3).
set -u
OUT=${OUT:-bench_results/gpu}
PY=${PYTHON:-python3}
CKPT=${CKPT:-/tmp/kvloom-gpu-ckpt}
BW=${HBM_BANDWIDTH:-3.35e12}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export KVLOOM_COMPILED_ARTIFACTS=${KVLOOM_COMPILED_ARTIFACTS:-/tmp/kvloom-artifacts}
stages=${*:-tests throughput step start spec variants}

stage() {  # stage NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, say how it ended
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0)) s"
    tail -n "${TAIL:-6}" "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"

for s in $stages; do case $s in
tests)
    TAIL=25 stage tests "${TESTS_LIMIT:-240}" $PY -m pytest -q -p no:cacheprovider -n "${TESTS_WORKERS:-4}" --timeout 200 -rfE \
        tests/gpu tests/unit/test_triton_q4.py tests/unit/test_moe_triton.py tests/unit/test_triton_attention.py \
        tests/unit/test_triton_fused.py \
        "tests/unit/test_int8_ops.py::test_triton_int8_linear_matches_reference" \
        "tests/unit/test_int8_ops.py::test_gpu_triton_int8_linear_bf16_at_model_sizes" \
        "tests/unit/test_int8_ops.py::test_cuda_packs_block_scaled_weights_per_row" \
        "tests/unit/test_lora.py::test_triton_delta_matches_reference" \
        "tests/unit/test_structured_output.py::test_gpu_triton_bitmask_kernel_matches_torch_at_model_sizes" ;;
throughput)
    for n in ${WORKLOADS:-256 64}; do
        stage "throughput-$n" "${THROUGHPUT_LIMIT:-150}" $PY benchmarks/gpu_throughput.py --workload "$n" \
            --engines "${ENGINES:-kvloom,kvloom-sync,hf}" --checkpoint-dir "$CKPT" --repeats "${REPEATS:-3}" \
            --bandwidth "$BW" --json "$OUT/throughput-$n.json"
    done ;;
step)
    stage step 60 $PY benchmarks/gpu_step_profile.py --model "$CKPT" -n 256 --bandwidth "$BW" --no-detokenize
    if [ "${STEP_SYNC:-1}" = 1 ]; then
        stage step-sync 60 $PY benchmarks/gpu_step_profile.py --model "$CKPT" -n 256 --bandwidth "$BW" \
            --no-detokenize --sync-scheduling
    fi ;;
start)
    stage start 90 $PY benchmarks/gpu_start.py --model "$CKPT" --starts 3 --json "$OUT/start.json" \
        --profile "$OUT/start-profile.txt"
    if [ "${START_EAGER_CAPTURE:-1}" = 1 ]; then
        stage start-eager-capture 60 $PY benchmarks/gpu_start.py --model "$CKPT" --starts 2 --graph-capture start
    fi ;;
spec)
    if [ -n "${SMOLLM2_GGUF:-}" ]; then
        stage spec "${SPEC_LIMIT:-150}" $PY benchmarks/speculative.py --model "$SMOLLM2_GGUF" --batch 1 \
            --num-prompts "${SPEC_PROMPTS:-6}" --repeats "${SPEC_REPEATS:-3}" --workload copy --max-tokens 128 \
            --full-warmup --step-times
    else
        echo "== spec: skipped (SMOLLM2_GGUF unset)"
    fi ;;
variants)
    stage variants "${VARIANTS_LIMIT:-180}" $PY benchmarks/gpu_throughput.py --workload 256 \
        --engines kvloom,kvloom-gptq,kvloom-int8,kvloom-kv-fp8 --checkpoint-dir "$CKPT" --repeats "${REPEATS:-3}" \
        --bandwidth "$BW" --json "$OUT/variants.json" ;;
*) echo "unknown stage $s" ;;
esac; done

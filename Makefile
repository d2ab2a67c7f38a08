# Every target bootstraps its own virtualenv: a fresh machine needs only python3 and make.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow test-all test-llamacpp check check-terraform bench docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,geolite]'
	touch $(STAMP)

## demo: run the whole local topology on the embedded defaults (SQLite, shipped GeoLite2)
demo: $(STAMP)
	$(BIN)/python -m gtm.demo

## test: the suite CI runs (slow suites excluded; PostgreSQL tests need GTM_TEST_POSTGRES_URL or pg_ctl).
## On TEST_WORKERS processes (pytest-xdist), a file's tests on one worker: most tests wait on
## subprocesses, servers and sockets, so more workers than cores still pays. Then the tests
## marked timing (they hold the product to seconds of wall clock) alone, unloaded by the rest.
TEST_WORKERS ?= 3
test: $(STAMP)
	$(BIN)/pytest -m "not slow and not llamacpp and not timing" -n $(TEST_WORKERS) --dist loadfile \
	  -q --durations=15
	$(BIN)/pytest -m "timing and not slow and not llamacpp" -q --durations=5

## test-llamacpp: the regional balancer in front of a real llama-cpp-python server. Installs the
## llamacpp extra first: llama-cpp-python compiles llama.cpp from source (about ten minutes on
## two cores, once: pip keeps the built wheel in its cache, so later installs take seconds).
LLAMA_STAMP := $(VENV)/.llamacpp-installed
$(LLAMA_STAMP): $(STAMP)
	CMAKE_ARGS="$${CMAKE_ARGS:--DGGML_NATIVE=OFF}" $(BIN)/pip install --quiet -e '.[llamacpp]'
	touch $@

test-llamacpp: $(LLAMA_STAMP)
	GTM_TEST_REQUIRE_LLAMACPP=1 $(BIN)/pytest -m llamacpp -q --durations=5

test-slow: $(STAMP)
	$(BIN)/pytest -m slow -q

test-all: $(STAMP)
	$(BIN)/pytest -q

## check: lint, format, strict typing and the import layering (pyproject [tool.importlinter])
check: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

## check-terraform: terraform fmt, then checkov (a static security scan) in its own virtualenv
## (checkov pulls many dependencies, so it stays out of the project's); 0 failed checks, every
## exception justified inline with #checkov:skip=CKV_...:reason
CHECKOV_VENV    := .venv-checkov
CHECKOV_VERSION ?= 3.3.30
$(CHECKOV_VENV)/.installed:
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install --quiet --upgrade pip
	$(CHECKOV_VENV)/bin/pip install --quiet 'checkov==$(CHECKOV_VERSION)'
	touch $@

check-terraform: $(CHECKOV_VENV)/.installed
	terraform fmt -check -recursive terraform
	$(CHECKOV_VENV)/bin/checkov --directory terraform --framework terraform --compact --quiet --skip-download

## docs: the documentation site (mkdocs.yml, docs/) built into site/; --strict fails on a broken
## link or a page left out of the nav. Its own extra, installed on first use.
$(VENV)/.docs-installed: $(STAMP)
	$(BIN)/pip install --quiet -e '.[docs]'
	touch $@

docs: $(VENV)/.docs-installed
	$(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python bench/decide.py

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) site .pytest_cache .mypy_cache .ruff_cache

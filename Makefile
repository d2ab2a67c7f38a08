# Every target bootstraps its own virtualenv: a fresh machine needs only python3 and make.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow test-all check bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,geolite]'
	touch $(STAMP)

## demo: run the whole local topology on the embedded defaults (SQLite, shipped GeoLite2)
demo: $(STAMP)
	$(BIN)/python -m gtm.demo

## test: the suite CI runs (slow suites excluded; PostgreSQL tests need GTM_TEST_POSTGRES_URL or pg_ctl)
test: $(STAMP)
	$(BIN)/pytest -m "not slow" -q

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

bench: $(STAMP)
	$(BIN)/python bench/decide.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

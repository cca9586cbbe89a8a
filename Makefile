# The two commands a user needs: `make demo` and `make test`. Both set up everything.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint format bench clean java

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory java
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

java:
	@command -v java >/dev/null || { echo "error: Java 17+ is required by Spark and was not found on PATH (Debian: apt-get install openjdk-17-jre-headless)" >&2; exit 1; }
	@v=$$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1); \
	 if [ -z "$$v" ] || [ "$$v" -lt 17 ]; then echo "error: Java 17+ is required by Spark; found '$$v' (Debian: apt-get install openjdk-17-jre-headless)" >&2; exit 1; fi

demo: $(STAMP)
	$(BIN)/dejaq demo

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/python bench/report.py

clean:
	rm -rf $(VENV) .pytest_cache warehouse .dejaq

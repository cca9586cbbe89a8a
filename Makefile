# The two commands a user needs: `make demo` and `make test`. Both set up everything.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The pinned JVM jars (jvm/<set>/pom.xml), copied from Maven Central into jvm/lib/<set>.
JARS := jvm/lib/spark/.fetched jvm/lib/s3a/.fetched jvm/lib/kafka/.fetched jvm/lib/s3proxy/.fetched
# Debian's Chromium, for the test that renders the broker's /docs page in a real browser.
BROWSER := .venv/.chromium
SETUP := $(STAMP) $(JARS)

.PHONY: demo test lint format bench clean java rust

# The broker's compiled core (broker/core: Rust through PyO3, built by maturin with the
# crates pinned in its Cargo.lock) is built again only when its sources change.
CORE := broker/core/pyproject.toml broker/core/Cargo.toml broker/core/Cargo.lock $(wildcard broker/core/src/*.rs)

$(STAMP): pyproject.toml client/pyproject.toml $(CORE)
	@$(MAKE) --no-print-directory java rust
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ./client ./broker/core -e '.[dev]'
	@touch $(STAMP)

rust:
	@command -v cargo >/dev/null || { echo "error: Rust's cargo is required to build the broker's core (broker/core); install it with rustup (https://rustup.rs)" >&2; exit 1; }

java:
	@command -v java >/dev/null || { echo "error: Java 17+ is required by Spark and was not found on PATH (Debian: apt-get install openjdk-17-jre-headless)" >&2; exit 1; }
	@v=$$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1); \
	 if [ -z "$$v" ] || [ "$$v" -lt 17 ]; then echo "error: Java 17+ is required by Spark; found '$$v' (Debian: apt-get install openjdk-17-jre-headless)" >&2; exit 1; fi

# A set is fetched again only when its pom changes; nothing is resolved at run time.
jvm/lib/%/.fetched: jvm/%/pom.xml
	@$(MAKE) --no-print-directory java
	@command -v mvn >/dev/null || { echo "error: Maven is required to fetch the pinned JVM jars (Debian: apt-get install maven)" >&2; exit 1; }
	rm -rf jvm/lib/$*
	mvn --batch-mode --quiet --file jvm/$*/pom.xml dependency:copy-dependencies
	@touch $@

demo: $(SETUP)
	$(BIN)/dejaq demo

$(BROWSER): $(STAMP)
	@command -v chromium >/dev/null || { \
	  [ "$$(id -u)" = 0 ] || { echo "error: the tests need Chromium (Debian: apt-get install chromium)" >&2; exit 1; }; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; }
	@touch $@

test: $(SETUP) $(BROWSER)
	$(BIN)/python -m pytest

lint: $(SETUP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	cd broker/core && cargo fmt --check && cargo clippy --release --locked -- -D warnings

format: $(SETUP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .
	cd broker/core && cargo fmt

bench: $(SETUP)
	$(BIN)/python bench/report.py

clean:
	rm -rf $(VENV) .pytest_cache warehouse .dejaq jvm/lib broker/core/target
